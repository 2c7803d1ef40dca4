"""Stored hardware profiles: where they live, reading and validating them, and what the session takes from one.

Contract: `write_profile` / `read_profile` / `find_profile` store and find the versioned dict that
`specx profile` builds, under $XDG_CONFIG_HOME/specx/profiles/ (profiles/README.md). `card(name)` is
a row of profiles/cards.json (`--gpu NAME`); `cost_device_for` the passcost.Device the cost model
evaluates with (the card's figures, else the profile's measured rates, else the priors, each naming
its source). `profile_matches` returns a profile's model timings only for this machine, target and
dtype. Nothing here measures or prints; errors are SpecxError.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from specexec_cli.errors import SpecxError

SCHEMA, VERSION = "specx-profile", 1
CARDS = Path(__file__).resolve().parents[2] / "profiles" / "cards.json"
PCIE_X16_GBPS = {3: 16, 4: 32, 5: 64}  # published per-direction rate of a x16 link, by PCIe generation


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "specx" / "profiles"


def default_profile_path() -> Path:
    return config_dir() / f"{socket.gethostname()}.json"


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
        raise SpecxError(
            f"cannot write the profile to {path} ({exc.strerror}); pass --out to a writable file"
        ) from None
    return path


def read_profile(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecxError(f"profile {path} not found; run `specx profile` or pass an existing --profile") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecxError(f"profile {path} is unreadable ({exc.__class__.__name__}); re-run `specx profile`") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise SpecxError(f"profile {path} is not a specx profile; create one with `specx profile --out FILE`")
    if data.get("version") != VERSION:
        raise SpecxError(
            f"profile {path} has profile version {data.get('version')}, this specx reads {VERSION}; "
            "re-run `specx profile`"
        )
    if not isinstance(data.get("models") or {}, dict):
        raise SpecxError(f'profile {path} has a malformed "models" entry; re-run `specx profile`')
    data["_path"] = f"profile {path}"
    return data


def find_profile(explicit: Path | None) -> dict | None:
    """--profile FILE, else the last profile written on this machine, else None (quietly)."""
    if explicit is not None:
        return dict(read_profile(explicit), _explicit=True)
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


def card(name: str) -> dict:
    """The published row of card `name` (case and spaces ignored: "RTX 4090", "4070 Ti", "h100")."""
    try:
        table = json.loads(CARDS.read_text())["cards"]
    except (OSError, ValueError, KeyError):
        raise SpecxError(
            f"the cards table {CARDS} is missing or unreadable; pass --device cuda "
            "--max-gpu-memory SIZE instead of --gpu"
        ) from None
    key = "".join(ch for ch in name.lower() if ch.isalnum() or ch == "-").removeprefix("rtx").removeprefix("-")
    row = table.get(key)
    if row is None:
        raise SpecxError(
            f"--gpu {name}: not in the cards table; known: {', '.join(table)} "
            "(or plan with --device cuda --max-gpu-memory SIZE)"
        )
    return row


BF16_UNITS = {"amx_bf16": 8, "avx512_bf16": 2}
"""CPU flags of native bf16 matmul units -> bf16 FLOP/s as a multiple of the fp32 prior, where no profile
measured it. Conservative: a 2-core Zen 4 VM with avx512_bf16 ran a bf16 matmul at 880 GFLOP/s against fp32's 194."""


def native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The best native bf16 unit this CPU's flags name (a key of BF16_UNITS), or None."""
    try:
        flags = set(cpuinfo.read_text(errors="replace").split())
    except OSError:
        return None
    return next((unit for unit in BF16_UNITS if unit in flags), None)


def cost_device_for(device: str, gpu: str | None, profile: dict | None):
    """The passcost.Device a plan is modelled with (module docstring)."""
    from offload.planning import LINK_EFFICIENCY, PRIORS, device_for

    if gpu is not None:
        row, src = card(gpu), f"published: {card(gpu)['name']}"
        given = dict(
            memory_bps=row["memory_gbps"] * 1e9,
            link_bps=LINK_EFFICIENCY * PCIE_X16_GBPS[row["pcie_gen"]] * 1e9,
            flops16=row.get("tensor16_tflops", 0) * 1e12,
            flops32=row.get("fp32_tflops", 0) * 1e12,
        )
        return device_for(device, {k: src for k in given}, **given)
    prof = profile or {}
    host = prof.get("hostname", "?")
    given, srcs = {}, {}
    mem = (prof.get("device_memory") or {}).get(device)
    if mem:
        given["memory_bps"], srcs["memory_bps"] = mem["gbps"] * 1e9, f"measured: {mem.get('name', device)} ({host})"
    if device == "cuda" and prof.get("gpus"):
        given["link_bps"] = (prof["gpus"][0].get("h2d_pinned_gbps") or 0) * 1e9
    if (prof.get("disk") or {}).get("read_gbps") and (prof["disk"].get("method") == "o_direct"):
        given["disk_bps"] = prof["disk"]["read_gbps"] * 1e9
        given["disk_read_s"] = prof["disk"].get("read_latency_s")  # None before it was probed: the prior
    mm = prof.get("matmul") or {}
    if mm.get("device") == device:
        given["flops16"] = (mm.get("bf16_gflops") or 0) * 1e9
        given["flops32"] = (mm.get("fp32_gflops") or 0) * 1e9
    if device == "cpu" and "flops16" not in given and (units := native_bf16()):
        given["flops16"] = BF16_UNITS[units] * PRIORS["cpu"]["flops32"]
        srcs["flops16"] = f"prior: this CPU has {units} ({BF16_UNITS[units]}x the fp32 prior)"
    floors = (prof.get("floors") or {}).get(device) or {}
    given.update({k: floors[k] for k in ("forward_floor_s", "step_floor_s") if floors.get(k)})
    for k in given:
        srcs.setdefault(k, f"measured ({host})")
    deq = prof.get("dequant") or {}
    rates = {}
    if deq.get("device") == device:
        rates = {k: v["gbps"] * 1e9 for k, v in deq.items() if isinstance(v, dict) and v.get("gbps")}
    srcs["dequant"] = f"measured ({host})"
    return device_for(device, srcs, rates, **given)


def profile_matches(profile: dict | None, target, dtype: str) -> tuple[dict | None, str]:
    """(the profile's model timings if they are for this machine, target and dtype; else None and why,
    or "" for this machine's last profile that timed another model)."""
    if not profile:
        return None, ""
    name = profile.get("_path", "the profile")
    if profile.get("hostname") != socket.gethostname():
        return None, f"{name} was measured on {profile.get('hostname')!r}, not this machine: its figures are not used"
    models = profile.get("models") or {}
    if not models.get("target_seconds"):
        return None, ""
    same = models.get("target_resolved") == str(Path(target).resolve()) if target else False
    if not profile.get("_explicit") and (not same or models.get("plan_dtype") not in (None, dtype)):
        return None, ""  # this machine's last profile timed another model: quietly not used
    if not same:
        return None, (
            f"{name} timed another target ({models.get('target')}); its pass times are not used "
            "(run `specx profile --target` with this one)"
        )
    timed = models.get("plan_dtype")
    if timed and timed != dtype:
        return None, f"{name} timed this target at --dtype {timed}, not {dtype}; its pass times are not used"
    return models, ""


def plan_timings(models: dict | None) -> dict | None:
    """The measured figures the plan uses: pass seconds by tree size, draft timings, MoE routing counts."""
    if not models:
        return None
    return dict(
        placement=models.get("placement"),
        target_seconds=models.get("target_seconds"),
        draft=models.get("draft_timings") or {},
        routing=(models.get("routing") or {}).get("counts"),
    )
