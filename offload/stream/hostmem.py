"""Aligned host allocation and CUDA page-locking: the one place both storage and devmem use.

Contract:
- `aligned_empty(nbytes, align, huge=True)`: a host uint8 buffer on an `align` boundary; large ones are
  anonymous mmaps (O_DIRECT targets), from HUGE (2 MB) up in transparent huge pages unless `huge` is False.
  Tensors start on ARENA_ALIGN (256 bytes): CUDA kernels that load 128-bit vectors fault on less.
- `HostPins` page-locks one owner's regions on CUDA and unregisters them on `release()` or when the owner is
  collected; a failed (un)registration clears CUDA's sticky error and is one OffloadNotice line (a region
  that failed to unpin stays mapped for the process's life).
"""

from __future__ import annotations

import mmap
import warnings
import weakref

import torch

from offload.errors import OffloadNotice

IO_ALIGN = 4096  # O_DIRECT offset/length/buffer alignment (covers 512 and 4096-byte sectors)
HUGE = 2 << 20  # a transparent huge page (x86-64; arm64 with 4 KB pages): buffers this large start on one
ARENA_ALIGN = 256  # every tensor in a slot, arena or pool buffer starts on this boundary
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def aligned_empty(nbytes: int, align: int = IO_ALIGN, huge: bool = True) -> torch.Tensor:
    if huge and nbytes >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        return _huge_empty(nbytes)
    if nbytes >= IO_ALIGN or align > ARENA_ALIGN:
        mm = mmap.mmap(-1, max(align_up(nbytes, IO_ALIGN), IO_ALIGN))
        return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes] if nbytes else torch.empty(0, dtype=torch.uint8)
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    skip = -raw.data_ptr() % align
    return raw[skip : skip + nbytes]


def _huge_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` of private anonymous memory on a HUGE boundary in transparent huge pages: a streamed weight
    crosses a TLB entry every 2 MB, not 4 KB (the Q8_0 262144 x 640 head, T = 1, 2 threads: 9.5 -> 6.7 ms).
    Private: a shared mapping is shmem, which rarely gets huge pages (transparent_hugepage/shmem_enabled)."""
    mm = mmap.mmap(-1, align_up(nbytes, IO_ALIGN) + HUGE, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE
    # only the buffer's whole huge pages, before their first touch (the tail stays in 4 KB pages, so
    # the resident set never exceeds the buffer's own bytes)
    mm.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // HUGE * HUGE)
    return whole[skip : skip + nbytes]


def clear_cuda_error() -> None:
    """Consume CUDA's last error on this thread: torch's launch check reads (so resets) cudaGetLastError and
    raises it; the second launch proves the state clean."""
    if not torch.cuda.is_available():
        return
    for _ in range(2):
        try:
            _probe_launch()
            return
        except RuntimeError:
            continue


def _probe_launch() -> None:
    torch.zeros(1, device="cuda")  # a fill kernel: its launch check reads cudaGetLastError


_STILL_PINNED: list = []  # buffers whose cudaHostUnregister failed: never unmapped while maybe registered


def _unregister(entries: list, failures: list) -> None:
    """cudaHostUnregister every entry; a failure keeps its buffer for the process's life (unmapping registered
    memory is undefined) and adds one line to `failures`."""
    for ptr, buf in entries:
        rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if rc != 0:
            clear_cuda_error()
            _STILL_PINNED.append(buf)
            failures.append(f"could not unpin {buf.numel() / 2**30:.1f} GiB of host memory (cudaError {rc})")
    entries.clear()


class HostPins:
    def __init__(self, device: torch.device):
        self.enabled = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._entries: list[tuple[int, torch.Tensor]] = []  # (pointer, buffer kept alive until unpinned)
        self.failures: list[str] = []  # one line per region left pageable

    def attach(self, owner) -> None:
        weakref.finalize(owner, _unregister, self._entries, self.failures)

    def notice(self, consequence: str) -> None:
        """One warning line for the latest failed registration and what it costs."""
        if self.failures:
            warnings.warn(f"offload: {self.failures[-1]}; {consequence}", OffloadNotice, stacklevel=3)

    def pin(self, buf: torch.Tensor, what: str) -> bool:
        """True when `buf` is now pinned; False leaves it pageable."""
        if not self.enabled or buf.numel() == 0:
            return False
        rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), CUDA_HOST_REGISTER_PORTABLE))
        if rc != 0:
            clear_cuda_error()
            self.failures.append(
                f"could not pin {buf.numel() / 2**30:.1f} GiB of host memory for {what} (cudaError {rc})"
            )
            return False
        self._entries.append((buf.data_ptr(), buf))
        return True

    def release(self) -> None:
        """Unregister every region this owner pinned (idempotent)."""
        if self.enabled and self._entries:
            before = len(self.failures)
            _unregister(self._entries, self.failures)
            if len(self.failures) > before:
                self.notice("that memory stays allocated until the process exits")
