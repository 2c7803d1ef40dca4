"""Fuzzed checkpoints: every corrupt model directory is one clean error line, never a crash.

A valid tiny Llama dir is copied and broken in many ways (safetensors headers: random bytes,
length past EOF, bad/unknown/overlapping/out-of-range entries, huge shapes, seeded byte flips;
broken config.json, tokenizer.json and shard index). Each goes through `specx run` (CliRunner,
resident and offloaded): exit 2, exactly one `error:` line naming a file of the model dir, no
traceback. While they run, torch's tensor factories are guarded: no request may exceed the
model dir's size (a huge declared shape is refused by arithmetic, never allocated). A few
cases also run as real subprocesses (`python -m specexec_cli`).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import make_model

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("fuzz") / "good", seed=5, layers=2)


def split(path: Path) -> tuple[dict, bytes]:
    """(header JSON, data bytes) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def pack(header, data: bytes, raw_header: bytes | None = None) -> bytes:
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def first_tensor(header: dict) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


def entry_edit(fn):
    """A safetensors corruption that edits the first tensor's header entry."""

    def corrupt(header, data):
        fn(header[first_tensor(header)], header)
        return pack(header, data)

    return corrupt


def _overlap(header, data):
    names = sorted(k for k in header if k != "__metadata__")
    a, b = header[names[0]], header[names[1]]
    if a["dtype"] == b["dtype"] and a["shape"] == b["shape"]:
        b["data_offsets"] = list(a["data_offsets"])
    else:  # shift b onto a's start, keeping its own length
        lo, hi = b["data_offsets"]
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + hi - lo]
    return pack(header, data)


ST_CASES = {
    "empty_file": lambda h, d: b"",
    "seven_bytes": lambda h, d: b"\x01\x02\x03\x04\x05\x06\x07",
    "header_len_past_eof": lambda h, d: struct.pack("<Q", 10**12) + b"{}",
    "header_len_max_u64": lambda h, d: b"\xff" * 8 + b"{}" * 100,
    "non_json_header": lambda h, d: pack(None, d, raw_header=b"this is not json at all!"),
    "non_utf8_header": lambda h, d: pack(None, d, raw_header=b"\xff\xfe\xfd" * 40),
    "json_array_header": lambda h, d: pack([1, 2, 3], d),
    "deeply_nested_header": lambda h, d: pack(None, d, raw_header=b"[" * 100000 + b"]" * 100000),
    "truncated_data": lambda h, d: pack(h, d[: len(d) // 2]),
    "unknown_dtype": entry_edit(lambda e, h: e.update(dtype="F128")),
    "dtype_not_string": entry_edit(lambda e, h: e.update(dtype=[1])),
    "offsets_past_eof": entry_edit(
        lambda e, h: e.update(data_offsets=[10**9, 10**9 + e["data_offsets"][1] - e["data_offsets"][0]])
    ),
    "offsets_reversed": entry_edit(lambda e, h: e.update(data_offsets=e["data_offsets"][::-1])),
    "offsets_negative": entry_edit(lambda e, h: e.update(data_offsets=[-8, e["data_offsets"][1]])),
    "offsets_float": entry_edit(lambda e, h: e.update(data_offsets=[0.5, 3.5])),
    "offsets_three": entry_edit(lambda e, h: e.update(data_offsets=[0, 4, 8])),
    "huge_shape": entry_edit(lambda e, h: e.update(shape=[2**40, 2**40])),
    "huge_shape_consistent_offsets": entry_edit(
        lambda e, h: e.update(shape=[2**30], dtype="U8", data_offsets=[0, 2**30])
    ),
    "negative_shape": entry_edit(lambda e, h: e.update(shape=[-1, 64])),
    "string_shape": entry_edit(lambda e, h: e.update(shape="64x64")),
    "entry_not_object": entry_edit(lambda e, h: h.update({first_tensor(h): 7})),
    "entry_missing_keys": entry_edit(lambda e, h: e.pop("data_offsets")),
    "overlapping_tensors": _overlap,
}


def copy_good(good: Path, tmp_path: Path) -> Path:
    out = tmp_path / "m"
    shutil.copytree(good, out)
    return out


class AllocGuard(TorchDispatchMode):
    """Fails any torch op that allocates a non-meta tensor bigger than `limit` bytes.

    A dispatch mode sees every aten op issued while it is active (our code's and transformers'),
    and unlike patching `torch.empty` it leaves no trace in modules imported meanwhile.
    """

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.biggest = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
            and str(kwargs.get("device", "cpu")) != "meta"
        ):
            numel = math.prod(int(d) for d in args[0])
            itemsize = torch.tensor([], dtype=kwargs.get("dtype") or torch.get_default_dtype()).element_size()
            self._check(numel * itemsize, func)
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._check(t.untyped_storage().nbytes(), func)
        return out

    def _check(self, nbytes: int, func) -> None:
        self.biggest = max(self.biggest, nbytes)
        if nbytes > self.limit:
            raise AssertionError(f"{func} allocates {nbytes} bytes > the model files' {self.limit}")


@pytest.fixture()
def alloc_guard():
    """A list holding the byte limit for run_cli (set to the model dir's size per run)."""
    return [0]


def dir_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.iterdir() if f.is_file())


