"""`gpu_day.py pack`: the wheels the image lacks, for the box's Python, and the size of what travels.

Contract:
- `needed(python)` lists (name, version) for every distribution the GPU run needs that the image
  (image.py) lacks, or holds at a version outside pyproject.toml's range: pyproject's dependencies
  and the RUN_EXTRAS groups, then, read from each packed wheel's own Requires-Dist (markers evaluated
  for Linux x86-64 and that Python, extras left out), every dependency the image lacks, transitively.
  The version packed is the one installed here where it satisfies the range (the tested one), else
  the newest the range allows. torch is never packed: the image's build is the one that has CUDA.
- `build(dest, python)` fetches them into `dest` with `pip download --only-binary=:all: --no-deps`
  for that Python and manylinux x86-64; hqq, which publishes no wheel, is built here into a pure
  one with DISABLE_CUDA=1 (its setup builds no kernel then). Wheels of earlier packs that are no
  longer wanted are removed, so one version of each travels.
- `travel_bytes(root, dest)`: tracked + untracked-not-ignored files of the repo (what the device call
  sends) + the pack; `LIMIT` is 62 MiB (the call's 64 MiB less room for the command's carry).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.version import Version

from tools.gpuday.image import IMAGE_PACKAGES, IMAGE_VERSIONS, PLATFORMS, RUN_EXTRAS, norm

LIMIT = 62 << 20
NO_WHEEL = {"hqq"}  # sdist only: built here without CUDA
NEVER = {"torch"}  # the image's CUDA build stays


def marker_env(python: str) -> dict:
    """PEP 508 marker values of the box: CPython `python` on Linux x86-64."""
    return dict(
        python_version=python,
        python_full_version=python + ".0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        platform_release="",
        platform_version="",
        extra="",
    )


def requirements(root: Path) -> list[Requirement]:
    """pyproject's dependencies and the RUN_EXTRAS groups."""
    proj = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    reqs = list(proj["dependencies"])
    for extra in RUN_EXTRAS:
        reqs += proj["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def pick_version(req: Requirement) -> str | None:
    """The version installed here when the range allows it (the tested one), else None (newest allowed)."""
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return None
    return have if req.specifier.contains(Version(have), prereleases=True) else None


def image_satisfies(req: Requirement) -> bool:
    """The image holds `req` (at a version in range where the version is known)."""
    name = norm(req.name)
    if name not in IMAGE_PACKAGES:
        return False
    known = IMAGE_VERSIONS.get(name)
    return known is None or req.specifier.contains(Version(known), prereleases=True)


def wheel_requires(wheel: Path, python: str) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on the box (markers true for `python`, no extra)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or Marker(str(req.marker)).evaluate(marker_env(python)):
            out.append(req)
    return out


def fetch(req: Requirement, dest: Path, python: str) -> Path:
    """One wheel of `req` for the box in `dest` (built here for NO_WHEEL); returns its path."""
    version = pick_version(req)
    spec = f"{req.name}=={version}" if version else f"{req.name}{req.specifier}"
    before = set(dest.glob("*.whl"))
    if norm(req.name) in NO_WHEEL:
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", req.name, "-w", str(dest), spec]
        env = dict(os.environ, DISABLE_CUDA="1")
    else:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "-d",
            str(dest),
            spec,
        ]
        cmd += [a for p in PLATFORMS for a in ("--platform", p)]
        env = dict(os.environ)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        tail = [ln for ln in proc.stderr.splitlines() if "is ignored" not in ln][-3:]
        raise SystemExit(f"gpu_day pack: no wheel of {spec} for Python {python}: " + " / ".join(tail))
    return find_wheel(dest, req.name, version) or next(iter(set(dest.glob("*.whl")) - before))


def find_wheel(dest: Path, name: str, version: str | None) -> Path | None:
    """The wheel of `name` (at `version`, if given) already in `dest`."""
    for w in dest.glob("*.whl"):
        wname, wver = w.name.split("-")[:2]
        if norm(wname) == norm(name) and (version is None or Version(wver) == Version(version)):
            return w
    return None


def build(root: Path, dest: Path, python: str) -> list[Path]:
    """Fetch every needed wheel into `dest`; remove wheels of earlier packs that are not needed."""
    dest.mkdir(parents=True, exist_ok=True)
    todo = [r for r in requirements(root) if norm(r.name) not in NEVER and not image_satisfies(r)]
    done: dict[str, Path] = {}
    while todo:
        req = todo.pop(0)
        if norm(req.name) in done:
            continue
        have = find_wheel(dest, req.name, pick_version(req))
        wheel = have if have and req.specifier.contains(Version(have.name.split("-")[1]), True) else None
        wheel = wheel or fetch(req, dest, python)
        done[norm(req.name)] = wheel
        print(f"gpu_day pack: {wheel.name} ({wheel.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
        todo += [
            d
            for d in wheel_requires(wheel, python)
            if norm(d.name) not in IMAGE_PACKAGES and norm(d.name) not in done and norm(d.name) not in NEVER
        ]
    for w in set(dest.glob("*.whl")) - set(done.values()):
        w.unlink()
    return sorted(done.values())


def repo_files(root: Path) -> list[Path]:
    """Tracked and untracked-not-ignored files: what a device call sends of the repo."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True, capture_output=True
    ).stdout.decode()
    return [root / p for p in out.split("\0") if p and (root / p).is_file()]


def travel_bytes(root: Path, dest: Path) -> dict:
    """{"repo": bytes, "pack": bytes, "total": bytes, "limit": LIMIT} of what a device call carries."""
    repo = sum(p.stat().st_size for p in repo_files(root))
    pack = sum(w.stat().st_size for w in dest.glob("*.whl")) if dest.exists() else 0
    return dict(repo=repo, pack=pack, total=repo + pack, limit=LIMIT)


def main(root: Path, dest: Path, python: str) -> int:
    """The `pack` verb: fetch, print each wheel and the travel size; 1 above LIMIT."""
    wheels = build(root, dest, python)
    size = travel_bytes(root, dest)
    mib = {k: v / 2**20 for k, v in size.items()}
    print(
        f"pack for Python {python}: {len(wheels)} wheels in {dest}, {mib['pack']:.1f} MiB; repo "
        f"{mib['repo']:.1f} MiB; travels {mib['total']:.1f} MiB (limit {mib['limit']:.0f} MiB)"
    )
    for w in wheels:
        print(f"  {w.name}  {w.stat().st_size / 2**20:.2f} MiB")
    if size["total"] > LIMIT:
        print(
            f"gpu_day pack: {mib['total']:.1f} MiB would travel, over {mib['limit']:.0f} MiB; leave a wheel out "
            "or untrack large files",
            file=sys.stderr,
        )
        return 1
    return 0
