"""Tests for the offload package's I/O side (nf4 numerics: test_nf4_linear.py): device-byte budget,
compute/IO overlap, O_DIRECT fallback, other architectures, and OffloadError messages.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import offload.stream.storage as storage
from offload import OffloadedCausalLM, OffloadError
from tests.probes import after_each_layer, before_each_read

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
VOCAB = 96
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)


def _make(cls, cfg, path, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cls(cfg).to(dtype).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _make(LlamaForCausalLM, LlamaConfig(num_hidden_layers=4, **SMALL), tmp_path_factory.mktemp("m"))


def _ids(n=7, seed=0):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- device budget


def test_device_bytes_bounded_by_resident_plus_slots(llama_dir, monkeypatch):
    allocs = []
    real_alloc = storage.DevicePool.alloc

    def counting_alloc(self, nbytes, component="resident_layers"):
        if component in ("resident_layers", "staging_slots"):  # weight buffers (globals are counted apart)
            allocs.append(nbytes)
        return real_alloc(self, nbytes, component)

    monkeypatch.setattr(storage.DevicePool, "alloc", counting_alloc)
    layer = OffloadedCausalLM.from_pretrained(llama_dir, offload="ram").plan.layer_bytes[0]
    allocs.clear()
    model = OffloadedCausalLM.from_pretrained(llama_dir, offload="disk", max_device_memory=layer, slots=2, host_slots=2)
    try:
        for _ in range(3):
            model(input_ids=_ids())
        p = model.plan
        largest = max(model.store.layout(i).nbytes for i in p.streamed)
        assert p.resident == [0] and len(p.streamed) == 3
        weights = model.pool.by_component["resident_layers"] + model.pool.by_component["staging_slots"]
        assert sum(allocs) == weights == p.device_bytes
        assert sum(allocs) <= sum(p.layer_bytes[i] for i in p.resident) + 2 * largest
        assert len(allocs) == 1 + 2  # one buffer per resident layer + one per slot, no growth per pass
        assert model.stats.passes == 3 and model.stats.streamed_bytes == 3 * model.stats.streamed_bytes_per_pass
    finally:
        model.close()


# ---------------------------------------------------------------- overlap


def _best_pass(model, ids, gap, tries=3):
    """Fastest of `tries` passes, each after `gap` idle seconds (when the next pass prefetches)."""
    best = float("inf")
    for _ in range(tries):
        time.sleep(gap)
        t0 = time.perf_counter()
        model(input_ids=ids)
        best = min(best, time.perf_counter() - t0)
    return best


def test_pass_time_is_max_of_compute_and_io_not_sum(tmp_path):
    """With IO and compute each slowed by `delay` per layer, a pass costs ~compute, not compute+IO.

    Compared against a compute-only pass measured the same way, so scheduler noise on a busy
    2-core machine hits both sides; serial execution would add n*delay, overlap adds ~0."""
    n, delay = 6, 0.08
    path = _make(LlamaForCausalLM, LlamaConfig(num_hidden_layers=n, **SMALL), tmp_path)
    model = OffloadedCausalLM.from_pretrained(path, offload="disk", slots=2)
    try:
        ids = _ids(3)
        model(input_ids=ids)  # warm-up
        after_each_layer(model, lambda layer: time.sleep(delay))
        compute_only = _best_pass(model, ids, gap=0.1)
        before_each_read(model, lambda layer: time.sleep(delay))
        both = _best_pass(model, ids, gap=3 * delay)
        assert both < compute_only + 0.5 * n * delay, (
            f"pass with IO took {both:.3f}s vs {compute_only:.3f}s compute-only; serial adds {n * delay:.2f}s"
        )
        assert compute_only >= n * delay
    finally:
        model.close()


# ---------------------------------------------------------------- O_DIRECT fallback


def test_odirect_einval_falls_back_to_buffered_reads(llama_dir, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    ref = OffloadedCausalLM.from_pretrained(llama_dir, offload="ram")
    with pytest.warns(UserWarning, match="O_DIRECT unsupported"):
        model = OffloadedCausalLM.from_pretrained(llama_dir, offload="disk")
    try:
        assert model.plan.direct_io is False and "buffered reads" in model.plan.describe()
        ids = _ids()
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=0, rtol=0)
    finally:
        model.close()
        ref.close()


def _odirect_works(directory) -> bool:
    """Whether this filesystem accepts an aligned O_DIRECT read (ext4/xfs do; tmpfs does not)."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / "odirect-probe"
    probe.write_bytes(b"x" * 8192)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        return os.preadv(fd, [mmap.mmap(-1, 4096)], 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)