def run_cli(model: Path, tmp_path: Path, offload: str, guard: list | None = None):
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):")
    args = [
        "run",
        str(prompt),
        "--target",
        str(model),
        "--method",
        "ar",
        "--device",
        "cpu",
        "--max-new-tokens",
        "2",
        "--no-live",
        "--offload",
        offload,
    ]
    if guard is None:
        return runner.invoke(app, args)
    with AllocGuard(dir_bytes(model)):
        return runner.invoke(app, args)


def assert_one_line_error(result, model: Path):
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert str(model) in lines[0], lines[0]  # names the offending file (or the dir holding it)
    assert result.stdout == ""


@pytest.mark.parametrize("offload", ["none", "disk"])
@pytest.mark.parametrize("case", sorted(ST_CASES))
def test_corrupt_safetensors(good, tmp_path, case, offload, alloc_guard):
    model = copy_good(good, tmp_path)
    header, data = split(model / "model.safetensors")
    (model / "model.safetensors").write_bytes(ST_CASES[case](header, data))
    assert_one_line_error(run_cli(model, tmp_path, offload, alloc_guard), model)


def test_seeded_header_byte_flips(good, tmp_path, alloc_guard):
    """Random bytes written into the header: refused unless the header still means the same."""
    header, _data = split(good / "model.safetensors")
    raw = (good / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    rng = random.Random(1234)
    checked = 0
    for trial in range(14):
        buf = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            buf[8 + rng.randrange(n)] = rng.randrange(256)
        try:
            same = json.loads(bytes(buf[8 : 8 + n])) == header
        except ValueError:
            same = False
        if same:
            continue  # e.g. a flip inside the trailing padding spaces that kept them spaces
        model = tmp_path / f"flip{trial}"
        shutil.copytree(good, model)
        (model / "model.safetensors").write_bytes(bytes(buf))
        assert_one_line_error(run_cli(model, tmp_path, "none" if trial % 2 else "disk", alloc_guard), model)
        checked += 1
    assert checked >= 7


def _edit_json(name: str, fn):
    """A corruption that loads the model dir's JSON file `name`, lets `fn` edit it, writes it back."""

    def corrupt(model: Path):
        path = model / name
        data = json.loads(path.read_text())
        fn(data)
        path.write_text(json.dumps(data))

    return corrupt


def _cfg(fn):
    return _edit_json("config.json", fn)


def _write(name: str, text: bytes):
    return lambda model: (model / name).write_bytes(text)


CONFIG_CASES = {
    "config_not_json": _write("config.json", b"{model_type: llama"),
    "config_empty": _write("config.json", b""),
    "config_array": _write("config.json", b"[1, 2]"),
    "config_non_utf8": _write("config.json", b"\xff\xfe{}"),
    "config_no_model_type": _cfg(lambda c: c.pop("model_type")),
    "config_unknown_model_type": _cfg(lambda c: c.update(model_type="llamax")),
    "config_hidden_string": _cfg(lambda c: c.update(hidden_size="abc")),
    "config_hidden_negative": _cfg(lambda c: c.update(hidden_size=-64)),
    "config_zero_heads": _cfg(lambda c: c.update(num_attention_heads=0)),
    "config_zero_layers": _cfg(lambda c: c.update(num_hidden_layers=0)),
    "config_more_layers": _cfg(lambda c: c.update(num_hidden_layers=5)),
    "config_huge_vocab": _cfg(lambda c: c.update(vocab_size=10**9)),
    "config_billion_layers": _cfg(lambda c: c.update(num_hidden_layers=10**9)),
    "config_layers_float": _cfg(lambda c: c.update(num_hidden_layers=2.5)),
    "config_huge_hidden": _cfg(lambda c: c.update(hidden_size=2**40)),
    "tokenizer_not_json": _write("tokenizer.json", b"not json"),
    "tokenizer_empty_object": _write("tokenizer.json", b"{}"),
    "tokenizer_truncated": lambda m: (m / "tokenizer.json").write_bytes((m / "tokenizer.json").read_bytes()[:200]),
    "tokenizer_config_not_json": _write("tokenizer_config.json", b"{{{"),
}


@pytest.mark.parametrize("offload", ["none", "disk"])
@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_broken_config_and_tokenizer(good, tmp_path, case, offload, alloc_guard):
    model = copy_good(good, tmp_path)
    CONFIG_CASES[case](model)
    assert_one_line_error(run_cli(model, tmp_path, offload, alloc_guard), model)


def sharded(good: Path, tmp_path: Path) -> Path:
    """The good model split in two shards with an index."""
    from safetensors.torch import load_file, save_file

    model = copy_good(good, tmp_path)
    sd = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    names = sorted(sd)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: sd[k] for k in keys}, model / shard, metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model


