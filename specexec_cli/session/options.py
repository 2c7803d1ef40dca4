"""Flag validation and model set-up for the `specx` commands, without typer.

Contract: every function here turns raw flag values into engine/loader objects (GenerationConfig,
LoadOptions, a MemoryPlan, loaded Models) or raises `SpecxError` with a one-line fix. Nothing here
imports torch or transformers at module level, so `specx --help` and argument errors stay fast.
`require_for_run(opts)` refuses, before anything loads, a run that needs a missing optional package
(bitsandbytes, gguf, hqq; session/deps.py) or asks for `--draft-bits 4` on an nf4 target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from specexec_cli.session import notices
from specexec_cli.session.modelref import AUTO, SELF, ModelRef
from specexec_cli.session.names import DEMO_DIR, default_target, is_demo, is_demo_name, real_model_steps
from specexec_cli.errors import SpecxError


@dataclass(frozen=True)
class ModelFlags:
    """The flags `run`, `chat` and `serve` share (declared once in terminal/flags.py, SHARED)."""

    target: str | None = None
    draft: str | None = None
    method: str = "specexec"
    budget: str = "auto"
    max_depth: int = 64
    max_beams: int = 32
    max_branch: int = 32
    max_new_tokens: int = 256
    temperature: float | None = None  # None: the target's generation_config.json (gendefaults.py)
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    dtype: str = "auto"
    draft_dtype: str = "auto"
    draft_bits: str = "auto"
    device: str = "auto"
    offload: str = "auto"
    max_gpu_memory: str | None = None
    max_ram: str | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False
    no_chat_template: bool = False
    profile: Path | None = None
    gamma: int = 5
    branching: str | None = None
    ctx: int = 8192
    embeddings: str = "auto"
    dry_run: bool = False
    gpu: str | None = None  # --gpu NAME: plan for a card of the published table (profiles/cards.json)

    def config(self):
        cfg = generation_config(self.method, self.budget, self.max_depth, self.max_beams, self.max_branch,
                                self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.seed,
                                "cuda" if self.gpu else self.device)
        from specexec_cli.core.methods.common import flag_options, with_settings  # after: a bad flag never loads torch

        return with_settings(cfg, **flag_options(self.gamma, self.branching, self.profile))

    def plan(self, cfg):
        """(LoadOptions, MemoryPlan, cfg); unset sampling flags come from the target's defaults."""
        from specexec_cli.session.gendefaults import merge

        opts, plan, cfg = plan_for_cli(self, cfg)
        sampling = merge(self.checkpoint_defaults(opts.target), self.temperature, self.top_k, self.top_p)
        return opts, plan, replace(cfg, sampling=sampling)

    @staticmethod
    def checkpoint_defaults(target):
        """The target's (a ModelRef) own sampling defaults (greedy when it cannot be resolved)."""
        from specexec_cli.session.gendefaults import GREEDY, checkpoint_sampling, generation_of

        try:
            return checkpoint_sampling(generation_of(target))
        except SpecxError:
            return GREEDY


def pick_refs(target, draft: str | None, method: str, allow_pickle: bool = False, trust: bool = False):
    """(ModelRef of the target, draft name). No --target: names.default_target(), with a notice. The
    demo pair drafts with its own draft; any other target without --draft gets --draft auto."""
    given = target is not None
    if not given:
        target = default_target()
        if is_demo_name(target) and draft is not None and draft not in (SELF, AUTO):
            raise SpecxError("--draft given without --target; pass both, or neither for the demo pair")
    demo = is_demo_name(getattr(target, "name", target))
    if demo:
        if not (DEMO_DIR / "target" / "config.json").exists():
            raise SpecxError("the demo pair is not installed; pass --target (and --draft) for a real model")
        if not given:
            steps = real_model_steps()
            get = f"for a real model: {' and '.join(steps)}, or pass --target" if steps else "pass --target for a real one"
            notices.notice(f"using the embedded demo pair (tiny Python-code models); {get}")
        target, draft = str(DEMO_DIR / "target"), (draft or str(DEMO_DIR / "draft"))
    ref = target if isinstance(target, ModelRef) else ModelRef("--target", target, allow_pickle, trust)
    if not given and not demo:
        notices.notice(f"no --target: running {ref.path.name} ({ref.name}); --target demo runs the embedded demo pair")
    return ref, (None if method == "ar" else draft or AUTO)


