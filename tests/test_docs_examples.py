"""Every fenced example in README.md and docs/ runs as written, or is marked and listed as not run.

A fenced block is an example unless its language says it is a display or a config file (`text`,
`mermaid`, `yaml`, `json`, `toml`). An example that cannot run on a CPU in the suite (a 70B
checkpoint, a GPU, the development data) carries `<!-- example: not run (REASON) -->` on the line
before its fence. NOT_RUN below lists every such block of the user's-manual pages this test's
authors keep (README, usage, formats, troubleshooting, ...) by page and first line; on the pages
other contributors keep (serve, self-draft, memory-plan, performance, gpu-status, ...) a mark with
its reason is enough, and `test_every_example_runs_or_is_listed` prints the whole list. So a block
is never skipped silently: an unlisted mark, or an unmarked block that cannot run, fails here.

The others run (slow tests) on the embedded demo pair, in a scratch directory that holds the clone's
`examples/` and `specexec_cli/` (commands are written from the root of the clone), with their own
`SPECX_CACHE` and XDG directories, and the tree under test first on `PYTHONPATH` (as
tests/serve_util.py's servers: a shared interpreter's editable install may point at another clone,
or at one that is gone, and then `specx` and `python -m specexec_cli` would run other code or
none): bash blocks through `bash -euo pipefail` (`pip install` steps are left out: the suite runs
in an installed checkout, tests/test_readme_commands.py checks the install lines and
tests/test_e2e.py installs into a fresh venv), python blocks through the interpreter. A block that
talks to `127.0.0.1:8000` / `localhost:8000` runs against a live `specx serve` on the demo pair (on
a free port, written into the block in place of 8000).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DISPLAY = {"text", "mermaid", "yaml", "json", "toml"}
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```\n", re.S | re.M)
MARK = re.compile(r"<!-- example: not run \((.+?)\) -->\s*$")
SERVER = re.compile(r"(127\.0\.0\.1|localhost):8000")

# (page, first line of the block) of every example that is marked not run, and why
NOT_RUN = {
    ("README.md", "# see the memory plan first, without a GPU and without reading a single weight"): "70B",
    ("usage.md", "# 16-bit target (140 GB) with 64 GB of RAM: what does not fit in RAM streams from NVMe"): "70B",
    (
        "usage.md",
        "specx chat --target ~/models/Llama-3.1-70B-Instruct --draft ~/models/Llama-3.2-1B-Instruct --dtype nf4 \\",
    ): "70B",
    (
        "usage.md",
        "specx serve --target ~/models/Llama-3.1-70B-Instruct --draft ~/models/Llama-3.2-1B-Instruct --offload ram",
    ): "server",
    (
        "usage.md",
        "specx profile --target ~/models/Llama-3.1-70B-Instruct --draft ~/models/Llama-3.2-1B-Instruct",
    ): "70B",
    (
        "usage.md",
        "specx quantize --target ~/models/Llama-3.1-70B-Instruct --out ~/models/Llama-3.1-70B-Instruct-nf4",
    ): "70B",
    ("usage.md", "specx info ~/models/Llama-3.1-70B-Instruct"): "70B",
}


@dataclass(frozen=True)
class Block:
    page: str
    lang: str
    body: str
    mark: str | None  # the REASON of a not-run mark, else None

    @property
    def first(self) -> str:
        return next(line for line in self.body.splitlines() if line.strip())


def blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) in DISPLAY:
                continue
            before = text[: m.start()].rstrip("\n").splitlines()
            mark = MARK.search(before[-1]) if before else None
            out.append(Block(page.name, m.group(1), m.group(2), mark.group(1) if mark else None))
    return out


def runnable() -> list[Block]:
    return [b for b in blocks() if b.mark is None]


LISTED_PAGES = {
    "README.md",
    "usage.md",
    "formats.md",
    "troubleshooting.md",
    "how-it-works.md",
    "architecture.md",
    "coupled-sampling.md",
    "flags.md",
    "README",
}


def test_every_example_runs_or_is_listed():
    every = [b for b in blocks() if b.mark is not None]
    print("\nexamples not run:\n" + "\n".join(f"  {b.page}: {b.first[:70]} ({b.mark})" for b in every))
    marked = {(b.page, b.first) for b in every if b.page in LISTED_PAGES}
    assert marked == set(NOT_RUN), (
        "marked not run, not in NOT_RUN",
        marked - set(NOT_RUN),
        "in NOT_RUN, not marked",
        set(NOT_RUN) - marked,
    )
    for b in runnable():
        assert b.lang in ("bash", "python"), f"{b.page}: an unmarked {b.lang or 'untagged'} block: {b.first}"
        assert "~/models/" not in b.body and "../shared" not in b.body, f"{b.page}: cannot run here: {b.first}"


def test_the_mark_is_read():
    page = "x\n<!-- example: not run (needs a GPU) -->\n```bash\nnvidia-smi\n```\n\n```text\nout\n```\n"
    m = FENCE.search(page)
    assert (
        m.group(1) == "bash" and MARK.search(page[: m.start()].rstrip("\n").splitlines()[-1]).group(1) == "needs a GPU"
    )


def without_installs(script: str) -> str:
    """The block with its `pip install` steps left out (continuation lines joined first)."""
    lines = []
    for line in re.sub(r"\\\n\s*", " ", script).splitlines():
        steps = [s for s in line.split("&&") if not s.strip().startswith("pip install")]
        if steps:
            lines.append("&&".join(steps))
    return "\n".join(lines) + "\n"


def test_install_steps_are_left_out():
    assert (
        without_installs("pip install torch==2.13.0 -e . && specx run examples/prompt.txt\n")
        == " specx run examples/prompt.txt\n"
    )
    assert without_installs("pip install -e '.[lowbit]'\nspecx chat \\\n  --x 1\n") == "specx chat  --x 1\n"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory laid out like the clone's root for the examples, and their environment."""
    root = tmp_path_factory.mktemp("examples")
    for name in ("examples", "specexec_cli"):
        (root / name).symlink_to(ROOT / name)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        SPECX_CACHE=str(root / ".cache"),
        XDG_CONFIG_HOME=str(root / ".config"),
        XDG_STATE_HOME=str(root / ".state"),
        NO_COLOR="1",
        COLUMNS="80",
    )
    return root, env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(scratch):
    """`specx serve` on the demo pair, on a free port, up until the module's blocks are done."""
    root, env = scratch
    port = free_port()
    log = open(root / "serve.log", "w")  # noqa: SIM115 - the server writes to it until the fixture ends
    proc = subprocess.Popen(
        [sys.executable, "-m", "specexec_cli", "serve", "--port", str(port)],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"specx serve exited: {(root / 'serve.log').read_text()[-2000:]}")
            try:
                import httpx

                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except Exception:  # not listening yet
                time.sleep(1)
        else:
            pytest.fail("specx serve did not come up in 300 s")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@pytest.mark.slow
@pytest.mark.parametrize("block", runnable(), ids=lambda b: f"{b.page}:{b.first[:40]}")
def test_example_runs_as_written(block, scratch, request):
    root, env = scratch
    body = block.body
    if SERVER.search(body):
        port = request.getfixturevalue("server")
        body = SERVER.sub(lambda m: f"{m.group(1)}:{port}", body)
    if block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", without_installs(body)]
    else:
        cmd = [sys.executable, "-c", body]
    r = subprocess.run(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (block.first, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
