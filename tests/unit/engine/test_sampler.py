"""The engine's sampler (`engine/sampler.py`) draws from the processed probabilities, exactly: a chi-square test of
its draws against the probabilities at several temperature / top_k / top_p settings, with a biased sampler as the
control, and the engine samples with it (`_upstream_sampling.race_sample`, composed by `_upstream_patches`)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.conftest import sampling_config
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import _upstream_sampling, sampler

DRAWS = 40_000
VOCAB = 12
SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 0, 0.9),
    (1.3, 5, 1.0),
    (0.5, 8, 0.8),
]


def _processed_probs(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """(VOCAB,) probabilities after transformers' own warpers, from fixed random logits."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(7)) * 1.5
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return torch.softmax(warpers(torch.zeros(1, 1, dtype=torch.long), logits), dim=-1)[0]


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit over the tokens with positive probability; p-value from the regularised
    upper incomplete gamma function (df = categories - 1)."""
    support = probs > 0
    expected = probs[support].double() * counts.sum()
    observed = counts[support].double()
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


def _draw(sample, probs: torch.Tensor, seed: int) -> torch.Tensor:
    rows = probs.log().expand(DRAWS, VOCAB).contiguous()  # one draw per row, as an engine step samples
    tokens, logprobs = sample(rows, torch.Generator().manual_seed(seed))
    assert tokens.shape == (DRAWS,) and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, probs.log()[tokens], rtol=0, atol=1e-6)  # the same probabilities
    return torch.bincount(tokens, minlength=VOCAB)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_exponential_race_follows_the_processed_probabilities(temperature, top_k, top_p):
    probs = _processed_probs(temperature, top_k, top_p)
    for seed in (0, 1):
        counts = _draw(sampler.sample_with_logprobs, probs, seed)
        assert counts[probs == 0].sum() == 0, "a token outside top_k / top_p was sampled"
        assert _chi_square_p_value(counts, probs) > 1e-3


def _biased_race(scores: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Control: the race over slightly sharpened probabilities (p^1.1), logprobs from the true ones."""
    probs = torch.softmax(scores, dim=-1)
    tokens = sampler.exponential_race(probs**1.1, generator)
    return tokens, probs.gather(1, tokens[:, None]).squeeze(1).log()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_control_a_biased_sampler_fails_the_test(temperature, top_k, top_p):
    probs = _processed_probs(temperature, top_k, top_p)
    counts = _draw(_biased_race, probs, 0)
    assert _chi_square_p_value(counts, probs) < 1e-6


def test_race_is_reproducible_under_a_seed_and_never_picks_a_zero():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]).repeat(1000, 1)
    torch.manual_seed(3)
    first = sampler.exponential_race(probs)
    torch.manual_seed(3)  # the default generator, as `torch.multinomial` uses
    assert torch.equal(sampler.exponential_race(probs), first)
    assert (first[0::2] == 1).all() and (first[1::2] != 1).all()
    assert set(first[1::2].tolist()) == {0, 2}


def _engine_sample_calls(model, tokenizer, prompts, monkeypatch) -> int:
    calls = []
    race = sampler.exponential_race
    monkeypatch.setattr(sampler, "exponential_race", lambda *a: calls.append(1) or race(*a))
    with ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=4)) as gen:
        out = gen.generate([prompts[0][:20]], num_generations=3)
    assert [len(c) for c in out.completion_ids] == [4, 4, 4] or all(out.completion_ids)
    return len(calls)


def test_the_engine_samples_with_the_race_unless_told_otherwise(model, tokenizer, prompts, monkeypatch):
    assert _engine_sample_calls(model, tokenizer, prompts, monkeypatch) >= 4
    monkeypatch.setattr(_upstream_sampling, "race_sampler_fits", lambda manager: False)  # control: upstream's
    assert _engine_sample_calls(model, tokenizer, prompts, monkeypatch) == 0
