"""The run's non-timing phases: the environment, tests/test_cuda.py, the demo pair end to end.

Contract (each returns the phase's JSON dict; `ctx` holds device, out, smoke):
- `env`: Python, torch (+ CUDA), every requirement of pyproject.toml and the run's extras with the
  installed version and whether it is inside the declared range; `missing` lists those absent or
  outside, and the phase fails (so the run stops) when one is.
- `cuda_tests`: `python -m pytest tests/test_cuda.py` in a child (PYTHONPATH as the run's), its junit
  XML read back into passed / failed / skipped and each failure's first line. Smoke (CPU): the file
  skips as a whole, which checks that it still does.
- `demo`: the embedded demo pair on the device in fp32 with TF32 off: greedy ids of specexec equal
  ar's, tokens per target pass beside the cost model's prior, then one `specx serve` request (its
  status and token count; no timings here: the timed figures, each with its prediction, are measure.py's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

import tomllib
import torch

from tools.gpuday import predict
from tools.gpuday.image import RUN_EXTRAS

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "specexec_cli" / "demo"
PROMPT = "def fibonacci(n):\n"


def env(ctx: dict) -> dict:
    from packaging.requirements import Requirement
    from packaging.version import Version

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(proj["dependencies"]) + [r for e in RUN_EXTRAS for r in proj["optional-dependencies"][e]]
    rows, missing = [], []
    for r in map(Requirement, reqs):
        try:
            have = metadata.version(r.name)
        except metadata.PackageNotFoundError:
            have = None
        ok = have is not None and r.specifier.contains(Version(have), prereleases=True)
        rows.append(dict(name=r.name, range=str(r.specifier), installed=have, ok=ok))
        if not ok:
            missing.append(f"{r.name}{r.specifier} (installed: {have})")
    out = dict(
        python=sys.version.split()[0],
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        packages=rows,
        missing=missing,
    )
    if missing:
        raise PhaseError(f"outside the declared ranges: {', '.join(missing)}", out)
    return out


class PhaseError(RuntimeError):
    """A phase that ran but failed its check; `data` is still written."""

    def __init__(self, message: str, data: dict):
        super().__init__(message)
        self.data = data


def child_env() -> dict:
    """What a child needs beside the run's environment: the repo and the run's PYTHONPATH importable."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def cuda_tests(ctx: dict) -> dict:
    xml = ctx["out"] / "cuda_tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/test_cuda.py",
        f"--junitxml={xml}",
        f"--basetemp={ctx['out'] / 'pytest-tmp'}",
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, **child_env()),
        capture_output=True,
        text=True,
        timeout=ctx.get("tests_timeout", 480),
    )
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        status = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (el.get("message") or "").splitlines()[:1]
                break
        else:
            detail = []
        cases.append(
            dict(
                name=case.get("name"),
                status=status,
                seconds=float(case.get("time", 0)),
                detail=detail[0][:300] if detail else "",
            )
        )
    counts = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failed", "error", "skipped")}
    out = dict(returncode=proc.returncode, counts=counts, cases=cases, tail=proc.stdout[-2000:])
    if proc.returncode not in (0, 5) or counts["failed"] or counts["error"]:
        raise PhaseError(f"tests/test_cuda.py: {counts}", out)
    return out


def demo(ctx: dict) -> dict:
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig
    from specexec_cli.core.methods import generate
    from specexec_cli.session.loading import LoadOptions, close_models, load_models
    from specexec_cli.session.prompts import encode_prompt

    dev = ctx["device"]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    models = load_models(
        LoadOptions(str(DEMO / "target"), str(DEMO / "draft"), dtype="fp32", device=dev.type, offload="none", ctx=1024)
    )
    budget, new = (16, 8) if ctx["smoke"] else (64, 96)
    try:
        ids = encode_prompt(models.tokenizer, PROMPT, False)
        runs = {}
        for method in ("ar", "specexec"):
            cfg = GenerationConfig(method=method, shape=TreeShape(budget=budget, max_depth=16), max_new_tokens=new)
            toks, last = [], None
            for ev in generate(models, DecodeState(), ids, cfg):
                toks += list(ev.tokens)
                last = ev
            runs[method] = dict(ids=toks, passes=last.pass_index)
    finally:
        close_models(models)
    spec = runs["specexec"]
    out = dict(
        budget=budget,
        equal=runs["ar"]["ids"] == spec["ids"],
        new_tokens=len(spec["ids"]),
        tokens_per_pass=(len(spec["ids"]) - 1) / max(1, spec["passes"]),
        predicted_tokens_per_pass=predict.tokens_per_pass(budget),
        predicted_model="acceptance.TOKENS_PER_PASS['small'] (the shared trained pair's, a prior)",
        serve=serve_once(ctx),
    )
    if not out["equal"] or out["serve"]["status"] != 200:
        raise PhaseError("demo: specexec ids differ from ar's, or the served request failed", out)
    return out


def serve_once(ctx: dict) -> dict:
    """One chat completion from `specx serve` on the demo pair (a child process on a free port)."""
    sys.path.insert(0, str(ROOT))
    from tests.serve_util import Server

    tmp = ctx["out"] / "serve"
    tmp.mkdir(parents=True, exist_ok=True)
    srv = Server.start(
        ["--device", ctx["device"].type, "--budget", "32", "--max-new-tokens", "8", "--model-name", "demo"],
        tmp,
        timeout=300,
    )
    try:
        status, _, body = srv.http(
            "POST",
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 8},
            timeout=300,
        )
    finally:
        code = srv.stop()
    usage = body.get("usage", {}) if isinstance(body, dict) else {}
    return dict(status=status, completion_tokens=usage.get("completion_tokens"), exit_code=code)
