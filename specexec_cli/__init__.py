"""specx: run big LLMs on one machine with layer offloading and SpecExec speculative decoding.

The package is the CLI front end (`cli.py`) over a lossless decoding engine (`engine.py`).
`offload/` is a separate library the loader uses for models that do not fit on the device.
"""

__version__ = "0.1.0"
