"""`gpu_day.py run`: the GPU day's phases, resumable, every figure as JSON under --out.

Contract:
- PHASES run in order: env, probe, moe, passes-bf16, passes-nf4, passes-q4k, draft, step, demo, cuda-tests.
  "moe" comes right after the probe it is modelled with: the earliest a phase that needs the card's rates
  can run, so a day cut to one command still measures it (the passes and draft have run on earlier days).
  Each writes `<out>/<phase>.json` = {phase, ok, seconds, data | error}; a phase whose file exists is
  skipped (a second command resumes a cut one), `--phase NAME` runs that one again. A phase is not
  started when the seconds spent so far plus its estimate (EST, an H100's) pass --budget-s, so one
  command stays inside the box's 10 minutes; the run then exits 4 and names what is left.
- `<out>/summary.json` gathers every phase file (what a device call brings back: one file), rewritten
  after each phase, and copied to `--summary PATH` too when given (a folder that comes back even
  when the command is killed at its limit).
- Scratch (the synthetic checkpoints, specx's caches, the test and server temporaries, Inductor's
  and Triton's caches) lives in `<out>/work` and is removed once every phase is done; nothing is
  written outside --out.
- Exit: 0 every phase ok; 1 a phase failed (its error in its file); 4 phases left for another command.
- `--resume-from FILE`: an earlier command's summary.json (brought back from a box that was then
  given back): its finished phases are copied into --out and skipped.
- `--smoke`: the CPU, tiny shapes, every phase (tests/test_gpu_day.py runs it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

PHASES = ("env", "probe", "moe", "passes-bf16", "passes-nf4", "passes-q4k", "draft", "step", "demo", "cuda-tests")
EST = {
    "env": 10,
    "probe": 20,
    "moe": 120,  # moe.BOUND_S (90 s, the checkpoint's build included) and the closing of its models
    "passes-bf16": 90,
    "passes-nf4": 90,
    "passes-q4k": 90,
    "draft": 90,
    "step": 240,
    "demo": 60,
    "cuda-tests": 180,
}  # seconds, with margin over an H200's run (54, 25, 33, 16, 22 and 142 s for the long ones; step: not run yet)
SELF_BITS = (4, 3, 2)


def scratch_env(work: Path) -> None:
    """Every cache specx, torch and the tests write, under `work` (set before torch is imported)."""
    for var, sub in (
        ("SPECX_CACHE", "specx-cache"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("TRITON_CACHE_DIR", "triton"),
        ("XDG_CACHE_HOME", "xdg-cache"),
        ("HF_HOME", "hf"),
        ("TMPDIR", "tmp"),
    ):
        (work / sub).mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(work / sub)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # torch.profiler's two lines per trace (the moe phase's floors)


def runner(name: str):
    from tools.gpuday import measure, moe, phases, step

    return {
        "env": phases.env,
        "probe": measure.probe,
        "moe": moe.moe,
        "passes-bf16": lambda c: measure.passes(c, "bf16"),
        "passes-nf4": lambda c: measure.passes(c, "nf4"),
        "passes-q4k": lambda c: measure.passes(c, "q4k"),
        "draft": measure.draft,
        "step": step.step,
        "demo": phases.demo,
        "cuda-tests": phases.cuda_tests,
    }[name]


def context(out: Path, smoke: bool) -> dict:
    import psutil
    import torch

    from tools.gpuday import stack

    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shape = stack.SMOKE_TARGET if smoke else stack.TARGET
    layers = 2 if smoke else stack.layers_for(shape, 8, psutil.virtual_memory().available, shutil.disk_usage(out).free)
    ctx = dict(out=out / "work", device=device, smoke=smoke, layers=layers, bits=SELF_BITS)
    probe = out / "probe.json"
    if probe.exists():
        ctx["card"] = json.loads(probe.read_text()).get("data")
    return ctx


def run_phase(name: str, ctx: dict, out: Path) -> bool:
    from tools.gpuday.phases import PhaseError

    print(f"gpu_day run: {name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rec = dict(phase=name, ok=True)
    try:
        rec["data"] = runner(name)(ctx)
    except PhaseError as e:
        rec.update(ok=False, error=str(e), data=e.data)
    except Exception as e:  # noqa: BLE001 - a phase's failure is recorded, the next phase still runs
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    if name == "probe" and rec["ok"]:
        ctx["card"] = rec["data"]
    print(
        f"gpu_day run: {name} {'ok' if rec['ok'] else 'FAILED: ' + rec['error']} ({rec['seconds']} s)",
        file=sys.stderr,
        flush=True,
    )
    return rec["ok"]


def summary(out: Path, copy_to: Path | None = None) -> dict:
    phases = {}
    for name in PHASES:
        f = out / f"{name}.json"
        if f.exists():
            phases[name] = json.loads(f.read_text())
    doc = dict(
        phases=phases,
        done=[n for n in PHASES if n in phases],
        left=[n for n in PHASES if n not in phases],
        failed=[n for n, r in phases.items() if not r["ok"]],
    )
    text = json.dumps(doc, indent=1, default=str) + "\n"
    (out / "summary.json").write_text(text)
    if copy_to is not None:
        copy_to.write_text(text)
    return doc


def seed(out: Path, resume_from: Path) -> list[str]:
    """Phase files from an earlier command's summary.json (a box given back between commands): the
    phases it finished ok count as done here. Returns their names."""
    try:
        phases = json.loads(resume_from.read_text())["phases"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"gpu_day run: --resume-from {resume_from}: not a run's summary.json ({e})") from None
    done = [n for n, rec in phases.items() if n in PHASES and rec.get("ok")]
    for name in done:
        if not (out / f"{name}.json").exists():
            (out / f"{name}.json").write_text(json.dumps(phases[name], indent=1) + "\n")
    return done


def main(
    out: Path,
    smoke: bool,
    only: list[str] | None,
    budget_s: float,
    resume_from: Path | None = None,
    copy_to: Path | None = None,
) -> int:
    if only and (bad := [p for p in only if p not in PHASES]):
        print(f"gpu_day run: unknown phase {bad[0]!r}; choose from {', '.join(PHASES)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if resume_from is not None:
        print(f"gpu_day run: done before: {', '.join(seed(out, resume_from)) or 'nothing'}", file=sys.stderr)
    scratch_env(out / "work")
    import logging

    import torch

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its optional-CPU-kernel notice
    if not smoke and not torch.cuda.is_available():
        print(
            "gpu_day run: no CUDA device here; run it on the GPU box, or pass --smoke for a tiny CPU run",
            file=sys.stderr,
        )
        return 2
    t_start = time.perf_counter()
    ctx = context(out, smoke)
    todo = list(only) if only else [p for p in PHASES if not (out / f"{p}.json").exists()]
    for name in todo:
        if name not in ("env", "probe") and ctx.get("card") is None and name not in ("demo", "cuda-tests"):
            run_phase("probe", ctx, out)
        if not smoke and time.perf_counter() - t_start + EST[name] > budget_s:
            print(f"gpu_day run: {name} left for the next command (budget {budget_s:.0f} s)", file=sys.stderr)
            break
        ok = run_phase(name, ctx, out)
        summary(out, copy_to)  # after every phase: a command killed at its limit still leaves it
        if name == "env" and not ok:
            break  # the install is wrong: nothing after it would mean anything
    doc = summary(out, copy_to)
    print(json.dumps(dict(done=doc["done"], failed=doc["failed"], left=doc["left"])))
    if not doc["left"]:
        shutil.rmtree(out / "work", ignore_errors=True)
    return 1 if doc["failed"] else (4 if doc["left"] else 0)
