"""Prefetcher tests: abandoned passes never leak stale layers, the ring fills between passes,
the link-busy and stall counters measure what they name, and the disk tier reads only layer bytes.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from offload import OffloadedCausalLM
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


class Boom(RuntimeError):
    pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("pf")
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=6, **SMALL)).eval().save_pretrained(path)
    return path


def _ids(n=5, seed=0):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("abandon_at", [0, 2, 5])
@pytest.mark.parametrize("host_slots", [2, 4])
def test_abandoned_pass_never_hands_stale_layers_to_the_next(model_dir, abandon_at, host_slots):
    """A layer raising mid-pass (Ctrl-C, OOM) leaves jobs in flight; the next pass must equal a clean one.

    The exception info is kept alive, so the abandoned generator is NOT closed before the next
    pass starts (as when a traceback is being printed or stored)."""
    ref = OffloadedCausalLM.from_pretrained(
        model_dir, offload="disk", max_device_memory=0, slots=2, host_slots=host_slots
    )  # never abandoned
    model = OffloadedCausalLM.from_pretrained(
        model_dir, offload="disk", max_device_memory=0, slots=2, host_slots=host_slots
    )
    try:
        ids, other = _ids(), _ids(seed=1)
        expected = ref(input_ids=ids).logits

        def hook(layer):
            if layer == abandon_at:
                raise Boom("interrupted")

        model(input_ids=other)
        remove = after_each_layer(model, hook)
        with pytest.raises(Boom) as kept:
            model(input_ids=other)
        remove()
        for _ in range(2):
            torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=0, rtol=0)
        assert kept.value is not None
    finally:
        model.close()
        ref.close()


@pytest.mark.parametrize("taken", [1, 3])
def test_pass_left_open_does_not_leak_into_the_next_pass(model_dir, taken):
    """A pass whose generator is never closed (held by a traceback, a debugger, a reference cycle)
    still has jobs queued; the next passes must not consume them, nor lose theirs when it is
    finally collected."""
    ref = OffloadedCausalLM.from_pretrained(model_dir, offload="disk", max_device_memory=0, host_slots=3)
    model = OffloadedCausalLM.from_pretrained(model_dir, offload="disk", max_device_memory=0, host_slots=3)
    try:
        ids = _ids()
        expected = ref(input_ids=ids).logits
        model(input_ids=_ids(seed=2))
        held = model.prefetcher.pass_()
        for _ in range(taken):
            next(held)
        for _ in range(2):
            torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=0, rtol=0)
            pf = model.prefetcher  # only the next pass's jobs are queued: the stale ones were drained
            assert {tag for tag, _ in pf.jobs_a.values()} == {pf.pass_id + 1}
        held.close()
        del held
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=0, rtol=0)
    finally:
        model.close()
        ref.close()


def test_ring_fills_with_next_pass_layers_between_passes(model_dir):
    """After a pass, the read stage fills every host slot with the next pass's first layers."""
    model = OffloadedCausalLM.from_pretrained(model_dir, offload="disk", max_device_memory=0, slots=1, host_slots=4)
    try:
        reads = []
        remove = before_each_read(model, reads.append)
        model(input_ids=_ids())
        time.sleep(0.3)  # "the draft grows its tree"
        assert reads[6:] == [0, 1, 2, 3]  # one pass of 6 layers, then 4 of the next pass
        delay = 0.05
        remove()
        before_each_read(model, lambda layer: (reads.append(layer), time.sleep(delay)))
        time.sleep(0.3)
        stall0 = model.prefetcher.stall_seconds
        model(input_ids=_ids())
        # the 4 prefetched layers cost no wait; only layers 4 and 5 may stall
        assert model.prefetcher.stall_seconds - stall0 < 2 * delay + 0.05
    finally:
        model.close()


def test_link_busy_and_stall_measure_the_read_stage(model_dir):
    n, delay = 6, 0.1
    model = OffloadedCausalLM.from_pretrained(model_dir, offload="disk", max_device_memory=0, slots=2, host_slots=2)
    try:
        model(input_ids=_ids())
        time.sleep(0.2)
        before_each_read(model, lambda layer: time.sleep(delay))
        busy0, stall0 = model.link_busy_seconds(), model.prefetcher.stall_seconds
        t0 = time.perf_counter()
        model(input_ids=_ids())
        wall = time.perf_counter() - t0
        time.sleep(3 * delay)  # the next pass's 2 layers finish reading
        busy = model.link_busy_seconds() - busy0
        stall = model.prefetcher.stall_seconds - stall0
        # 4 layers read inside the pass + 2 for the next one, each >= delay
        assert busy >= (n - 2 + 2) * delay
        assert busy <= wall + 3 * delay + 0.1
        # compute is cheap next to `delay`, so compute waits for most of each of the 4 layers not
        # prefetched (each wait is `delay` minus one layer's compute, which overlaps the read)
        assert stall >= (n - 2) * delay * 0.5
        assert model.stats.stall_seconds == pytest.approx(model.prefetcher.stall_seconds)
    finally:
        model.close()


