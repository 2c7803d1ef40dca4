"""Stored hardware profiles: where they live, reading and validating them, and what the session takes from one.

Contract: `write_profile` / `read_profile` / `find_profile` store and find the versioned dict that
`specx profile` (tools/profiler.py) builds, under $XDG_CONFIG_HOME/specx/profiles/ (default
~/.config), documented in profiles/README.md; `link_peak` is the streaming bandwidth a profile
promises. `card(name)` is one row of the published cards table (profiles/cards.json) that `--gpu NAME`
plans with; `plan_bandwidths(device, gpu, profile)` the (memory, link) bandwidths and their source for
the draft cost model (offload/planning/draftcost.py): the card's published figures, else the profile's measured
device memory bandwidth, else None (the model's priors). Nothing here measures or prints; errors are
SpecxError.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from specexec_cli.errors import SpecxError

SCHEMA, VERSION = "specx-profile", 1
CARDS = Path(__file__).resolve().parents[2] / "profiles" / "cards.json"
PCIE_X16_GBPS = {3: 16, 4: 32, 5: 64}   # published per-direction rate of a x16 link, by PCIe generation


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "specx" / "profiles"


def default_profile_path() -> Path:
    return config_dir() / f"{socket.gethostname()}.json"


def validate_profile(data: object, where: str) -> dict:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise SpecxError(f"{where} is not a specx profile; create one with `specx profile --out FILE`")
    if data.get("version") != VERSION:
        raise SpecxError(f"{where} has profile version {data.get('version')}, this specx reads {VERSION}; "
                         "re-run `specx profile`")
    return data


def write_profile(profile: dict, path: Path | None) -> Path:
    """Write to `path` (default: the per-machine path) and remember it as this machine's last."""
    path = Path(path) if path is not None else default_profile_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, indent=1) + "\n")
        index = config_dir() / "last.json"
        index.parent.mkdir(parents=True, exist_ok=True)
        last = json.loads(index.read_text()) if index.is_file() else {}
        last[socket.gethostname()] = str(path.resolve())
        index.write_text(json.dumps(last, indent=1) + "\n")
    except OSError as exc:
        raise SpecxError(f"cannot write the profile to {path} ({exc.strerror}); pass --out to a writable file") from None
    return path


def read_profile(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecxError(f"profile {path} not found; run `specx profile` or pass an existing --profile") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecxError(f"profile {path} is unreadable ({exc.__class__.__name__}); re-run `specx profile`") from None
    return validate_profile(data, f"profile {path}")


def find_profile(explicit: Path | None) -> dict | None:
    """--profile FILE, else the last profile written on this machine, else None (quietly)."""
    if explicit is not None:
        return read_profile(explicit)
    try:
        last = json.loads((config_dir() / "last.json").read_text()).get(socket.gethostname())
    except (OSError, ValueError, AttributeError):
        last = None
    for cand in (last, default_profile_path()):
        if cand and Path(cand).is_file():
            try:
                return read_profile(Path(cand))
            except SpecxError:
                return None  # a stale or foreign file: fall back to the built-in prior
    return None


def link_peak(profile: dict | None, offload: str, on_cuda: bool) -> float | None:
    """The GB/s that streamed layers can at best reach: disk read (disk tier) or pinned H2D (GPU)."""
    if not profile or offload == "none":
        return None
    if offload == "disk":
        return (profile.get("disk") or {}).get("read_gbps")
    gpus = profile.get("gpus") or []
    return gpus[0].get("h2d_pinned_gbps") if on_cuda and gpus else None


def cards() -> dict[str, dict]:
    try:
        return json.loads(CARDS.read_text())["cards"]
    except (OSError, ValueError, KeyError):
        raise SpecxError(f"the cards table {CARDS} is missing or unreadable; pass --device cuda "
                         "--max-gpu-memory SIZE instead of --gpu") from None


def card_key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == "-").removeprefix("rtx").removeprefix("-")


def card(name: str) -> dict:
    """The published row of card `name` (case and spaces ignored: "RTX 4090", "4070 Ti", "h100")."""
    table = cards()
    row = table.get(card_key(name))
    if row is None:
        raise SpecxError(f"--gpu {name}: not in the cards table; known: {', '.join(table)} "
                         "(or plan with --device cuda --max-gpu-memory SIZE)")
    return row


def plan_bandwidths(device: str, gpu: str | None, profile: dict | None) -> tuple[float | None, float | None, str]:
    """(device memory B/s, host->device B/s, source) for the draft cost model; None where unknown."""
    if gpu is not None:
        row = card(gpu)
        from offload.planning.draftcost import LINK_EFFICIENCY

        return (row["memory_gbps"] * 1e9, LINK_EFFICIENCY * PCIE_X16_GBPS[row["pcie_gen"]] * 1e9,
                f"published: {row['name']}")
    measured = ((profile or {}).get("device_memory") or {}).get(device)
    link = None
    if device == "cuda" and (profile or {}).get("gpus"):
        link = (profile["gpus"][0].get("h2d_pinned_gbps") or 0) * 1e9 or None
    if measured:
        return measured["gbps"] * 1e9, link, f"measured: {measured.get('name', device)} ({profile.get('hostname', '?')})"
    return None, link, ""
