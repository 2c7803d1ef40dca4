"""specx: run big LLMs on one machine with layer offloading and SpecExec speculative decoding.

The package is grouped by layer (docs/architecture.md): two front ends, `terminal/` (the `specx`
command line) and `serve/` (the HTTP API), over `tools/`, the shared `session/` layer and the
lossless decoding core, `core/`.
`offload/` is a separate library the loader uses for models that do not fit on the device.
"""

__version__ = "0.1.0"


def _quiet_startup_interrupt() -> None:
    """Ctrl-C while the `specx` CLI (not a library user) is still importing: exit 130, no traceback."""
    import os
    import signal
    import sys

    if os.path.basename(sys.argv[0] if sys.argv else "") not in ("specx", "-m"):
        return
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
    except ValueError:  # not the main thread
        pass


_quiet_startup_interrupt()