def _kernel_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes"):
                return int(line.split()[1])
    raise OSError("no read_bytes")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_disk_tier_reads_only_layer_bytes(tmp_path):
    """Kernel-counted bytes per pass within 3% of the layer bytes (O_DIRECT: no page-cache readahead)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=3,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path)
    model = OffloadedCausalLM.from_pretrained(tmp_path, offload="disk", max_device_memory=0, host_slots=3)
    if model.plan.direct_io is False:
        model.close()
        pytest.skip("O_DIRECT unsupported here: buffered reads count readahead")
    try:
        layer_bytes = sum(sl.nbytes for d in model.store.disk.values() for sl in d.raw.slices.values())
        model(input_ids=_ids())
        passes = 4
        model.prefetcher.wait_idle()
        b0 = _kernel_read_bytes()
        for _ in range(passes):
            model(input_ids=_ids())
        model.prefetcher.wait_idle()  # same ring state at both ends: the window holds `passes` passes
        per_pass = (_kernel_read_bytes() - b0) / passes
        assert abs(per_pass / layer_bytes - 1) < 0.03, (per_pass, layer_bytes)
    finally:
        model.close()


def test_link_meter_reports_busy_fraction_and_stall_per_pass(monkeypatch):
    """RunStats gets busy ÷ wall and stall per step from the target's counters; prefill excluded."""
    import time as time_mod
    from types import SimpleNamespace

    from specexec_cli.core.stats import LinkMeter, RunStats

    clock = {"t": 100.0}
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock["t"])
    pf = SimpleNamespace(order=[0, 1], stall_seconds=0.0)
    busy = {"s": 0.0}
    target = SimpleNamespace(prefetcher=pf, link_busy_seconds=lambda now: busy["s"])
    stats, meter = RunStats(), LinkMeter(target)
    steps = [(0, 5.0, 4.0, 1.0), (1, 2.0, 1.5, 0.25), (2, 4.0, 1.0, 0.0)]  # (pass, wall, busy, stall)
    for idx, wall, b, st in steps:
        clock["t"] += wall
        busy["s"] += b
        pf.stall_seconds += st
        ev = SimpleNamespace(
            tokens=[1],
            prefill_seconds=1.0,
            decode_seconds=1.0,
            finish=None,
            pass_index=idx,
            prompt_tokens=3,
            draft_seconds=0.1,
            target_seconds=0.2,
            tree_size=0,
            tree_depth=0,
            accepted=0,
        )
        stats.add(ev)
        meter.step(stats, ev)
    assert stats.link_busy == [0.75, 0.25] and stats.stall == [0.25, 0.0]
    rec = stats.to_json()
    assert rec["link_busy_fraction"] == 0.5 and rec["stall_seconds"] == 0.25
    assert "link_busy_fraction" not in RunStats().to_json()  # resident target: no link fields


def test_reader_queue_depth_and_chunk_read_the_same_bytes(model_dir):
    """Several small requests in flight (bench/offload.py's best config) give identical layers."""
    ref = OffloadedCausalLM.from_pretrained(model_dir, offload="disk", max_device_memory=0)
    model = OffloadedCausalLM.from_pretrained(model_dir, offload="disk", max_device_memory=0)
    try:
        model.store.reader.depth, model.store.reader.chunk = 3, 8192
        ids = _ids()
        for _ in range(2):
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=0, rtol=0)
        assert model.store.reader._pool is not None  # the threaded path really ran
    finally:
        model.close()
        ref.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ring_two_stages_match_cpu_and_survive_abandon(model_dir):
    """CUDA: disk reads into 4 pinned host slots, copies into 2 device slots; equals the CPU model,
    also after a pass abandoned halfway."""
    cpu = OffloadedCausalLM.from_pretrained(model_dir, offload="ram")
    gpu = OffloadedCausalLM.from_pretrained(
        model_dir, device="cuda", offload="disk", max_device_memory=0, slots=2, host_slots=4
    )
    try:
        assert gpu.prefetcher.slots == 2 and gpu.prefetcher.host_slots == 4
        ids = _ids()
        expected = cpu(input_ids=ids).logits
        remove = after_each_layer(gpu, lambda layer: (_ for _ in ()).throw(Boom()) if layer == 3 else None)
        with pytest.raises(Boom):
            gpu(input_ids=ids.cuda())
        remove()
        for _ in range(3):
            torch.testing.assert_close(gpu(input_ids=ids.cuda()).logits.cpu(), expected, atol=1e-4, rtol=1e-4)
        assert gpu.link_busy_seconds() > 0
    finally:
        gpu.close()
        cpu.close()
