"""Device memory accounting: the counting allocator of every device byte.

Contract: `DevicePool` is the one allocator of device bytes, counted per memory-plan component
(offload/planning/memplan.py names them): fresh buffers via `alloc`/`empty`/`copy`, tensors a library
made on the device (HF draft weights, rotary buffers) via `adopt` (each storage once); `free` un-counts
a dropped buffer. Every buffer starts on a 256-byte boundary (hostmem.ARENA_ALIGN), on CPU as on CUDA.
"""

from __future__ import annotations

import math

import torch

from offload.stream.hostmem import ARENA_ALIGN, aligned_empty


class DevicePool:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.by_component: dict[str, int] = {}
        self.count = 0  # buffers handed out (tests/test_cuda.py allows the allocator's rounding per buffer)
        self._adopted: set[int] = set()

    @property
    def allocated(self) -> int:
        return sum(self.by_component.values())

    def _count(self, component: str, nbytes: int) -> None:
        self.by_component[component] = self.by_component.get(component, 0) + nbytes
        self.count += 1

    def alloc(self, nbytes: int, component: str = "resident_layers") -> torch.Tensor:
        self._count(component, nbytes)
        if self.device.type == "cpu":
            # a KV slab is written a row at a time as decoding fills it: 4 KB pages keep its first
            # touch small (huge pages fault 2 MB at once: +0.18 s on Gemma-3 270M's first prefill);
            # weights, filled once and streamed every pass, get huge pages (hostmem._huge_empty)
            return aligned_empty(nbytes, ARENA_ALIGN, huge=not component.startswith("kv"))
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def empty(self, shape, dtype: torch.dtype, component: str) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.alloc(nbytes, component).view(dtype).view(tuple(shape))

    def copy(self, src: torch.Tensor, component: str) -> torch.Tensor:
        return self.empty(src.shape, src.dtype, component).copy_(src)

    def adopt(self, component: str, tensors) -> None:
        """Count device tensors allocated elsewhere (each underlying storage once)."""
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() in self._adopted or t.device.type != self.device.type:
                continue
            self._adopted.add(st.data_ptr())
            self._count(component, st.nbytes())

    def free(self, component: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.by_component[component] = self.by_component.get(component, 0) - t.numel() * t.element_size()
