"""Fuzzed GGUF files: every corrupt one is one clean error line naming the file, never a traceback
and never a model running on garbage.

A valid tiny Llama GGUF (tests/gguf_build.py) is broken in the ways files break: truncated at
every region (header, metadata, tensor table, data), tensor offsets past the end / off the
alignment / overlapping, type ids that are no GGML type or a type specx cannot dequantize,
wrong counts (tensor and metadata counts, a dimension that changes a tensor's byte count), and
seeded byte flips in the header. `open_checkpoint` must raise OffloadError (one line, naming the
file); a few go through `specx run` (exit 2, exactly one `error:` line on stderr, nothing on stdout).
Seeded flips may also leave a file that still opens (a changed name byte in a string value): then
its tensor table must still be the original's.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from offload import OffloadError  # noqa: E402
from offload.formats import open_checkpoint  # noqa: E402
from tests.conftest import make_model  # noqa: E402
from tests.gguf_build import write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguffuzz")
    return write_gguf(make_model(root / "hf", seed=9, layers=2), root / "good.gguf", "Q8_0")


def _layout(path: Path) -> dict:
    """Byte positions in the file: end of metadata, tensor-table fields, data start."""
    r = gguf.GGUFReader(path)
    fields = {}
    for t in r.tensors:
        pos = t.field.offset
        sizes = [int(p.nbytes) for p in t.field.parts]  # name_len, name, n_dims, dims, type, offset
        starts = [pos + sum(sizes[:k]) for k in range(len(sizes))]
        fields[t.name] = {"dims": starts[3], "type": starts[4], "offset": starts[5], "n_dims": int(t.field.parts[2][0])}
    first = r.tensors[0].field.offset
    return {
        "fields": fields,
        "table": first,
        "data": r.data_offset,
        "size": path.stat().st_size,
        "names": [t.name for t in r.tensors],
    }


def _put(raw: bytearray, at: int, fmt: str, value) -> None:
    raw[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)


def _cases(lay: dict) -> dict:
    q = lay["fields"]["blk.0.attn_q.weight"]
    last = lay["fields"][lay["names"][-1]]
    norm = lay["fields"]["blk.0.attn_norm.weight"]
    return {
        "truncated_header": lambda raw: raw[:20],
        "truncated_metadata": lambda raw: raw[: lay["table"] - 7],
        "truncated_tensor_table": lambda raw: raw[: lay["data"] - 40],
        "truncated_data": lambda raw: raw[: lay["size"] - 1000],
        "empty": lambda raw: bytearray(),
        "not_gguf": lambda raw: bytearray(b"GGUX") + raw[4:],
        "offset_past_end": lambda raw: _put(raw, last["offset"], "<Q", lay["size"] * 4) or raw,
        "offset_off_alignment": lambda raw: (
            _put(raw, q["offset"], "<Q", struct.unpack_from("<Q", raw, q["offset"])[0] + 4) or raw
        ),
        "overlapping": lambda raw: _put(raw, q["offset"], "<Q", 0) or raw,
        "type_not_ggml": lambda raw: _put(raw, q["type"], "<I", 99) or raw,
        "type_unsupported": lambda raw: _put(raw, q["type"], "<I", int(gguf.GGMLQuantizationType.IQ2_XS)) or raw,
        "type_changes_bytes": lambda raw: _put(raw, norm["type"], "<I", int(gguf.GGMLQuantizationType.Q8_0)) or raw,
        "dim_changes_bytes": lambda raw: _put(raw, q["dims"], "<Q", 64 * 9) or raw,
        "dim_zero": lambda raw: _put(raw, q["dims"] + 8, "<Q", 0) or raw,
        "tensor_count_high": lambda raw: _put(raw, 8, "<Q", len(lay["names"]) + 5) or raw,
        "tensor_count_low": lambda raw: _put(raw, 8, "<Q", len(lay["names"]) - 1) or raw,
        "kv_count_high": lambda raw: _put(raw, 16, "<Q", 10**6) or raw,
        "version": lambda raw: _put(raw, 4, "<I", 99) or raw,
    }


CASES = (
    "truncated_header",
    "truncated_metadata",
    "truncated_tensor_table",
    "truncated_data",
    "empty",
    "not_gguf",
    "offset_past_end",
    "offset_off_alignment",
    "overlapping",
    "type_not_ggml",
    "type_unsupported",
    "type_changes_bytes",
    "dim_changes_bytes",
    "dim_zero",
    "tensor_count_high",
    "tensor_count_low",
    "kv_count_high",
    "version",
)


def _broken(good: Path, tmp_path: Path, case: str) -> Path:
    raw = bytearray(good.read_bytes())
    out = tmp_path / f"{case}.gguf"
    out.write_bytes(bytes(_cases(_layout(good))[case](raw)))
    return out


def _assert_one_line(exc: OffloadError, path: Path) -> None:
    msg = str(exc)
    assert "\n" not in msg and str(path) in msg, msg


@pytest.mark.parametrize("case", CASES)
def test_corrupt_gguf_is_one_line(good, tmp_path, case):
    bad = _broken(good, tmp_path, case)
    with pytest.raises(OffloadError) as err:
        open_checkpoint(bad)
    _assert_one_line(err.value, bad)


def test_named_types_in_messages(good, tmp_path):
    with pytest.raises(OffloadError, match="IQ2_XS, which specx cannot dequantize"):
        open_checkpoint(_broken(good, tmp_path, "type_unsupported"))
    with pytest.raises(OffloadError, match="runs past the end of the file"):
        open_checkpoint(_broken(good, tmp_path, "truncated_data"))


@pytest.mark.parametrize("seed", range(12))
def test_header_byte_flips(good, tmp_path, seed):
    """A flipped header byte: one OffloadError line, or a file whose tensor table is unchanged."""
    lay = _layout(good)
    rng = random.Random(seed)
    raw = bytearray(good.read_bytes())
    for _ in range(3):
        at = rng.randrange(4, lay["data"])
        raw[at] ^= 1 << rng.randrange(8)
    bad = tmp_path / f"flip{seed}.gguf"
    bad.write_bytes(bytes(raw))
    try:
        ck = open_checkpoint(bad)
    except OffloadError as exc:
        _assert_one_line(exc, bad)
        return
    ref = open_checkpoint(good)
    assert {n: (t.begin - ref.tensors[n].begin, t.qtype, t.shape) for n, t in ck.tensors.items()} == {
        n: (0, t.qtype, t.shape) for n, t in ref.tensors.items()
    }


@pytest.mark.parametrize("case", ["truncated_data", "type_unsupported", "overlapping"])
def test_specx_run_one_error_line(good, tmp_path, case):
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    bad = _broken(good, tmp_path, case)
    res = CliRunner().invoke(
        app,
        [
            "run",
            "-p",
            "x",
            "--target",
            str(bad),
            "--method",
            "ar",
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
            "--no-live",
            "--offload",
            "disk",
        ],
    )
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output and res.stdout == ""
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and str(bad) in lines[0], res.stderr
