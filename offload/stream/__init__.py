"""The streaming engine: a causal LM whose decoder layers live in RAM or on disk.

Contract: `placement` decides which layers stay resident (a pure function of byte sizes);
`storage`, `hostmem` and `devmem` hold the bytes (O_DIRECT disk reads, pinned arenas, device
memory queries); `prefetch` is the iterator that yields layer i ready while layer i+1 copies in;
`loader` builds layers from a Checkpoint; `model.OffloadedCausalLM` is the forward pass.
Above `quant`, `arch` and `formats`; never imports `planning` or `selfdraft`.
"""
