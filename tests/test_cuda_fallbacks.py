"""CUDA error handling that must be right before a GPU ever runs it, checked on CPU with fakes."""

from __future__ import annotations

import pytest
import torch

from offload.errors import OffloadError, OffloadNotice
from offload.stream import hostmem
from offload.stream.hostmem import HostPins, aligned_empty


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister recorders; `rc` is what registration returns."""

    def __init__(self, rc: int):
        self.rc, self.calls, self.unregistered = rc, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append((ptr, size, flags))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def fake_cuda(monkeypatch, rc: int) -> FakeCudart:
    rt = FakeCudart(rc)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    probes = []
    monkeypatch.setattr(hostmem, "_probe_launch", lambda: probes.append(1))
    rt.probes = probes
    return rt


def test_pin_registers_portable_once_and_release_unregisters_once(monkeypatch):
    rt = fake_cuda(monkeypatch, 0)
    pins, buf = HostPins("cuda"), aligned_empty(8192)
    assert pins.pin(buf, "test")
    assert rt.calls == [(buf.data_ptr(), 8192, hostmem.CUDA_HOST_REGISTER_PORTABLE)] and rt.probes == []
    pins.release()
    pins.release()  # idempotent: close() and then the owner's finalizer
    assert rt.unregistered == [buf.data_ptr()]


def test_owner_garbage_collected_unregisters(monkeypatch):
    import gc

    rt = fake_cuda(monkeypatch, 0)

    class Owner:
        pass

    owner, pins, buf = Owner(), HostPins("cuda"), aligned_empty(8192)
    pins.attach(owner)
    pins.pin(buf, "test")
    ptr = buf.data_ptr()
    del owner, buf
    gc.collect()
    assert rt.unregistered == [ptr]


def test_cpu_device_pins_nothing_even_where_cuda_exists(monkeypatch):
    rt = fake_cuda(monkeypatch, 0)
    pins = HostPins("cpu")
    assert not pins.pin(aligned_empty(8192), "test") and rt.calls == []


def test_failed_register_clears_the_error_and_says_so_in_one_line(monkeypatch):
    rt = fake_cuda(monkeypatch, 2)  # cudaErrorMemoryAllocation (WSL2's pinned cap, ulimit -l)
    pins = HostPins("cuda")
    assert not pins.pin(aligned_empty(8192), "the RAM tier")
    assert rt.probes == [1] and pins._entries == []  # nothing pinned
    with pytest.warns(OffloadNotice, match=r"could not pin .* the RAM tier \(cudaError 2\); slower") as rec:
        pins.notice("slower")
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    pins.release()
    assert rt.unregistered == []  # nothing registered, nothing to undo


def test_unpinned_ram_arena_streams_through_the_staging_ring(tiny_pair):
    """The fallback path of a failed RAM-tier registration (CUDA), driven on CPU: each RAM-tier
    layer is memcpy'd into a staging slot, whose bytes equal the arena's."""
    from offload import OffloadedCausalLM

    model = OffloadedCausalLM.from_pretrained(tiny_pair[0], offload="ram")
    try:
        store = model.store
        layer = next(iter(store.ram))
        arena = store.ram[layer][0]
        store.ram_staged, store.host_stage = True, [aligned_empty(arena.numel())]
        assert not store.is_free(layer)
        out = store.read(layer, 0)
        assert out.data_ptr() == store.host_stage[0].data_ptr() and torch.equal(out, arena)
    finally:
        model.close()


def test_old_bitsandbytes_is_refused_in_one_line(monkeypatch):
    import bitsandbytes

    from offload.quant import nf4

    nf4.require_bnb.cache_clear()
    monkeypatch.setattr(bitsandbytes, "__version__", "0.45.0")
    try:
        with pytest.raises(OffloadError, match=r"older than 0\.50\.2.*pip install -U"):
            nf4.require_bnb()
    finally:
        nf4.require_bnb.cache_clear()


def test_bench_gpu_without_cuda_exits_with_a_clear_message(monkeypatch, capsys):
    from tests.conftest import load_script

    mod = load_script("bench/gpu.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["gpu.py"])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 2 and "--smoke" in capsys.readouterr().err


def test_auto_dtype_is_fp16_on_gpus_without_native_bf16(monkeypatch):
    from offload.stream.loader import accelerator_half
    from specexec_cli.session.loading import resolve_dtype
    from specexec_cli.session.planning import plan_dtypes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native, want, name in ((False, torch.float16, "fp16"), (True, torch.bfloat16, "bf16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n)
        assert accelerator_half() == want
        assert resolve_dtype("auto", torch.device("cuda")) == want
        assert plan_dtypes("auto", "cuda", True) == (name, name)


def test_expandable_segments_are_requested_unless_the_user_chose():
    from specexec_cli.terminal.allocator import ALLOC_ENV, configure_allocator

    env = {}
    assert configure_allocator(env, "linux", "Linux version 6.8")
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}  # torch 2.13's name
    env = {ALLOC_ENV: "max_split_size_mb:128"}
    assert not configure_allocator(env, "linux", "") and env[ALLOC_ENV] == "max_split_size_mb:128"
    for platform, version in (("win32", ""), ("linux", "Linux version 5.15 microsoft-standard-WSL2")):
        env = {}
        assert not configure_allocator(env, platform, version) and env == {}


def test_failed_unregister_clears_the_error_keeps_the_buffer_and_says_so(monkeypatch):
    rt = fake_cuda(monkeypatch, 0)
    rt.cudaHostUnregister = lambda ptr: (rt.unregistered.append(ptr), 1)[1]  # cudaErrorInvalidValue
    pins, buf = HostPins("cuda"), aligned_empty(8192)
    assert pins.pin(buf, "test")
    kept = len(hostmem._STILL_PINNED)
    with pytest.warns(OffloadNotice, match=r"could not unpin .*\(cudaError 1\)") as rec:
        pins.release()
    assert len(rec) == 1 and rt.unregistered == [buf.data_ptr()] and rt.probes == [1]
    assert hostmem._STILL_PINNED[kept] is buf  # never unmapped while it may still be registered
    pins.release()  # idempotent: nothing left, no second notice
    assert rt.unregistered == [buf.data_ptr()]


def test_host_embedding_rows_are_one_counted_upload():
    """--embeddings host: the looked-up rows cross in one copy per forward, counted like every
    specx transfer (the session points `counter` at specexec_cli's transfers.COUNTER)."""
    from offload.stream.globals import HostEmbedding
    from specexec_cli.core.transfers import TransferCount

    counter = TransferCount()
    emb = HostEmbedding(torch.nn.Embedding(11, 6), torch.device("cpu"), counter)
    out = emb(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 6)
    assert (counter.calls, counter.uploads, counter.bytes) == (1, 1, 3 * 6 * 4)


def test_session_counts_host_embedding_rows(tiny_pair):
    from dataclasses import replace

    from specexec_cli.core import transfers
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import DecodeState, GenerationConfig
    from specexec_cli.core.methods import generate
    from specexec_cli.session.loading import LoadOptions, load_models
    from specexec_cli.session.planning import make_plan

    shape = TreeShape(budget=8, max_depth=4, max_beams=4)
    opts = LoadOptions(
        target=str(tiny_pair[0]), draft=str(tiny_pair[1]), device="cpu", offload="auto", ctx=96, embeddings="host"
    )
    models = load_models(replace(opts, plan=make_plan(opts, shape, budget_auto=False)))
    emb = models.target.embed_tokens
    assert type(emb).__name__ == "HostEmbedding" and emb.counter is transfers.COUNTER
    deltas = []
    real = emb.forward

    def watched(ids):  # what each embedding call adds to the process-wide counter
        before = transfers.snapshot()
        out = real(ids)
        d = transfers.since(before)
        deltas.append((d.calls, d.uploads, d.bytes, ids.numel() * out.shape[-1] * out.element_size()))
        return out

    emb.forward = watched
    list(
        generate(
            models, DecodeState(), [3, 5, 7, 9], GenerationConfig(method="specexec", shape=shape, max_new_tokens=4)
        )
    )
    assert deltas and all(d[:3] == (1, 1, d[3]) for d in deltas), deltas


def test_bench_gpu_smoke_runs_every_phase_on_cpu_and_resumes(tmp_path, monkeypatch, capsys):
    """`bench/gpu.py --smoke`: every phase on CPU with tiny 70B-proportioned shapes (8:1 GQA), the
    state file records each phase, and a second run with `--phase all` redoes nothing."""
    import json

    from tests.conftest import load_script

    mod = load_script("bench/gpu.py")
    out, ckpt = tmp_path / "gpu.json", tmp_path / "ck"
    argv = [
        "gpu.py",
        "--smoke",
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
        "--tokens",
        "1",
        "--repeats",
        "1",
        "--max-new-tokens",
        "4",
        "--budget",
        "8",
        "--self-bits",
        "2",
    ]
    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.setenv("SPECX_CACHE", str(tmp_path / "cache"))  # this run's caches only
    monkeypatch.setenv("SPECX_LOWBIT_KERNEL", "eager")  # no compile here (tests/test_fused.py)
    mod.main()
    res = json.loads(out.read_text())
    assert (
        set(mod.PHASES) <= set(res) and res["shape"]["num_attention_heads"] == 8 * res["shape"]["num_key_value_heads"]
    )
    planned = res["write"]["planned_disk"]
    assert set(planned) == {"checkpoint", "nf4_cache", "hqq2_cache", "draft"}
    assert res["quantize"]["disk_used"] <= 1.2 * sum(planned.values())  # every cache written was counted
    rows = {r["draft"]: r for r in res["decode"]["rows"]}
    assert set(rows) == {"none", "small-draft", "self-2bit"}
    assert all(
        k in rows["self-2bit"]
        for k in ("tokens_per_second", "tokens_per_pass", "stall_seconds_per_pass", "draft_seconds_per_pass")
    )
    state = ckpt.with_name(ckpt.name + "-smoke-bench-state.json")
    before = state.stat().st_mtime_ns
    mod.main()  # resumes: nothing left to run
    assert state.stat().st_mtime_ns == before and "| self-2bit |" in capsys.readouterr().out


def test_a_plain_streamed_pass_never_asks_hf_for_packed_sequences(tiny_pair, monkeypatch):
    """HF's mask builders, given positions with neither cache nor mask, look for packed sequences with
    a host read (a device sync on CUDA: the sync-debug test on the H200 caught it). A pass whose
    positions we made ourselves never hands them over."""
    import transformers.masking_utils as mu

    from offload import OffloadedCausalLM

    def refuse(*a, **k):
        raise AssertionError("find_packed_sequence_indices was called")

    monkeypatch.setattr(mu, "find_packed_sequence_indices", refuse)
    model = OffloadedCausalLM.from_pretrained(
        tiny_pair[0], device="cpu", dtype="fp32", offload="ram", max_device_memory=0
    )
    try:
        out = model(input_ids=torch.tensor([[3, 5, 7, 9]])).logits
        assert out.shape[:2] == (1, 4)
        with pytest.raises(AssertionError, match="find_packed"):  # a caller's positions still go to HF
            model(input_ids=torch.tensor([[3, 5, 7, 9]]), position_ids=torch.arange(4)[None])
    finally:
        model.close()
