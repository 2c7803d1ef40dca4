"""The shared target converted by llama.cpp's own tools runs through specx like its 16-bit self.

`../shared/models/target` (with a chat template added to its tokenizer_config.json) is written to
GGUF by llama.cpp's convert_hf_to_gguf.py in Q8_0, and to Q4_K_M by llama-quantize (tools/llamacpp.sh
builds both into the test cache; without them, or without ../shared, these tests skip). Through
`specx run`: the greedy ids (`--method ar` all resident, `specexec` with the shared draft on the disk
tier) equal transformers' greedy decoding of the same file (`gguf_file=`), the prompt goes through
the template from the file's metadata and EOS from its metadata stops; the tokens per pass with the
shared draft are within 10% of the 16-bit target's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import SHARED

CACHE = Path(os.environ.get("SPECX_TEST_CACHE", Path.home() / ".cache" / "specx-test")) / "llamacpp"
TARGET, DRAFT = SHARED / "models" / "target", SHARED / "models" / "draft"
TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)
PROMPT = "def parse_args(argv):"

pytestmark = [
    pytest.mark.skipif(not (TARGET / "config.json").is_file(), reason="../shared models missing"),
    pytest.mark.skipif(not (CACHE / "OK").is_file(), reason="llama.cpp tools not built (tools/llamacpp.sh)"),
]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("llamacpp")
    src = root / "target"
    src.mkdir()
    for f in TARGET.iterdir():
        if f.name != "tokenizer_config.json":
            (src / f.name).symlink_to(f)
    tok_cfg = json.loads((TARGET / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps(dict(tok_cfg, chat_template=TEMPLATE)))
    env = dict(os.environ, SPECX_GGUF_PRE="gpt-2")  # the shared tokenizer's hash is not in llama.cpp's list
    out = {}
    for outtype in ("q8_0", "f16"):
        out[outtype] = root / "gguf" / outtype / f"target-{outtype}.gguf"
        out[outtype].parent.mkdir(parents=True)
        subprocess.run(
            [
                sys.executable,
                str(CACHE / "src" / "convert_hf_to_gguf.py"),
                str(src),
                "--outtype",
                outtype,
                "--outfile",
                str(out[outtype]),
            ],
            check=True,
            capture_output=True,
            env=env,
        )
    out["q4_k_m"] = root / "gguf" / "q4_k_m" / "target-q4_k_m.gguf"
    out["q4_k_m"].parent.mkdir(parents=True)
    subprocess.run(
        [str(CACHE / "bin" / "llama-quantize"), str(out["f16"]), str(out["q4_k_m"]), "Q4_K_M"],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(out.pop("f16").parent)
    return out


def _specx(args: list[str], tmp_path: Path, name: str) -> dict:
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    stats = tmp_path / f"{name}.json"
    res = CliRunner().invoke(
        app,
        ["run", "-p", PROMPT, "--device", "cpu", "--temperature", "0", "--no-live", "--stats-json", str(stats), *args],
    )
    assert res.exit_code == 0, res.output
    return json.loads(stats.read_text())


def _hf_greedy(f: Path, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids through the file's template, greedy new ids) as transformers computes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
    model = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    return ids, out[0, len(ids) :].tolist()


@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_greedy_ids_equal_transformers(ggufs, tmp_path, kind):
    f = ggufs[kind]
    n = 24
    prompt_ids, want = _hf_greedy(f, n)
    from offload.formats import open_checkpoint

    ck = open_checkpoint(f)
    assert ck.chat_template == TEMPLATE and ck.generation["eos_token_id"] == 0  # from the file's metadata
    ar = _specx(["--target", str(f), "--method", "ar", "--offload", "none", "--max-new-tokens", str(n)], tmp_path, "ar")
    spec = _specx(
        [
            "--target",
            str(f),
            "--draft",
            str(DRAFT),
            "--method",
            "specexec",
            "--offload",
            "disk",
            "--max-ram",
            "0",
            "--budget",
            "16",
            "--max-new-tokens",
            str(n),
        ],
        tmp_path,
        "spec",
    )
    for rec in (ar, spec):
        got = rec["token_ids"]
        assert got == want[: len(got)] and (len(got) == len(want) or want[len(got) - 1] == 0), (got, want)
    raw_len = len(ck.load_tokenizer()(PROMPT)["input_ids"])
    assert ar["prompt_tokens"] == len(prompt_ids) > raw_len  # the prompt went through the file's template


def test_tokens_per_pass_within_10pct_of_16bit(ggufs, tmp_path):
    """The same prompt, draft and budget: the 4-bit file accepts about as many tokens per pass."""
    common = [
        "--draft",
        str(DRAFT),
        "--method",
        "specexec",
        "--budget",
        "32",
        "--max-new-tokens",
        "40",
        "--offload",
        "none",
        "--no-chat-template",
    ]
    ref = _specx(["--target", str(TARGET), *common], tmp_path, "bf16")["tokens_per_pass"]
    for kind, f in ggufs.items():
        got = _specx(["--target", str(f), *common], tmp_path, kind)["tokens_per_pass"]
        assert abs(got - ref) <= 0.10 * ref, (kind, got, ref)


def test_chat_uses_the_files_template_and_stops(ggufs, tmp_path):
    """`specx chat` on the Q8_0 file: the turn is the template from the metadata around the user's
    text, and the reply equals transformers' greedy continuation of exactly that (EOS stops it)."""
    from typer.testing import CliRunner

    from specexec_cli.terminal.app import app

    f, log = ggufs["q8_0"], tmp_path / "turns.jsonl"
    res = CliRunner().invoke(
        app,
        [
            "chat",
            "--target",
            str(f),
            "--draft",
            str(DRAFT),
            "--device",
            "cpu",
            "--temperature",
            "0",
            "--max-new-tokens",
            "16",
            "--budget",
            "8",
            "--stats-json",
            str(log),
        ],
        input=PROMPT + "\n",
    )
    assert res.exit_code == 0, res.output
    turn = json.loads(log.read_text().splitlines()[0])
    prompt_ids, want = _hf_greedy(f, 16)
    assert turn["prefill_tokens"] == len(prompt_ids)
    got = turn["token_ids"]
    assert got == want[: len(got)] and (len(got) == len(want) or want[len(got) - 1] == 0), (got, want)


def test_gguf_draft(ggufs, tmp_path):
    """--draft may be a GGUF too (the shared draft converted by llama.cpp): decoding stays lossless."""
    draft = tmp_path / "draft" / "draft-q8_0.gguf"
    draft.parent.mkdir()
    subprocess.run(
        [
            sys.executable,
            str(CACHE / "src" / "convert_hf_to_gguf.py"),
            str(DRAFT),
            "--outtype",
            "q8_0",
            "--outfile",
            str(draft),
        ],
        check=True,
        capture_output=True,
        env=dict(os.environ, SPECX_GGUF_PRE="gpt-2"),
    )
    f = ggufs["q8_0"]
    _, want = _hf_greedy(f, 16)
    rec = _specx(
        ["--target", str(f), "--draft", str(draft), "--method", "specexec", "--budget", "16", "--max-new-tokens", "16"],
        tmp_path,
        "gguf-draft",
    )
    got = rec["token_ids"]
    assert got == want[: len(got)] and rec["tokens_per_pass"] > 1.0, (got, want)
