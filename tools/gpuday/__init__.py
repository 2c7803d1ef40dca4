"""tools/gpu_day.py's parts: the image it targets, the wheel pack, the run's phases, the rehearsal.

Contract: nothing here is imported by specx itself; every module is importable on a machine without
CUDA (the run's phases take `smoke` to run tiny on the CPU). The run keeps its state only under its
--out folder.
"""
