"""GGUF headers read and checked before any tensor byte: the files of a model, its tensors, its metadata.

Contract: `gguf_parts(path)` gives the ordered part files of the model at `path` (a .gguf file, a
`-00001-of-0000N.gguf` part, a directory holding one model, an ollama blob). `read_part(file)` is the
gguf package's GGUFReader of one part, refusing in one OffloadError line (file, tensor, fix) an empty,
non-GGUF or unparsable file, a type id that is no GGML type or one specx cannot dequantize, and tensor
bytes that run past the end, overlap or leave a gap, or start off the alignment.
`value(reader, key)` is one metadata value as a plain Python value.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from offload.errors import OffloadError
from offload.formats import gguf_quants as gq

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf_file(path: Path) -> bool:
    """A .gguf file, or any file starting with the GGUF magic (ollama blobs have no extension)."""
    if not path.is_file():
        return False
    if path.suffix == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_parts(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.gguf") if p.is_file())
        firsts = [p for p in files if not _SPLIT.match(p.name) or _SPLIT.match(p.name)["no"] == "00001"]
        if len(firsts) != 1:
            names = ", ".join(p.name for p in firsts[:4]) or "none"
            raise OffloadError(f"{path}: holds {len(firsts)} GGUF models ({names}); pass the .gguf file itself")
        path = firsts[0]
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise OffloadError(
            f"{missing[0]}: part {parts.index(missing[0]) + 1} of {count} of this split GGUF is "
            "missing; download every part into the same folder"
        )
    return parts


def _header_checked_reader():
    """A GGUFReader whose tensor table is checked (types, byte ranges) before the package maps it."""
    from gguf import GGUFReader

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = int(self.data.shape[0])
            spans = sorted(_tensor_span(self, start_offs, size, field) for field in fields)
            _check_back_to_back(self, spans)
            return super()._build_tensors(start_offs, fields)

        def __init__(self, path):
            self.path = path
            super().__init__(path)

    return CheckedReader


def _tensor_span(reader, start_offs, size: int, field) -> tuple[int, int, str]:
    """(begin, end, name): one tensor-table entry's bytes in the file, its type, shape and range checked."""
    from gguf import GGMLQuantizationType

    _, name_data, _, dims, raw_dtype, offset = field.parts
    name = bytes(name_data).decode("utf-8", errors="replace")[:80]
    tid = int(raw_dtype[0])
    try:
        qtype = GGMLQuantizationType(tid)
    except ValueError:
        raise OffloadError(
            f"{reader.path}: tensor {name!r} has type id {tid}, which is not a GGML type; "
            "the file is corrupt - re-download it"
        ) from None
    if tid not in gq.BLOCK:
        raise OffloadError(
            f"{reader.path}: tensor {name!r} is {qtype.name}, which specx cannot dequantize (supported: "
            f"{', '.join(gq.NAMES[t] for t in gq.SUPPORTED)}); use a Q4_K_M, Q5_K_M, Q8_0 or Q4_0 file"
        )
    shape = tuple(int(d) for d in reversed(dims.tolist()))
    if any(d <= 0 for d in shape) or len(shape) > 4:
        raise OffloadError(
            f"{reader.path}: tensor {name!r} has shape {list(shape)}; the file is corrupt - re-download it"
        )
    try:
        n = gq.nbytes(tid, shape)
    except ValueError as exc:
        raise OffloadError(f"{reader.path}: tensor {name!r}: {exc}; the file is corrupt - re-download it") from None
    begin = int(start_offs) + int(offset[0])
    if int(offset[0]) % reader.alignment:
        raise OffloadError(
            f"{reader.path}: tensor {name!r} starts at data offset {int(offset[0])}, off the "
            f"file's {reader.alignment}-byte alignment; the file is corrupt - re-download it"
        )
    if begin + n > size:
        raise OffloadError(
            f"{reader.path}: tensor {name!r} ({qtype.name}, {list(shape)}: {n} bytes at "
            f"offset {begin}) runs past the end of the file ({size} bytes); the file is "
            "truncated - re-download it"
        )
    return begin, begin + n, name


def _check_back_to_back(reader, spans: list[tuple[int, int, str]]) -> None:
    """None: raises where two tensors' sorted spans overlap or leave a gap."""
    for (_b0, e0, n0), (b1, _, n1) in itertools.pairwise(spans):
        # writers lay tensors back to back, each padded to the alignment: anything else means a
        # byte count that does not match the tensor's type and shape
        if b1 != e0 + (-e0) % reader.alignment:
            what = "overlap" if b1 < e0 else "leave a gap"
            raise OffloadError(
                f"{reader.path}: tensors {n0!r} and {n1!r} {what} (their byte counts do not "
                "match their types and shapes); the file is corrupt - re-download it"
            )


def read_part(file: Path):
    try:
        size = file.stat().st_size
    except OSError as exc:
        raise OffloadError(f"{file}: cannot read ({exc.strerror}); check the path") from None
    if size < 24:
        raise OffloadError(f"{file}: {size} bytes, too short for a GGUF header; the file is truncated - re-download it")
    try:
        return _header_checked_reader()(file)
    except OffloadError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        first = (str(exc).splitlines() or [""])[0][:100]
        raise OffloadError(
            f"{file}: not a readable GGUF file ({exc.__class__.__name__}: {first}); the file is "
            "truncated or corrupt - re-download it"
        ) from None
    except OSError as exc:
        raise OffloadError(f"{file}: cannot read ({exc.strerror}); check the path") from None


def value(reader, key: str, default=None):
    """Metadata value of `key` (str, int, float, bool, or a list of them); `default` if absent or unreadable."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (ValueError, UnicodeDecodeError, IndexError, TypeError):
        return default