def parse_budget(budget: str, device: str) -> int:
    """'auto' → the starting budget (a budget.BudgetTuner then re-tunes it); else a positive integer."""
    if budget.strip().lower() == "auto":
        import torch

        on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        return 1024 if on_cuda else 64
    try:
        value = int(budget)
    except ValueError:
        raise SpecxError(f"--budget must be a positive integer or 'auto' (got {budget!r})") from None
    if value < 1:
        raise SpecxError(f"--budget must be >= 1 (got {value})")
    return value


def parse_size_opt(value: str | None, flag: str) -> int | None:
    if value is None:
        return None
    from offload import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise SpecxError(f"{flag}: {exc}") from None


def generation_config(method, budget, max_depth, max_beams, max_branch, max_new_tokens, temperature,
                      top_k, top_p, seed, device):
    for flag, value in (("--max-depth", max_depth), ("--max-beams", max_beams), ("--max-branch", max_branch),
                        ("--max-new-tokens", max_new_tokens)):
        if value < 1:
            raise SpecxError(f"{flag} must be >= 1 (got {value})")
    n_budget = parse_budget(budget, device)  # before the imports below: a bad number never loads torch
    from specexec_cli.core.draft import TreeShape
    from specexec_cli.core.engine import GenerationConfig
    from specexec_cli.core.methods import step_for
    from specexec_cli.core.sampling import SamplingParams, validate

    step_for(method)  # an unknown --method: one line naming the choices
    sampling = SamplingParams(temperature=0.0 if temperature is None else temperature,
                              top_k=0 if top_k is None else top_k, top_p=1.0 if top_p is None else top_p)
    validate(sampling)  # unset (None) values are checked once filled from the checkpoint (ModelFlags.plan)
    shape = TreeShape(n_budget, max_depth, max_beams, max_branch)
    return GenerationConfig(method=method, shape=shape, sampling=sampling, seed=seed, max_new_tokens=max_new_tokens)


def config_record(cfg, offload_plan: str | None = None) -> dict:
    rec = dict(
        method=cfg.method, budget=cfg.shape.budget, max_depth=cfg.shape.max_depth,
        max_beams=cfg.shape.max_beams, max_branch=cfg.shape.max_branch, temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k, seed=cfg.seed, max_new_tokens=cfg.max_new_tokens,
    )
    return rec if offload_plan is None else {**rec, "offload": offload_plan}


def parse_draft_bits(value: str, draft: str | None) -> int | None:
    """--draft-bits: None for auto, else 4 | 3 | 2, and only with --draft self."""
    value = str(value).strip().lower()
    if value == "auto":
        return None
    if value not in ("4", "3", "2"):
        raise SpecxError(f"--draft-bits must be auto, 4, 3 or 2 (got {value!r})")
    if draft not in (SELF, AUTO):
        raise SpecxError("--draft-bits applies to --draft self only; drop it or pass --draft self")
    return int(value)


