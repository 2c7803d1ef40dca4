"""tools/gpu_day.py: `run --smoke` end to end on the CPU, the pack's choice of wheels, the tables' pages.

The smoke run is the whole GPU-day run with tiny shapes: every phase must pass, every measured row
must carry passcost's prediction, scratch must be gone afterwards, and a second command must skip
the finished phases. The pack test fakes the registry (no network): it checks which wheels are
chosen against the image's list and pyproject's ranges, and that dependencies are followed. The
tables go to their pages: the day's measurements to docs/gpu-status.md (a user's page, which names
no test file), the CUDA tests' table to CONTRIBUTING.md beside the CPU-checked invariants.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.gpuday import moe, pack, run, tables  # noqa: E402


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
    check_moe(ph["moe"])
    assert [b["budget"] for b in ph["step"]["budgets"]] == [256, 1024]  # tests/test_gpu_day_step.py: the rest
    assert ph["demo"]["equal"] and ph["demo"]["serve"]["status"] == 200 and ph["demo"]["tokens_per_pass"] >= 1
    assert ph["cuda-tests"]["counts"]["skipped"] >= 10 and ph["cuda-tests"]["counts"]["failed"] == 0  # skips cleanly


def check_moe(d: dict) -> None:
    """The moe phase's JSON: both modes at every n, measured where they ran, each beside its two modelled
    figures; the split row says why where it did not run; the floors and CPU expert rates measured."""
    assert [(r["mode"], r["n"]) for r in d["rows"]] == [(m, n) for m in ("layers", "split") for n in (1, 8, 32)]
    why = moe.split_unavailable()
    for r in d["rows"]:
        assert r["modelled_s"] > 0 and r["modelled_measured_s"] > 0
        if r["mode"] == "split" and why:
            assert r["not_run"] == f"not run: {why}" and "seconds" not in r
        else:
            assert r["seconds"] > 0 and r["rounds"] == moe.ROUNDS and "not_run" not in r
    layers = [r for r in d["rows"] if r["mode"] == "layers"]
    assert all(r["streamed_bytes"] >= d["checkpoint_bytes"] // 2 for r in layers)  # whole layers move
    assert all(x["margin"] <= moe.NEAR_TIE for x in d["differ"]) and d["ids_equal"] == (not d["differ"])
    assert d["failed"] == {}
    assert d["shape"] == moe.SMOKE_SHAPE and d["cache_experts"] == d["shape"]["layers"]  # 1 of 4 a layer
    cases = d["floors"]["cases"]
    assert [(c["kind"], c["placement"]) for c in cases] == [
        ("dense", "resident"),
        ("moe", "resident"),
        ("moe", "streamed"),
    ]
    for c in cases:
        assert [r["n"] for r in c["rows"]] == [1, 8, 32]
        assert all(r["spans"] > 0 and r["kernels_s"] > 0 and r["wall_s"] > 0 for r in c["rows"])
    cpu = d["cpu"]
    assert cpu["bps"] > 0 and cpu["flops"] > 0 and cpu["profile_probe"]["gbps"] > 0
    assert [c["tokens"] for c in cpu["cells"]] == [1, 8, 32, moe.FLOP_TOKENS]


@pytest.mark.slow
def test_a_second_command_skips_finished_phases(smoke):
    out, _ = smoke
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if p.name != "summary.json"}
    proc = gpu_day("run", "--smoke", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if p.name != "summary.json"} == before
    assert json.loads(proc.stdout.strip().splitlines()[-1])["left"] == []


@pytest.mark.slow
def test_tables_fill_every_block_of_their_pages(smoke):
    _, summary = smoke
    blocks = tables.render(summary)
    assert set(blocks) == set(tables.TABLES)
    pages = tables.by_page(blocks)
    assert set(pages) == {"docs/gpu-status.md", "CONTRIBUTING.md"} and list(pages["CONTRIBUTING.md"]) == ["tests"]
    for page, mine in pages.items():
        doc = tables.fill((ROOT / page).read_text(), mine)
        for name, body in mine.items():
            assert f"<!-- bench:gpuday-{name} -->\n{body}\n<!-- /bench:gpuday-{name} -->" in doc
            assert "not run yet" not in body
        assert "<!-- gpuday:" not in doc  # one marker dialect
    assert "| 16 |" in blocks["passes"] and "yes" in blocks["demo"] and "x floor" in blocks["draft"]
    assert "| layers | 32 | 5 |" in blocks["moe"] and "| forward floor: 4 dense layers" in blocks["moe"]


@pytest.mark.slow
def test_a_failed_moe_phase_keeps_its_table_under_the_error(smoke):
    _, summary = smoke
    rec = dict(summary["phases"]["moe"], ok=False, error="moe: greedy ids differ beyond a near tie")
    body = tables.moe({"phases": {"moe": rec}})
    assert body.startswith("*moe: failed: moe: greedy ids differ") and "| layers | 1 | 5 |" in body
    assert tables.moe({"phases": {"moe": dict(rec, data=None)}}).startswith("*moe: failed")
    rows = [dict(r, not_run="not run: split not available") if r["mode"] == "split" else r for r in rec["data"]["rows"]]
    body = tables.moe({"phases": {"moe": dict(rec, data=dict(rec["data"], rows=rows))}})
    table = [line for line in body.splitlines() if line.startswith("| mode ") or line.startswith("| split |")]
    assert len(table) == 4 and len({line.count("|") for line in table}) == 1  # as many cells as the header
    assert "| split | 8 | | not run: split not available |" in body
    cases = [dict(c, rows=[dict(r, floor_s=None) for r in c["rows"]]) for c in rec["data"]["floors"]["cases"]]
    floors = dict(rec["data"]["floors"], cases=cases)  # a trace without kernels (no CUPTI): no floor
    assert "no kernels traced / no kernels traced" in tables.moe(
        {"phases": {"moe": dict(rec, data=dict(rec["data"], floors=floors))}}
    )
    rows = [dict(r, modelled_s=None, modelled_measured_s=None) for r in rec["data"]["rows"]]  # modelling raised
    body = tables.moe({"phases": {"moe": dict(rec, data=dict(rec["data"], rows=rows))}})
    assert "| layers | 1 | 5 |" in body and body.count("not modelled") == 2 * len(rows)


def test_the_user_page_names_no_test_file_and_contributing_holds_how_cuda_is_checked():
    """docs/gpu-status.md is a user's page: the CUDA tests' table and the CPU-checked invariants (both
    name test files) are CONTRIBUTING.md's, and the user's page points there in one sentence."""
    user, dev = (ROOT / "docs" / "gpu-status.md").read_text(), (ROOT / "CONTRIBUTING.md").read_text()
    assert "tests/" not in user and "test_" not in user
    assert "bench:gpuday-tests" not in user and "CPU-checked invariants" not in user
    assert user.count("../CONTRIBUTING.md#how-specxs-cuda-code-is-checked") == 1
    assert "## How specx's CUDA code is checked" in dev and "### GPU requirements met by CPU-checked invariants" in dev
    assert dev.count("<!-- bench:gpuday-tests -->") == 1 and "<!-- bench:gpuday-card -->" not in dev


def test_tables_write_every_page_or_the_pages_named(tmp_path, capsys):
    """`tables --write` puts each table into its page under the root; pages named limit it; a page that
    holds none of the tables, or lacks a block, is exit 2 with no page written."""
    summary = {"phases": {}}  # every table renders as "not run yet"
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(summary))
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    day = "".join(f"<!-- bench:gpuday-{n} -->\nold\n<!-- /bench:gpuday-{n} -->\n" for n in tables.TABLES[:-1])
    (root / "docs" / "gpu-status.md").write_text(day)
    (root / "CONTRIBUTING.md").write_text("<!-- bench:gpuday-tests -->\nold\n<!-- /bench:gpuday-tests -->\n")
    assert tables.main(out, [root / "CONTRIBUTING.md"], root) == 0
    assert "cuda-tests: not run yet" in (root / "CONTRIBUTING.md").read_text()
    assert "not run yet" not in (root / "docs" / "gpu-status.md").read_text()
    assert tables.main(out, [root / "README.md"], root) == 2
    assert "holds none of the day's tables" in capsys.readouterr().err
    (root / "CONTRIBUTING.md").write_text("no block\n")
    assert tables.main(out, [], root) == 2
    assert "not run yet" not in (root / "docs" / "gpu-status.md").read_text()  # untouched: a page lacked a block
    (root / "CONTRIBUTING.md").write_text("<!-- bench:gpuday-tests -->\nold\n<!-- /bench:gpuday-tests -->\n")
    assert tables.main(out, [], root) == 0
    day = (root / "docs" / "gpu-status.md").read_text()
    assert all(f"*{p}: not run yet*" in day for p in ("probe", "draft", "step", "demo"))
    assert "cuda-tests" not in day and "cuda-tests: not run yet" in (root / "CONTRIBUTING.md").read_text()


def test_moe_times_the_other_mode_on_when_one_pass_raises():
    """A split pass that raises (a CUDA error on the day) is recorded as failed and timed no further, and the
    whole-layer figures of every n are still taken."""
    import torch

    class Fake:
        input_device = torch.device("cpu")

        def __init__(self, boom: bool):
            self.boom, self.stats = boom, SimpleNamespace(streamed_bytes_per_pass=7)

        def __call__(self, input_ids, use_cache):
            if self.boom:
                raise RuntimeError("CUDA error: an illegal memory access\nmore")
            return SimpleNamespace(logits=torch.nn.functional.one_hot(input_ids, 16).float())

    loaded, why = {"layers": Fake(False), "split": Fake(True)}, {}
    ctx = dict(device=torch.device("cpu"), smoke=True, moe_shape=dict(vocab_size=16))
    samples, differ = moe.timed(ctx, loaded, why, 0.0)
    assert why == {"split": "failed: RuntimeError: CUDA error: an illegal memory access"} and list(loaded) == ["layers"]
    assert [len(samples[("layers", n)]) for n in moe.TOKENS] == [moe.ROUNDS] * 3
    assert not any(samples[("split", n)] for n in moe.TOKENS) and differ == []


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
