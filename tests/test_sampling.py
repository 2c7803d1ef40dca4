"""Pure sampling functions: top-k, true nucleus top-p, greedy, generator determinism."""

import pytest
import torch

from specexec_cli.core.sampling import SamplingParams, process_logits, top_p_filter, validate


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.allclose(top_p_filter(probs, 0.8), torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    # mass 0.5 < 0.6, so the second token is needed too
    assert torch.allclose(top_p_filter(probs, 0.6), torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    assert torch.allclose(top_p_filter(probs, 0.5), torch.tensor([1.0, 0, 0, 0]))
    assert torch.allclose(top_p_filter(probs, 0.81), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)


def test_top_p_is_order_independent():
    probs = torch.tensor([0.05, 0.3, 0.5, 0.15])
    assert torch.allclose(top_p_filter(probs, 0.8), torch.tensor([0, 0.3, 0.5, 0]) / 0.8)


def test_top_k_then_temperature():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    p = process_logits(logits, SamplingParams(temperature=2.0, top_k=2))
    expected = torch.softmax(torch.tensor([3.0, 2.0]) / 2.0, -1)
    assert torch.allclose(p, torch.tensor([0, expected[0], expected[1], 0]))


def test_greedy_is_one_hot_argmax():
    p = process_logits(torch.tensor([0.1, 5.0, 2.0]), SamplingParams(0.0))
    assert p.tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(-1.0),
        SamplingParams(1.0, top_p=0.0),
        SamplingParams(1.0, top_p=1.5),
        SamplingParams(1.0, top_k=-2),
    ],
)
def test_validate_rejects_out_of_range(params):
    with pytest.raises(ValueError):
        validate(params)
