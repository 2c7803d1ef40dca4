"""CUDA caching-allocator settings, applied by the CLI before anything imports torch.

Contract: `configure_allocator()` sets PYTORCH_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF before torch 2.9)
to expandable_segments:True unless the user set either or the platform (Windows, WSL) lacks them.
Imports nothing heavy: `specx --help` must not load torch.
"""

from __future__ import annotations

import os

ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"  # torch < 2.9
NEW_ENV = "PYTORCH_ALLOC_CONF"  # torch >= 2.9: the device-generic name (the old one still read)


def _env_name() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ALLOC_ENV
    return NEW_ENV if (major, minor) >= (2, 9) else ALLOC_ENV


def configure_allocator(environ=None, platform: str | None = None, proc_version: str | None = None) -> bool:
    """Ask for expandable segments before CUDA initialises; True when set. The streamed regime's
    pass-sized activations between long-lived slots fragment fixed segments until a 24 GB plan meets
    an OOM with gigabytes "reserved but unallocated"; expandable ones grow one virtual range instead."""
    import sys

    environ = os.environ if environ is None else environ
    platform = sys.platform if platform is None else platform
    if proc_version is None:
        try:
            with open("/proc/version") as f:
                proc_version = f.read()
        except OSError:
            proc_version = ""
    if ALLOC_ENV in environ or NEW_ENV in environ:
        return False
    if platform != "linux" or "microsoft" in proc_version.lower():
        return False
    environ[_env_name()] = "expandable_segments:True"
    return True
