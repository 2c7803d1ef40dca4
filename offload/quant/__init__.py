"""Quantization kernels and caches: the weights a layer computes with, below 16 bits.

Contract: `nf4` (bitsandbytes NF4), `lowbit` (HQQ 3/2-bit substitutes) and `fused` (their
compiled unpack-scale-matmul) turn packed weights into matmuls; `quant_cache` writes quantized
copies on disk (formats/prequant.py reads them). Reads checkpoints only through `offload.formats`.
"""
