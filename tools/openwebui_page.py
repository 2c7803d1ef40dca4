"""What tools/openwebui_check.py does on Open WebUI's chat page (playwright's sync API, one page).

Contract: `ChatPage(page, ui, model)` wraps a logged-in page. `new_chat()` opens an empty chat with
the model, `open(url)` an earlier one, `send(text)` types a message and presses Enter, `follow_up()`
clicks the first follow-up suggestion under the last reply (its text, or None when the page shows
none), `regenerate()` clicks the last reply's Regenerate button and "Try Again" in the menu it
opens. Each of those returns what `watch()` saw: the reply's text, seconds from the action to its
first text and to its last token (the last time the text changed), and seconds from that last token
until the page was idle again (no Stop button: Open WebUI shows it while the reply or its background
tasks run); with `stop_after=S` it presses Stop S seconds after the first text and records when.
Times are wall seconds polled every POLL s, so each is late by at most POLL.
"""

from __future__ import annotations

import re
import time

POLL = 0.1
NOTHING = 60  # seconds without a reply or a Stop button: the action did nothing
STOP = "button[aria-label='Stop']"
# The follow-up suggestions: a "Follow up" heading, then one button per suggestion (aria-label: its text).
FOLLOW_UPS = """() => {
  const heads = [...document.querySelectorAll('div.text-sm')].filter(d => d.innerText.trim() === 'Follow up');
  const box = heads.length ? heads[heads.length - 1].nextElementSibling : null;
  return box ? [...box.querySelectorAll('button')].map(b => b.getAttribute('aria-label') || b.innerText) : [];
}"""


class ChatPage:
    def __init__(self, page, ui: str, model: str):
        self.page, self.ui, self.model = page, ui, model

    def replies(self) -> list[str]:
        return [t.strip() for t in self.page.locator("#response-content-container").all_inner_texts()]

    def busy(self) -> bool:
        return self.page.locator(STOP).count() > 0

    def _ready(self) -> None:
        box = self.page.locator("#chat-input")
        box.wait_for(timeout=60_000)
        dismiss_dialogs(self.page)
        self.page.wait_for_timeout(1000)

    def new_chat(self) -> None:
        self.page.goto(f"{self.ui}/?models={self.model}")
        self._ready()

    def open(self, url: str) -> None:
        self.page.goto(url)
        self._ready()

    def send(self, text: str, stop_after: float | None = None, limit: float = 600) -> dict:
        before = self.replies()
        self.page.locator("#chat-input").click()
        self.page.keyboard.type(text)
        t0 = time.monotonic()
        self.page.keyboard.press("Enter")
        return self.watch(t0, before, stop_after, limit)

    def follow_up(self, limit: float = 600) -> dict | None:
        chips = self.page.evaluate(FOLLOW_UPS)
        if not chips:
            return None
        before = self.replies()
        button = self.page.locator(f"button[aria-label={_quoted(chips[0])}]").last
        t0 = time.monotonic()
        button.click()
        # Clicking a suggestion sends it (Open WebUI's default) or only fills the composer.
        self.page.wait_for_timeout(500)
        if not self.busy() and len(self.replies()) == len(before):
            self.page.keyboard.press("Enter")
        return self.watch(t0, before, None, limit) | {"sent": chips[0]}

    def regenerate(self, limit: float = 600) -> dict:
        before = self.replies()
        self.page.locator("#response-content-container").last.hover()
        t0 = time.monotonic()
        self.page.locator("button[aria-label='Regenerate']").last.click()
        again = self.page.get_by_text("Try Again", exact=True)  # its menu (regenerateMenu, on by default)
        self.page.wait_for_timeout(500)
        if again.count():
            again.first.click()
        return self.watch(t0, before, None, limit)

    def watch(self, t0: float, before: list[str], stop_after: float | None, limit: float) -> dict:
        """Poll the page until the new reply has text and the Stop button is gone (or `limit` s)."""
        old = before[-1] if before else ""
        text, first, last, stopped, idle = "", None, None, None, None
        while time.monotonic() - t0 < limit:
            now_all = self.replies()
            fresh = len(now_all) > len(before) or (now_all and now_all[-1] != old)
            now = now_all[-1] if fresh else ""
            t = time.monotonic() - t0
            if now and first is None:
                first = t
            if now != text:
                text, last = now, t
            busy = self.busy()
            if stop_after is not None and stopped is None and first is not None and t - first >= stop_after and busy:
                self.page.locator(STOP).first.click()
                stopped = t
            if first is not None and not busy:
                idle = t
                break
            if first is None and not busy and t > NOTHING:  # the action started no reply
                break
            time.sleep(POLL)
        return {"first_text_s": _r(first), "last_token_s": _r(last), "stopped_at_s": _r(stopped),
                "idle_after_last_token_s": _r(idle - last) if idle is not None and last is not None else None,
                "reply_chars": len(text), "reply": text}  # fmt: skip

    def shot(self, path) -> None:
        self.page.screenshot(path=str(path), full_page=True)


def dismiss_dialogs(page) -> None:
    """Close what a first visit shows over the chat (the release notes' "Okay, Let's Go!" dialog)."""
    for _ in range(5):
        page.wait_for_timeout(1000)
        dialog = page.locator("div[role=dialog]")
        if dialog.count() == 0 or not dialog.first.is_visible():
            return
        button = dialog.first.get_by_role("button", name=re.compile("okay|let's go|close|dismiss", re.I))
        if button.count():
            button.first.click()
        else:
            page.keyboard.press("Escape")


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)
