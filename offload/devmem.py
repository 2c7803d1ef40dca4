"""Device memory accounting and host pinning: the counting allocator and cudaHostRegister.

Contract:
- `DevicePool` is the one allocator of device bytes, counted per memory-plan component
  (offload/memplan.py names them): fresh buffers via `alloc`/`empty`/`copy`, tensors that a
  library made on the device via `adopt` (each storage once), dropped buffers via `free`.
- `pin_host(buf)` page-locks a host region with ONE portable cudaHostRegister and returns the
  buffer to use; on failure it clears CUDA's last error (or the next kernel launch would raise
  it) and falls back to a pinned copy of its own or to pageable memory, warning either way.
No-ops on machines without CUDA; nothing here reads files.
"""

from __future__ import annotations

import math
import os
import warnings

import torch

PAGE = 4096   # page alignment: O_DIRECT targets and cudaHostAlloc blocks


def _aligned(nbytes: int) -> torch.Tensor:
    from .storage import aligned_empty   # storage imports this module at load time

    return aligned_empty(nbytes)


CUDA_HOST_REGISTER_PORTABLE = 1    # cudaHostRegisterPortable: pinned for every CUDA context
OWN_PINNED_MAX = 1 << 30           # fallback pinned copies only up to this size (torch rounds pinned sizes up)


def pin_host(buf: torch.Tensor) -> torch.Tensor:
    """Page-lock an existing host region in one call (cudaHostRegister, portable), never per tensor.

    Returns the buffer to use. If registration fails (locked-memory limits, an already registered
    range), CUDA's last error is cleared at once, since torch would otherwise raise it at the next
    unrelated kernel launch, and the region falls back to a pinned buffer of torch's own (up to
    OWN_PINNED_MAX, page-aligned for O_DIRECT) or stays pageable, with a warning either way.
    """
    if not torch.cuda.is_available() or buf.numel() == 0:
        return buf
    rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), CUDA_HOST_REGISTER_PORTABLE))
    if rc == 0:
        return buf
    clear_cuda_error()
    if buf.numel() <= OWN_PINNED_MAX:
        try:
            own = torch.empty(buf.numel(), dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            own = None
            clear_cuda_error()
        if own is not None and own.data_ptr() % PAGE == 0:
            warnings.warn(f"offload: cudaHostRegister failed (cudaError {rc}); using a pinned copy instead")
            return own.copy_(buf)
    warnings.warn(f"offload: cudaHostRegister failed (cudaError {rc}); host->device copies of "
                  f"{buf.numel() >> 20} MiB will be pageable (slower); raise `ulimit -l` to pin")
    return buf


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's sticky-until-read last error (cudaGetLastError) on this thread."""
    rt = torch.cuda.cudart()
    get_last = getattr(rt, "cudaGetLastError", None)
    if get_last is not None:
        get_last()
        return
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:   # RTLD_NOLOAD: only the runtime torch already loaded (its error state is the one to clear)
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL).cudaGetLastError()
            return
        except OSError:
            continue


class DevicePool:
    """The one counting allocator of device bytes, per component (see memplan for the names).

    `alloc`/`empty` hand out fresh buffers; `adopt` counts tensors a library created on the
    device (HF draft weights, rotary buffers), each storage once; `free` un-counts a buffer that
    is dropped (a regrown KV slab). `allocated` is the total, `by_component` the breakdown that
    tests compare with the memory plan. On CPU large buffers are page-aligned (O_DIRECT targets).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.by_component: dict[str, int] = {}
        self.count = 0
        self._adopted: set[int] = set()

    @property
    def allocated(self) -> int:
        return sum(self.by_component.values())

    def _count(self, component: str, nbytes: int) -> None:
        self.by_component[component] = self.by_component.get(component, 0) + nbytes
        self.count += 1

    def alloc(self, nbytes: int, component: str = "resident_layers") -> torch.Tensor:
        """A uint8 buffer of `nbytes` on the device."""
        self._count(component, nbytes)
        if self.device.type == "cpu":
            return _aligned(nbytes) if nbytes >= PAGE else torch.empty(nbytes, dtype=torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def empty(self, shape, dtype: torch.dtype, component: str) -> torch.Tensor:
        """A typed tensor of `shape`, carved from one counted buffer."""
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.alloc(nbytes, component).view(dtype).view(tuple(shape))

    def copy(self, src: torch.Tensor, component: str) -> torch.Tensor:
        """A counted device copy of `src`."""
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
