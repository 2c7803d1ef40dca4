"""One command resolves each model once (issue 53.2): a `specx run` (and the server's start-up)
resolves `--target`/`--draft` to a path, checks the weights, opens the checkpoint and loads the
tokenizer at most once per model, and encodes the prompt once.

Counted from the outside: every specexec_cli module's binding of `resolve_path`, `check_weights` and
`encode_prompt` is wrapped, and so are `offload.formats.open_checkpoint` and
`AutoTokenizer.from_pretrained`, each call keyed by the model it was for.
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specexec_cli.terminal.app import app

WRAPPED = ("resolve_path", "check_weights", "encode_prompt")
MODULES = [f"specexec_cli.session.{m}" for m in ("names", "loading", "options", "planning", "deps", "prompts")]
MODULES += ["specexec_cli.serve.server", "specexec_cli.serve.names", "specexec_cli.session.modelref"]


def _model_of(args) -> str:
    """The flag (or path) a call was for: a ModelRef's flag, else the flag or path among its arguments."""
    for a in args:
        if hasattr(a, "flag"):
            return a.flag
        if isinstance(a, str) and a.startswith("--"):
            return a
    return str(Path(args[0]).resolve()) if args else "?"


@pytest.fixture
def calls(monkeypatch):
    """Counter of (what, model) over every call from now on."""
    import transformers

    import offload.formats

    for mod in MODULES:  # the modules a run imports lazily, so that their bindings are there to wrap
        importlib.import_module(mod)
    seen: Counter = Counter()

    def counting(what, real, key):
        def wrapper(*args, **kwargs):
            seen[what, key(args)] += 1
            return real(*args, **kwargs)

        return wrapper

    for what in WRAPPED:
        originals = {
            getattr(m, what)
            for n, m in list(sys.modules.items())
            if n.startswith("specexec_cli") and callable(getattr(m, what, None))
        }
        for real in originals:
            wrapper = counting(what, real, _model_of if what != "encode_prompt" else lambda a: "prompt")
            for name, mod in list(sys.modules.items()):
                if name.startswith("specexec_cli") and getattr(mod, what, None) is real:
                    monkeypatch.setattr(mod, what, wrapper)
    open_ck = offload.formats.open_checkpoint
    monkeypatch.setattr(
        offload.formats, "open_checkpoint", counting("open_checkpoint", open_ck, lambda a: str(Path(a[0]).resolve()))
    )
    tok = transformers.AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        classmethod(counting("tokenizer", tok, lambda a: str(Path(a[1]).resolve()))),
    )
    return seen


def _run(*args):
    r = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            "def f(x):",
            "--device",
            "cpu",
            "--max-new-tokens",
            "3",
            "--budget",
            "4",
            "--no-live",
            *map(str, args),
        ],
    )
    assert r.exit_code == 0, (r.output, r.exception)


def _per_model(calls: Counter, pair) -> dict:
    """{what: {model: count}} with paths named by their flag."""
    names = {str(pair[0].resolve()): "--target", str(pair[1].resolve()): "--draft"}
    out: dict = {}
    for (what, model), n in calls.items():
        out.setdefault(what, {})[names.get(model, model)] = n
    return out


def _once(*flags, prompt: bool = True) -> dict:
    """What a command may do: each step once per model, and one prompt encode."""
    each = dict.fromkeys(flags, 1)
    steps = {what: each for what in ("resolve_path", "check_weights", "open_checkpoint", "tokenizer")}
    return steps | ({"encode_prompt": {"prompt": 1}} if prompt else {})


def test_run_without_a_draft_resolves_the_target_once(tiny_pair, calls):
    _run("--target", tiny_pair[0], "--method", "ar")
    assert _per_model(calls, tiny_pair) == _once("--target")


def test_run_with_a_draft_resolves_each_model_once(tiny_pair, calls):
    _run("--target", tiny_pair[0], "--draft", tiny_pair[1])
    assert _per_model(calls, tiny_pair) == _once("--target", "--draft")


def test_server_start_up_resolves_each_model_once(tiny_pair, calls):
    """run_server's front (flags.plan), serve_on's model id and the worker's load(), in process."""
    from specexec_cli.serve import server
    from specexec_cli.serve.names import model_id
    from specexec_cli.session.options import ModelFlags

    flags = ModelFlags(target=str(tiny_pair[0]), draft=str(tiny_pair[1]), device="cpu", budget="4")
    opts, plan, cfg = flags.plan(flags.config())
    assert model_id(opts.target.name, opts.target.path) == "target"
    session, defaults = server.make_loader(flags, opts, plan, cfg, None)()
    assert session.models.tokenizer is opts.target.tokenizer and defaults is not None
    assert _per_model(calls, tiny_pair) == _once("--target", "--draft", prompt=False)