def plan_for_cli(flags: ModelFlags, cfg):
    """(LoadOptions, MemoryPlan, cfg) from headers only; `--budget auto` may come back lowered to fit,
    and --draft auto becomes the draft the plan models fastest, or none."""
    from specexec_cli.session import deps
    from specexec_cli.session.loading import LoadOptions
    from specexec_cli.session.planning import make_plan, resolve_auto
    from specexec_cli.session.profiles import find_profile

    f = flags
    if f.offload not in ("none", "ram", "disk", "auto"):
        raise SpecxError(f"--offload must be none, ram, disk or auto (got {f.offload!r})")
    if f.ctx < 1:
        raise SpecxError(f"--ctx must be >= 1 (got {f.ctx})")
    target, draft = pick_refs(f.target, f.draft, f.method, f.allow_pickle, f.trust_remote_code)   # one ModelRef
    opts = LoadOptions(
        target=target, draft=draft, dtype=f.dtype, device=f.device, allow_pickle=f.allow_pickle,
        trust_remote_code=f.trust_remote_code, offload=f.offload, ctx=f.ctx, embeddings=f.embeddings,
        draft_dtype=f.draft_dtype, max_gpu_memory=parse_size_opt(f.max_gpu_memory, "--max-gpu-memory"),
        max_ram=parse_size_opt(f.max_ram, "--max-ram"), draft_bits=parse_draft_bits(f.draft_bits, draft),
    )
    temperature = f.temperature if f.temperature is not None else f.checkpoint_defaults(target).temperature
    auto_budget, profile = f.budget.strip().lower() == "auto", find_profile(f.profile)
    require_for_run(opts)   # a missing optional package: one line, exit 2, before anything loads

    def replan(o):
        return make_plan(o, cfg.shape, auto_budget, temperature, f.gpu, profile)

    plan = replan(opts)
    opts, plan, skipped = deps.usable_draft(opts, plan, replan)   # widths whose package is missing are out
    if opts.draft == AUTO:
        opts, plan = resolve_auto(opts, plan, replan, skipped)
    if opts.draft is None:
        cfg = replace(cfg, method="ar")
    if plan is not None and plan.budget != cfg.shape.budget and plan.fits:
        cfg = replace(cfg, shape=replace(cfg.shape, budget=plan.budget))
    return replace(opts, plan=plan), plan, cfg


def show_plan(plan, stats_json: Path | None) -> None:
    """--dry-run: the plan table on stdout, {"plan": ...} in --stats-json; exit 2 when it cannot fit."""
    if plan is None:
        raise SpecxError("--dry-run reads safetensors headers; pickle checkpoints cannot be planned")
    notices.plan(plan.to_json())
    if stats_json is not None:
        stats_json.write_text(json.dumps({"plan": plan.to_json()}, indent=1) + "\n")
    if not plan.fits:
        raise SpecxError(plan.reason)


def load_planned(opts, plan, progress):
    """Refuse a plan that cannot fit, then load and print the placement."""
    from specexec_cli.session.loading import load_models
    from specexec_cli.session.planning import require_host

    require_host(plan)
    models = load_models(replace(opts, progress=progress))
    models.plan_json = plan.to_json() if plan is not None else None   # --budget auto's model (core/budget.py)
    if models.plan_json is not None and opts.draft == SELF:   # the profile timings that may price its drafting
        models.plan_json["draft_key"] = f"self-{plan.substitute_bits}"
    elif models.plan_json is not None and opts.draft is not None:   # an explicit small draft: its own row,
        models.plan_json["used"] = next((c for c in plan.candidates   # whichever draft the model ranks first
                                         if c["draft"] not in ("self", "none")), None)
        models.plan_json["draft_key"] = f"small:{Path(opts.draft.name).expanduser().resolve()}"
    placed = getattr(models.target, "plan", None)
    if placed is not None:
        notices.notice(placed.describe())
    return models


def prompt_text(prompt_file: str | None, prompt: str | None) -> str:
    """PROMPT_FILE (or - for stdin) or -p TEXT: exactly one of them."""
    if prompt is not None and prompt_file is not None:
        raise SpecxError("give either PROMPT_FILE or -p/--prompt TEXT, not both")
    if prompt is not None:
        if not prompt.strip():
            raise SpecxError("-p/--prompt is empty; pass some text")
        return prompt
    if prompt_file is None:
        raise SpecxError("no prompt: pass a PROMPT_FILE (or - for stdin) or -p TEXT")
    from specexec_cli.session.prompts import read_prompt

    return read_prompt(prompt_file)


