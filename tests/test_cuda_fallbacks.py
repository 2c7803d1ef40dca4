"""CUDA error handling that must be right before a GPU ever runs it, checked on CPU with fakes."""

from __future__ import annotations

import types

import pytest
import torch

from offload import devmem
from offload.errors import OffloadError
from offload.storage import aligned_empty


class FakeCudart:
    def __init__(self, rc: int):
        self.rc, self.calls, self.cleared = rc, [], 0

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append((ptr, size, flags))
        return self.rc

    def cudaGetLastError(self):
        self.cleared += 1
        return 0


def fake_cuda(monkeypatch, rc: int) -> FakeCudart:
    rt = FakeCudart(rc)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    return rt


def test_pin_host_registers_portable(monkeypatch):
    rt = fake_cuda(monkeypatch, 0)
    buf = aligned_empty(8192)
    assert devmem.pin_host(buf) is buf
    assert rt.calls == [(buf.data_ptr(), 8192, devmem.CUDA_HOST_REGISTER_PORTABLE)] and rt.cleared == 0


def test_failed_register_clears_the_error_and_falls_back(monkeypatch):
    rt = fake_cuda(monkeypatch, 2)   # cudaErrorMemoryAllocation
    made = []

    def pinned_empty(n, dtype, pin_memory=False):
        assert pin_memory
        made.append(aligned_empty(n))   # page-aligned, like cudaHostAlloc
        return made[-1]

    monkeypatch.setattr(devmem, "torch", types.SimpleNamespace(**{**vars(torch), "empty": pinned_empty}))
    buf = aligned_empty(8192)
    buf[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="pinned copy"):
        out = devmem.pin_host(buf)
    assert rt.cleared == 1 and out is made[0] and out[:4].tolist() == [1, 2, 3, 4]


def test_failed_register_of_a_huge_region_stays_pageable(monkeypatch):
    rt = fake_cuda(monkeypatch, 2)
    monkeypatch.setattr(devmem, "OWN_PINNED_MAX", 4096)
    buf = aligned_empty(8192)
    with pytest.warns(UserWarning, match="pageable"):
        assert devmem.pin_host(buf) is buf
    assert rt.cleared == 1


def test_old_bitsandbytes_is_refused_in_one_line(monkeypatch):
    import bitsandbytes

    from offload import nf4

    nf4.require_bnb.cache_clear()
    monkeypatch.setattr(bitsandbytes, "__version__", "0.45.0")
    try:
        with pytest.raises(OffloadError, match=r"older than 0\.50\.2.*pip install -U"):
            nf4.require_bnb()
    finally:
        nf4.require_bnb.cache_clear()


def test_bench_gpu_without_cuda_exits_with_a_clear_message(monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["gpu.py"])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 2 and "--smoke" in capsys.readouterr().err
