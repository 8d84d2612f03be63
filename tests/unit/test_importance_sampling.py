"""IS weights per mode, against the formulas in trl_cb/importance_sampling.py's docstring."""

from __future__ import annotations

import math

import pytest
import torch

from trl_cb.importance_sampling import IS_METRIC_NAMES, importance_sampling_ratio, importance_sampling_stats

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
SAMPLING = torch.tensor([[-1.5, -1.0, -0.5], [-1.2, -0.4, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
LOG_R = (OLD - SAMPLING) * MASK  # [[0.5, -1, 0], [0.2, -0.6, 0]]


def test_token_truncate():
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_truncate", None, 1.5)
    expected = torch.exp(LOG_R).clamp(max=1.5)
    assert r.shape == (2, 3) and torch.allclose(r, expected)


def test_token_mask():
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_mask", 0.5, 1.5)
    e = torch.exp(LOG_R)
    assert torch.allclose(r, torch.where((e < 0.5) | (e > 1.5), torch.zeros_like(e), e))
    assert r[0, 1] == 0 and r[0, 0] == 0  # exp(-1) < 0.5, exp(0.5) > 1.5


def test_sequence_modes():
    seq = torch.exp(LOG_R.sum(-1, keepdim=True))  # exp(-0.5), exp(-0.4)
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "sequence_truncate", 0.65, None)
    assert r.shape == (2, 1) and torch.allclose(r, seq.clamp(min=0.65))
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "sequence_mask", 0.65, 3.0)
    assert r[0, 0] == 0 and math.isclose(r[1, 0].item(), math.exp(-0.4), rel_tol=1e-6)


def test_nan_sampling_logprob_means_no_correction():
    sampling = SAMPLING.clone()
    sampling[0, 0] = float("nan")
    r = importance_sampling_ratio(OLD, sampling, MASK, "token_truncate", None, 10.0)
    assert r[0, 0] == 1.0 and not torch.isnan(r).any()


def test_padding_never_counts():
    sampling = SAMPLING.clone()
    sampling[1, 2] = -50.0  # garbage in a padded slot
    r = importance_sampling_ratio(OLD, sampling, MASK, "sequence_truncate", None, 100.0)
    assert math.isclose(r[1, 0].item(), math.exp(-0.4), rel_tol=1e-6)


def _values(stats) -> dict[str, float]:
    return dict(zip(IS_METRIC_NAMES, stats.local_values().tolist(), strict=True))


def test_stats():
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_truncate", None, 100.0)
    v = _values(importance_sampling_stats(r, OLD, SAMPLING, MASK))
    kept = torch.exp(LOG_R)[MASK.bool()]
    assert math.isclose(v["sampling/importance_sampling_ratio/min"], kept.min().item(), rel_tol=1e-6)
    assert math.isclose(v["sampling/importance_sampling_ratio/max"], kept.max().item(), rel_tol=1e-6)
    assert math.isclose(v["sampling/importance_sampling_ratio/mean"], kept.mean().item(), rel_tol=1e-6)
    assert math.isclose(v["sampling/sampling_logp_difference/max"], 1.0, rel_tol=1e-6)
    assert math.isclose(v["sampling/sampling_logp_difference/mean"], (0.5 + 1 + 0 + 0.2 + 0.6) / 5, rel_tol=1e-6)
    empty = _values(importance_sampling_stats(r, OLD, SAMPLING, torch.zeros_like(MASK)))
    assert all(value == 0.0 for value in empty.values()), empty


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_stats_merged_over_row_splits_equal_the_whole_batch(mode):
    """What the deferred IS correction relies on: per-micro-batch stats, merged, are the whole batch's (min of
    minima, not the mean of minima). Control: averaging the parts' values (the old logging) differs here."""
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, mode, None, 100.0)
    whole = importance_sampling_stats(r, OLD, SAMPLING, MASK).local_values()
    parts = [
        importance_sampling_stats(r[i : i + 1], OLD[i : i + 1], SAMPLING[i : i + 1], MASK[i : i + 1]) for i in (0, 1)
    ]
    merged = parts[0].merge(parts[1]).local_values()
    torch.testing.assert_close(merged, whole)
    averaged = torch.stack([p.local_values() for p in parts]).mean(0)
    assert not torch.allclose(averaged, whole), "control: averaging per-part values is not the batch's value"


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_unknown_or_unbounded_mode_rejected(mode):
    with pytest.raises(ValueError):
        importance_sampling_ratio(OLD, SAMPLING, MASK, mode, None, None)