def hardware_fit(budget: str, cfg, profile_path, models, offload: str):
    """(BudgetTuner for --budget auto with specexec else None, link peak GB/s, the profile or None)."""
    from specexec_cli.core.budget import tuner_for
    from specexec_cli.session.profiles import find_profile, link_peak

    profile = find_profile(profile_path)
    on_cuda = getattr(models.target, "device", None) is not None and models.target.device.type == "cuda"
    auto = budget.strip().lower() == "auto" and cfg.method == "specexec"
    plan = getattr(models, "plan_json", None)
    tuner = tuner_for(models, cfg.shape, profile) if auto else None
    if tuner is not None and getattr(models, "kv_rows", None) is not None:
        rows = ((plan or {}).get("used") or (plan or {}).get("choice") or {}).get("by_budget", [])
        sized = max([cfg.shape.budget] + [r["budget"] for r in rows])
        tuner.max_budget = min(tuner.max_budget, sized)   # the memory plan sized caches for this
    return tuner, link_peak(profile, offload, on_cuda), profile


@dataclass
class Fitted:
    flags: ModelFlags
    opts: object
    models: object
    cfg: object
    tuner: object
    link: float | None
    profile: dict | None

    def chat_session(self, system: str | None, prompt_cache=None):
        from specexec_cli.session.chat import ChatSession

        return ChatSession(self.models, self.cfg, system=system, use_template=not self.flags.no_chat_template,
                           tuner=self.tuner, profile=self.profile, config_record=config_record,
                           code=is_demo(self.opts.target.name), prompt_cache=prompt_cache)


def load_fitted(flags: ModelFlags, opts, plan, cfg, progress=None) -> Fitted:
    """load_planned (inside `progress` when given), hardware_fit, then the pair's calibration prior on
    `cfg`; the models are closed again when the fitting fails."""
    from contextlib import nullcontext

    from specexec_cli.core.methods.common import with_settings
    from specexec_cli.session.calprobe import pair_prior
    from specexec_cli.session.loading import close_models

    with progress if progress is not None else nullcontext() as shown:
        models = load_planned(opts, plan, shown)
    try:
        tuner, link, prof = hardware_fit(flags.budget, cfg, flags.profile, models, flags.offload)
        cfg = with_settings(cfg, node_calibration=pair_prior(prof, flags.target, flags.draft))
    except BaseException:
        close_models(models)
        raise
    return Fitted(flags, opts, models, cfg, tuner, link, prof)


def require_for_run(opts) -> None:
    from specexec_cli.session.deps import BITS_NEED, install_hint, installed, missing_error
    from specexec_cli.session.planning import prequantized

    if opts.dtype == "nf4" and not installed("bitsandbytes"):
        raise missing_error("bitsandbytes", "--dtype nf4")
    for ref in (r for r in (opts.target, opts.draft) if isinstance(r, ModelRef)):  # not self, auto or None
        gguf = ref.format == "gguf"
        if not installed("gguf") and gguf:
            raise missing_error("gguf", f"{ref.flag} {ref.name}: a GGUF checkpoint")
        if not installed("bitsandbytes") and not gguf and prequantized(ref.path):
            raise missing_error("bitsandbytes", f"{ref.flag} {ref.name}: a pre-quantized bitsandbytes checkpoint")
    bits = getattr(opts, "draft_bits", None)
    if opts.draft in ("self", "auto") and bits == 4 and opts.dtype == "nf4":
        hqq = "" if installed("hqq") else f" (they need hqq: {install_hint('hqq')})"
        raise SpecxError(
            "--draft-bits 4: the target is already 4-bit (--dtype nf4), so its 4-bit substitutes would "
            f"be the target itself; fix: --draft-bits 3 or 2{hqq}, the target in 16 bits (--dtype bf16, "
            "or fp32 on a CPU) with --draft-bits 4, or a small --draft DIR"
        )
    if opts.draft in ("self", "auto") and bits is not None and not installed(BITS_NEED[bits]):
        raise missing_error(BITS_NEED[bits], f"--draft-bits {bits}")
