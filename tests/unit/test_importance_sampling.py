"""IS weights per mode, against the formulas in trl_cb/importance_sampling.py's docstring."""

from __future__ import annotations

import math

import pytest
import torch

from trl_cb.importance_sampling import (
    IS_EXTRA_METRIC_NAMES,
    IS_METRIC_NAMES,
    importance_sampling_ratio,
    importance_sampling_stats,
    importance_weights,
    reduce_extra_values,
)

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


# ------------------------------------------------------------------------------ off-policy modes (async samples)
# Counted tokens' log-ratios: row 0 [0.5, -1, 0] (mean -1/6), row 1 [0.2, -0.6] (mean -0.2); squares
# [0.25, 1, 0] and [0.04, 0.36].


def test_geometric_modes_use_the_mean_token_log_ratio():
    """Control: the product (`sequence_*`) of row 0 is exp(-0.5) = 0.61, below the bound that the geometric mean
    exp(-1/6) = 0.85 clears: the two modes give different weights here."""
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "geometric_truncate", 0.83, None)
    assert r.shape == (2, 1)
    assert math.isclose(r[0, 0].item(), math.exp(-1 / 6), rel_tol=1e-6)
    assert math.isclose(r[1, 0].item(), 0.83, rel_tol=1e-6)  # exp(-0.2) = 0.819 clamped up
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "geometric_mask", 0.83, 3.0)
    assert math.isclose(r[0, 0].item(), math.exp(-1 / 6), rel_tol=1e-6) and r[1, 0] == 0
    product = importance_sampling_ratio(OLD, SAMPLING, MASK, "sequence_mask", 0.83, 3.0)
    assert product[0, 0] == 0  # the control


def test_token_m2_masks_largest_squared_log_ratios_until_the_second_moment_is_within_bounds():
    """Ascending squares 0, 0.04, 0.25, 0.36, 1 have running means 0, 0.02, 0.097, 0.163, 0.33: tau = 0.1 keeps the
    first three and masks the tokens with log-ratios -0.6 and -1; tau = 0.2 masks only -1; tau = 0.5 nothing."""
    e = torch.exp(LOG_R)
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_m2", None, None, m2_threshold=0.1)
    expected = e.clone()
    expected[0, 1] = expected[1, 1] = 0.0
    torch.testing.assert_close(r * MASK, expected * MASK)
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_m2", None, None, m2_threshold=0.2)
    assert r[0, 1] == 0 and r[1, 1] > 0
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_m2", None, None, m2_threshold=0.5)
    torch.testing.assert_close(r * MASK, e * MASK)
    clipped = importance_sampling_ratio(OLD, SAMPLING, MASK, "token_m2", None, 1.5, m2_threshold=0.5)
    assert math.isclose(clipped[0, 0].item(), 1.5)  # exp(0.5) = 1.65, kept and truncated at clip_max


def test_geometric_m2_masks_whole_sequences():
    """Mean squares per sequence: row 0 1.25/3 = 0.417, row 1 0.4/2 = 0.2; with both the token mean is 1.65/5 = 0.33.
    tau = 0.25 keeps row 1 only, tau = 0.4 keeps both (the bound is on tokens, not on the sequences' means)."""
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "geometric_m2", None, None, m2_threshold=0.25)
    assert r[0, 0] == 0 and math.isclose(r[1, 0].item(), math.exp(-0.2), rel_tol=1e-6)
    r = importance_sampling_ratio(OLD, SAMPLING, MASK, "geometric_m2", None, None, m2_threshold=0.4)
    assert math.isclose(r[0, 0].item(), math.exp(-1 / 6), rel_tol=1e-6)


def test_m2_never_masks_a_row_without_counted_tokens_and_ties_keep_an_exact_count():
    mask = MASK.clone()
    mask[1] = 0.0
    r = importance_sampling_ratio(OLD, SAMPLING, mask, "geometric_m2", None, None, m2_threshold=0.01)
    assert r[0, 0] == 0 and r[1, 0] == 1.0  # row 1 counts nothing: weight exp(0), never masked
    tied = torch.tensor([[0.3, -0.3, 0.3, -0.3]])
    r = importance_sampling_ratio(tied, torch.zeros_like(tied), torch.ones_like(tied), "token_m2", None, None, 0.09)
    assert (r > 0).sum() == 4  # all equal to tau: nothing masked
    r = importance_sampling_ratio(tied, torch.zeros_like(tied), torch.ones_like(tied), "token_m2", None, None, 0.089)
    assert (r > 0).sum() == 0


def _extra(stats) -> dict[str, float]:
    return dict(zip(IS_EXTRA_METRIC_NAMES, stats.extra_values().tolist(), strict=True))


