"""tools/gpu_day.py: `run --smoke` end to end on the CPU, the pack's choice of wheels, the doc's tables.

The smoke run is the whole GPU-day run with tiny shapes: every phase must pass, every measured row
must carry passcost's prediction, scratch must be gone afterwards, and a second command must skip
the finished phases. The pack test fakes the registry (no network): it checks which wheels are
chosen against the image's list and pyproject's ranges, and that dependencies are followed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.gpuday import pack, run, tables  # noqa: E402


def gpu_day(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_day.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpuday") / "out"
    proc = gpu_day("run", "--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_smoke_run_passes_every_phase(smoke):
    out, summary = smoke
    assert summary["done"] == list(run.PHASES) and summary["failed"] == [] and summary["left"] == []
    assert not (out / "work").exists()  # scratch removed once every phase is done
    assert {p.name for p in out.iterdir()} == {f"{n}.json" for n in run.PHASES} | {"summary.json"}
    ph = {n: rec["data"] for n, rec in summary["phases"].items()}
    assert ph["env"]["missing"] == []
    for fmt in ("bf16", "nf4", "q4k"):
        rows = ph[f"passes-{fmt}"]["rows"]
        assert [r["n"] for r in rows] == [1, 4, 16]
        for r in rows:
            assert r["seconds"] > 0 and r["streamed_bytes"] > 0
            assert r["predicted"]["model"].endswith("passcost.py") and r["predicted"]["seconds"] > 0
    subs = ph["draft"]["substitutes"]
    assert set(subs) == {"4", "3", "2"}
    for rows in [ph["draft"]["small"]["rows"]] + [s["rows"] for s in subs.values()]:
        assert rows and all(r["seconds"] > 0 and r["predicted"]["seconds"] > 0 for r in rows)
        assert all(0 < r["read_floor_s"] <= r["predicted"]["seconds"] for r in rows)  # the model reads no less
    assert [b["budget"] for b in ph["step"]["budgets"]] == [256, 1024]  # tests/test_gpu_day_step.py: the rest
    assert ph["demo"]["equal"] and ph["demo"]["serve"]["status"] == 200 and ph["demo"]["tokens_per_pass"] >= 1
    assert ph["cuda-tests"]["counts"]["skipped"] >= 10 and ph["cuda-tests"]["counts"]["failed"] == 0  # skips cleanly


@pytest.mark.slow
def test_a_second_command_skips_finished_phases(smoke):
    out, _ = smoke
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if p.name != "summary.json"}
    proc = gpu_day("run", "--smoke", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if p.name != "summary.json"} == before
    assert json.loads(proc.stdout.strip().splitlines()[-1])["left"] == []


@pytest.mark.slow
def test_tables_fill_every_block_of_the_doc(smoke):
    _, summary = smoke
    blocks = tables.render(summary)
    assert set(blocks) == set(tables.TABLES)
    doc = tables.fill((ROOT / "docs" / "gpu-status.md").read_text(), blocks)
    for name, body in blocks.items():
        assert f"<!-- bench:gpuday-{name} -->\n{body}\n<!-- /bench:gpuday-{name} -->" in doc
        assert "not run yet" not in body
    assert "| 16 |" in blocks["passes"] and "yes" in blocks["demo"] and "x floor" in blocks["draft"]
    assert "<!-- gpuday:" not in doc  # one marker dialect


def test_resume_from_seeds_only_finished_phases(tmp_path):
    prior = {
        "phases": {
            "env": {"phase": "env", "ok": True, "data": {}},
            "probe": {"phase": "probe", "ok": False, "error": "x"},
        }
    }
    (tmp_path / "s.json").write_text(json.dumps(prior))
    out = tmp_path / "out"
    out.mkdir()
    assert run.seed(out, tmp_path / "s.json") == ["env"]
    assert (out / "env.json").exists() and not (out / "probe.json").exists()


def test_unknown_phase_is_a_usage_error():
    proc = gpu_day("run", "--smoke", "--phase", "nope", timeout=60)
    assert proc.returncode == 2 and "unknown phase 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def _fake_wheel(dest: Path, name: str, version: str, requires: list[str]) -> Path:
    path = dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = "\n".join([f"Name: {name}", f"Version: {version}"] + [f"Requires-Dist: {r}" for r in requires])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta + "\n")
    return path


def test_pack_takes_what_the_image_lacks_and_follows_requirements(tmp_path, monkeypatch):
    deps = {
        "fastapi": ["starlette>=1", "pydantic>=2", "anyio>=4"],  # anyio: on the image
        "pydantic": ["pydantic-core==2.0", "typing-extensions>=4"],
        "hqq": ["termcolor", "colorama; python_version < '3.0'"],
    }  # marker false: not followed
    fetched = []

    def fake_fetch(req, dest, python):
        fetched.append(pack.norm(req.name))
        return _fake_wheel(dest, req.name, "1.0" if req.name != "pydantic-core" else "2.0", deps.get(req.name, []))

    monkeypatch.setattr(pack, "fetch", fake_fetch)
    monkeypatch.setattr(pack, "pick_version", lambda req: None)
    (tmp_path / "stale-0.1-py3-none-any.whl").write_text("")
    wheels = pack.build(ROOT, tmp_path, "3.12")
    names = {pack.norm(w.name.split("-")[0]) for w in wheels}
    assert {
        "bitsandbytes",
        "fastapi",
        "uvicorn",
        "prompt-toolkit",
        "gguf",
        "hqq",
        "starlette",
        "pydantic",
        "pydantic-core",
        "termcolor",
    } <= names
    assert not names & {"transformers", "torch", "anyio", "typing-extensions", "colorama", "accelerate", "rich"}
    assert len(fetched) == len(set(fetched)) and not (tmp_path / "stale-0.1-py3-none-any.whl").exists()


def test_pack_fails_above_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(pack, "build", lambda root, dest, python: [])
    monkeypatch.setattr(
        pack, "travel_bytes", lambda root, dest: dict(repo=70 << 20, pack=0, total=70 << 20, limit=pack.LIMIT)
    )
    assert pack.main(ROOT, tmp_path, "3.12") == 1
