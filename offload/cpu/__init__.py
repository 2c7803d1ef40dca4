"""The CPU runtime: specx's own C kernels and the Python that builds, calls and feeds them.

Contract: this package computes on the CPU from packed bytes and owns nothing about files or plans.
- `ggml_kernel`: builds kernels/ (C: ggml_gemv.c the packed GEMV/GEMM of the GGUF block types and
  specx's SX3/SX2/Q8A, decode_stack.c one call for a whole decoder stack, pool.c its worker threads)
  once per machine with the system compiler, and calls it through ctypes: `linear`, `PackedHead`,
  `head_logits`, the thread rules (`threads`, `host_ops_on_one_thread`) and the speed model's `COST`.
- `leanstack`: `LeanStack`, a decoder stack (Llama-family or Gemma-3 layers whose linears the kernel
  serves) run as one C call a pass, reading the engine's KV slab in place.
- `slabcheck`: whether a KV cache is a slab that stack can read (checked once per cache).
It imports nothing of offload but `cachedir`: formats/ decides which checkpoint weights the kernel may
serve (qlinear.gguf_kernel_type) and the planner prices them with `COST`. The C structs' layouts are
checked against the Python side in tests/test_kernel_layouts.py; the kernels' numbers against a
float64 reference under ASan/UBSan in tests/test_kernel_sanitized_reference.py.
"""
