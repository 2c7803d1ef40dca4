"""The CPU runtime: specx's own C kernels and the Python that builds, calls and feeds them.

Contract: this package computes on the CPU from packed bytes and owns nothing about files or plans.
`ggml_kernel` builds kernels/ (ggml_gemv.c: the packed GEMV/GEMM of the GGUF block types and specx's
SX3/SX2/Q8A; decode_stack.c: a whole decoder stack in one call; pool.c: its worker threads) once per
machine and calls it through ctypes; `leanstack` runs a decoder stack as one C call a pass, reading the
engine's KV slab in place (`slabcheck`: whether a cache is such a slab); `mxfp4_kernel` dequantizes
MXFP4 experts. It imports nothing of offload but `cachedir`. tests/test_kernel_layouts.py checks the C
structs' layouts against the Python side.
"""
