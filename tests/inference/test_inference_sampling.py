"""Unit tests of the sampling rules on hand-made distributions."""
from __future__ import annotations

import math

import pytest
import torch

from inference.sampling import SamplingParams, sample_next, top_k_filter, top_p_filter

# Probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled vocab order (ids 2, 0, 3, 1).
PROBS = torch.tensor([[0.3, 0.05, 0.5, 0.15]])
LOGITS = PROBS.log()


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


@pytest.mark.parametrize("p,expected", [
    (0.5, {2}),  # 0.5 >= 0.5 already: only the top token
    (0.3, {2}),  # the top token is always kept
    (0.8, {2, 0}),  # 0.5 + 0.3 = 0.8
    (0.81, {2, 0, 3}),  # needs the 0.15 token too
    (0.96, {2, 0, 3, 1}),
    (1.0, {2, 0, 3, 1}),
])
def test_top_p_keeps_the_smallest_nucleus(p, expected):
    assert kept(top_p_filter(LOGITS, p)) == expected


def test_top_p_leaves_kept_logits_unchanged():
    out = top_p_filter(LOGITS, 0.8)
    assert torch.equal(out[0, [2, 0]], LOGITS[0, [2, 0]])


@pytest.mark.parametrize("k,expected", [(1, {2}), (2, {2, 0}), (0, {0, 1, 2, 3}), (10, {0, 1, 2, 3})])
def test_top_k(k, expected):
    assert kept(top_k_filter(LOGITS, k)) == expected


def test_greedy_picks_argmax_with_full_vocab_logprob():
    tokens, logprobs = sample_next(LOGITS, SamplingParams(temperature=0.0), None)
    assert tokens.tolist() == [2] and logprobs.item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_sampled_logprob_is_before_truncation():
    """With top_p the token is drawn from the nucleus, but its logprob is over the full vocab."""
    params = SamplingParams(temperature=1.0, top_p=0.5)
    tokens, logprobs = sample_next(LOGITS, params, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [2] and logprobs.item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_temperature_scales_the_logprob():
    params = SamplingParams(temperature=2.0, top_k=1)
    _, logprobs = sample_next(LOGITS, params, None)
    expected = (LOGITS / 2.0).log_softmax(-1)[0, 2].item()
    assert logprobs.item() == pytest.approx(expected, abs=1e-6)


def test_sampling_frequencies_follow_the_nucleus():
    logits = LOGITS.expand(4000, -1)
    tokens, _ = sample_next(logits, SamplingParams(top_p=0.8), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=4).float() / len(tokens)
    # Renormalised nucleus {2: 0.5, 0: 0.3} -> 0.625 / 0.375; ids 1 and 3 never drawn.
    assert counts[1] == 0 and counts[3] == 0
    assert counts[2].item() == pytest.approx(0.625, abs=0.03)


@pytest.mark.parametrize("bad", [
    dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1),
    dict(stop_sequences=((),)),
])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