def test_disk_tier_reads_with_odirect(llama_dir, tmp_path_factory, monkeypatch):
    """Where the filesystem supports it, the disk tier really opens the checkpoint with O_DIRECT
    (no silent fallback to the page cache), and those reads give exact logits."""
    if not _odirect_works(tmp_path_factory.mktemp("probe")):
        pytest.skip("this filesystem does not support O_DIRECT")
    opened = []
    real_open = os.open

    def spy(path, flags, *a):
        opened.append((str(path), flags))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", spy)
    ref = OffloadedCausalLM.from_pretrained(llama_dir, offload="ram")
    model = OffloadedCausalLM.from_pretrained(llama_dir, offload="disk", slots=1)
    try:
        assert model.plan.direct_io is True and "O_DIRECT" in model.plan.describe()
        opened.clear()
        ids = _ids()
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=0, rtol=0)
        assert model.stats.streamed_bytes > 0
        st_opens = [flags for path, flags in opened if path.endswith(".safetensors")]
        assert all(flags & os.O_DIRECT for flags in st_opens), st_opens  # any (re)open during a pass is direct
    finally:
        model.close()
        ref.close()


@pytest.mark.parametrize("depth", [1, 3])
def test_disk_reads_in_small_chunks_are_exact(llama_dir, depth):
    """Spans read as many 4 KiB requests (several in flight with depth 3): every chunk lands in place."""
    ref = OffloadedCausalLM.from_pretrained(llama_dir, offload="ram")
    model = OffloadedCausalLM.from_pretrained(llama_dir, offload="disk", slots=2)
    try:
        reader = model.store.reader
        reader.chunk, reader.depth = storage.IO_ALIGN, depth
        spans = [s for d in model.store.disk.values() for s in d.spans]
        assert max(s.needed for s in spans) > 8 * storage.IO_ALIGN  # really many chunks per span
        for seed in range(2):  # the second pass reuses the slots: stale bytes would show
            ids = _ids(seed=seed)
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=0, rtol=0)
    finally:
        model.close()
        ref.close()


@pytest.mark.parametrize("host_slots", [1, 2])
def test_prefetch_never_overwrites_a_layer_in_use(tmp_path, host_slots):
    """A small read-ahead ring (1-2 host slots, 1 device slot) and a slow layer: a read queued into the
    slot of the layer being computed would land during its 30 ms and change the logits."""
    path = _make(LlamaForCausalLM, LlamaConfig(num_hidden_layers=4, **SMALL), tmp_path, seed=8)
    ref = OffloadedCausalLM.from_pretrained(path, offload="ram")
    model = OffloadedCausalLM.from_pretrained(path, offload="disk", slots=1, host_slots=host_slots)
    hooks = [layer.register_forward_pre_hook(lambda *_: time.sleep(0.03)) for layer in model.layers]
    try:
        for seed in range(3):  # passes 2-3 run on layers read ahead at the end of the previous pass
            ids = _ids(seed=seed)
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=0, rtol=0)
    finally:
        for h in hooks:
            h.remove()
        model.close()
        ref.close()


# ---------------------------------------------------------------- other architectures


@pytest.mark.parametrize(
    "cls,cfg",
    [
        (Qwen2ForCausalLM, Qwen2Config(num_hidden_layers=2, tie_word_embeddings=False, **SMALL)),
        (MistralForCausalLM, MistralConfig(num_hidden_layers=2, sliding_window=None, **SMALL)),
    ],
)
def test_qwen2_and_mistral(tmp_path, cls, cfg):
    path = _make(cls, cfg, tmp_path, seed=7)
    ref = cls.from_pretrained(path, dtype=torch.float32).eval()
    model = OffloadedCausalLM.from_pretrained(path, offload="disk", slots=1)
    try:
        ids = _ids()
        with torch.no_grad():
            expected = ref(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
    finally:
        model.close()


# ---------------------------------------------------------------- errors name the file


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_shard_names_file(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    f = path / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)
    with pytest.raises(OffloadError, match=r"model\.safetensors.*truncated"):
        OffloadedCausalLM.from_pretrained(path, offload="disk")


def test_corrupt_header_names_file(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32
    f.write_bytes(bytes(data))
    with pytest.raises(OffloadError, match=r"model\.safetensors.*corrupt"):
        OffloadedCausalLM.from_pretrained(path)


def test_missing_tensor_names_file(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OffloadError, match=r"model\.safetensors.*model\.layers\.2\.mlp\.up_proj\.weight"):
        OffloadedCausalLM.from_pretrained(path)


def test_unsupported_architecture_names_config(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OffloadError, match=r"config\.json.*unsupported model_type 'gpt2'"):
        OffloadedCausalLM.from_pretrained(path)


def test_budget_that_cannot_fit_reports_bytes_before_loading(llama_dir, monkeypatch):
    import psutil

    class Tiny:
        available = 10_000

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    with pytest.raises(OffloadError, match=r"needs .* host RAM but 10.0 kB is free"):
        OffloadedCausalLM.from_pretrained(llama_dir, offload="ram")


# ---------------------------------------------------------------- CUDA (thin; skipped on CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_cuda_streams_match_cpu(llama_dir, offload):
    cpu = OffloadedCausalLM.from_pretrained(llama_dir, offload="auto")
    gpu = OffloadedCausalLM.from_pretrained(llama_dir, device="cuda", offload=offload, max_device_memory=0)
    try:
        ids = _ids()
        for _ in range(2):
            out = gpu(input_ids=ids.cuda()).logits.cpu()
            torch.testing.assert_close(out, cpu(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    finally:
        gpu.close()
        cpu.close()