def test_extra_stats_raw_ratio_and_corrected_fractions():
    """token_mask [0.5, 1.5]: tokens exp(0.5) = 1.65 and exp(-1) = 0.37 are masked: 2 of 5 tokens, 1 of 2 sequences;
    the raw mean is over all 5 counted tokens before masking."""
    w = importance_weights(OLD, SAMPLING, MASK, "token_mask", 0.5, 1.5)
    v = _extra(importance_sampling_stats(w.weight, OLD, SAMPLING, MASK, w))
    raw = torch.exp(LOG_R)[MASK.bool()]
    assert math.isclose(v["sampling/importance_sampling_raw_ratio/mean"], raw.mean().item(), rel_tol=1e-6)
    assert math.isclose(v["sampling/importance_sampling_raw_ratio/max"], math.exp(0.5), rel_tol=1e-6)
    assert math.isclose(v["sampling/importance_sampling_raw_ratio/min"], math.exp(-1), rel_tol=1e-6)
    assert v["sampling/importance_sampling_corrected/token_fraction"] == pytest.approx(2 / 5)
    assert v["sampling/importance_sampling_corrected/sequence_fraction"] == pytest.approx(1 / 2)
    # sequence level: row 0's weight exp(-0.5) is masked below 0.65, so its 3 tokens of 5 count as corrected
    w = importance_weights(OLD, SAMPLING, MASK, "sequence_mask", 0.65, 3.0)
    v = _extra(importance_sampling_stats(w.weight, OLD, SAMPLING, MASK, w))
    assert v["sampling/importance_sampling_corrected/token_fraction"] == pytest.approx(3 / 5)
    assert v["sampling/importance_sampling_corrected/sequence_fraction"] == pytest.approx(1 / 2)
    assert math.isclose(
        v["sampling/importance_sampling_raw_ratio/mean"], (math.exp(-0.5) + math.exp(-0.4)) / 2, rel_tol=1e-6
    )
    nothing = importance_weights(OLD, SAMPLING, MASK, "token_truncate", None, 100.0)
    v = _extra(importance_sampling_stats(nothing.weight, OLD, SAMPLING, MASK, nothing))
    assert v["sampling/importance_sampling_corrected/token_fraction"] == 0.0


@pytest.mark.parametrize("mode", ["token_mask", "geometric_truncate"])
def test_extra_stats_merge_and_reduce_across_processes_exactly(mode):
    """Split rows (micro-batches) merged, and per-process sums reduced, both equal the whole batch's values."""
    w = importance_weights(OLD, SAMPLING, MASK, mode, 0.5, 1.5)
    whole = importance_sampling_stats(w.weight, OLD, SAMPLING, MASK, w)
    parts = []
    for i in (0, 1):
        wi = importance_weights(OLD[i : i + 1], SAMPLING[i : i + 1], MASK[i : i + 1], mode, 0.5, 1.5)
        parts.append(importance_sampling_stats(wi.weight, OLD[i : i + 1], SAMPLING[i : i + 1], MASK[i : i + 1], wi))
    torch.testing.assert_close(parts[0].merge(parts[1]).extra_values(), whole.extra_values())
    gathered = torch.stack([p.reduction_sums() for p in parts])
    torch.testing.assert_close(reduce_extra_values(gathered), whole.extra_values())


@pytest.mark.parametrize("mode", ["token_truncate", "geometric_truncate", "sequence_mask"])
def test_self_normalized_weights_average_one_over_counted_units(mode):
    """Counted tokens (token level) or sequences (sequence level) average 1; padding is not counted; the raw weights
    and what the mode changed are those before normalising. Control: unnormalised, the mean is not 1 here."""
    plain = importance_weights(OLD, SAMPLING, MASK, mode, 0.5, 1.5)
    w = importance_weights(OLD, SAMPLING, MASK, mode, 0.5, 1.5, normalize=True)
    units = MASK.bool() if mode.startswith("token") else torch.ones(2, 1, dtype=torch.bool)
    assert not math.isclose(plain.weight[units].mean().item(), 1.0, rel_tol=1e-3)  # the control
    assert math.isclose(w.weight[units].mean().item(), 1.0, rel_tol=1e-6)
    torch.testing.assert_close(w.weight, plain.weight / plain.weight[units].mean())
    torch.testing.assert_close(w.raw, plain.raw)
    assert torch.equal(w.changed, plain.changed)


def test_self_normalized_all_masked_batch_stays_zero():
    w = importance_weights(OLD, SAMPLING, MASK, "sequence_mask", 5.0, 6.0, normalize=True)  # every weight < 5
    assert torch.equal(w.weight, torch.zeros_like(w.weight))