def _index(fn):
    return _edit_json("model.safetensors.index.json", fn)


def _first(idx):
    return sorted(idx["weight_map"])[0]


INDEX_CASES = {
    "missing_shard": lambda m: (m / "model-00002-of-00002.safetensors").unlink(),
    "index_names_absent_shard": _index(
        lambda i: i["weight_map"].update({_first(i): "model-00003-of-00003.safetensors"})
    ),
    "index_not_json": _write("model.safetensors.index.json", b"{weight_map"),
    "index_no_weight_map": _index(lambda i: i.pop("weight_map")),
    "index_weight_map_list": _index(lambda i: i.update(weight_map=[1, 2])),
    "index_path_traversal": _index(lambda i: i["weight_map"].update({_first(i): "../../etc/passwd"})),
    "index_wrong_shard": _index(
        lambda i: i["weight_map"].update(
            {_first(i): next(s for s in set(i["weight_map"].values()) if s != i["weight_map"][_first(i)])}
        )
    ),
    "shard_corrupt": lambda m: (m / "model-00001-of-00002.safetensors").write_bytes(b"\x00" * 64),
}


@pytest.mark.parametrize("offload", ["none", "disk"])
@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_broken_shard_index(good, tmp_path, case, offload):
    model = sharded(good, tmp_path)
    INDEX_CASES[case](model)
    assert_one_line_error(run_cli(model, tmp_path, offload), model)


def test_sharded_copy_itself_loads(good, tmp_path):
    """The base of the index cases is valid: only the corruption makes them fail."""
    model = sharded(good, tmp_path)
    for offload in ("none", "disk"):
        r = run_cli(model, tmp_path, offload)
        assert r.exit_code == 0, r.output


def test_alloc_guard_is_live():
    with AllocGuard(1 << 20):
        with pytest.raises(AssertionError):
            torch.empty(1 << 21, dtype=torch.uint8)
        with pytest.raises(AssertionError):
            torch.zeros((1024, 1024))
        assert torch.empty(16).numel() == 16
        assert torch.empty(1 << 30, device="meta").numel() == 1 << 30


def run_subprocess(model: Path, tmp_path: Path, offload: str):
    """A real `python -m specexec_cli run`; returns (rc, stdout, stderr, peak RSS bytes)."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("def f(x):")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("SPECX_DEBUG", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specexec_cli",
            "run",
            str(prompt),
            "--target",
            str(model),
            "--method",
            "ar",
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
            "--no-live",
            "--offload",
            offload,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("case,offload", [("huge_shape_consistent_offsets", "none"), ("header_len_past_eof", "disk")])
def test_subprocess_clean_exit(good, tmp_path, case, offload):
    model = copy_good(good, tmp_path)
    header, data = split(model / "model.safetensors")
    (model / "model.safetensors").write_bytes(ST_CASES[case](header, data))
    rc, out, err = run_subprocess(model, tmp_path, offload)
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and out == ""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and str(model) in lines[0], err
