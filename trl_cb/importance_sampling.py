"""Importance-sampling (IS) correction between the CB sampler and the training policy.

For every completion token t, `log w_t = log pi_old(y_t) - log mu(y_t)`, both `log_softmax(logits / T)` over the
whole vocabulary: `pi_old` from the trainer's forward, `mu` from the sampler's own logits when it sampled y_t (the
design and why not the processed logprob: docs/index.md, "Importance-sampling correction"). Modes (TRL's semantics):
`token_*` one ratio per token, `sequence_*` one per sequence (exp of the summed log-ratios); `*_truncate` clamps to
[clip_min, clip_max], `*_mask` zeroes ratios outside the bounds. Tokens whose sampling logprob is NaN get ratio 1.

`ImportanceSamplingStats` are mergeable: the stats of a batch's row splits, merged, are the batch's, so metrics logged
per generation batch match TRL's whatever the micro-batching (`IS_METRIC_NAMES`, in `local_values` order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


#: TRL's metric names for the IS correction, in the order `ImportanceSamplingStats.local_values` returns them.
IS_METRIC_NAMES = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


@dataclass
class ImportanceSamplingStats:
    """Per-process sums, counts and extrema of the weights (over counted tokens, or sequences for `sequence_*`
    modes) and of |log pi_old - log mu| (over counted tokens whose sampling logprob is not NaN).

    Mergeable: the stats of the micro-batches of one generation batch, merged, equal the stats of the whole batch,
    so the logged values are TRL's (which computes them once per generation batch) whatever the micro-batching."""

    ratio_sum: torch.Tensor
    ratio_count: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    diff_sum: torch.Tensor
    diff_count: torch.Tensor
    diff_max: torch.Tensor

    def merge(self, other: ImportanceSamplingStats) -> ImportanceSamplingStats:
        return ImportanceSamplingStats(
            ratio_sum=self.ratio_sum + other.ratio_sum,
            ratio_count=self.ratio_count + other.ratio_count,
            ratio_min=torch.minimum(self.ratio_min, other.ratio_min),
            ratio_max=torch.maximum(self.ratio_max, other.ratio_max),
            diff_sum=self.diff_sum + other.diff_sum,
            diff_count=self.diff_count + other.diff_count,
            diff_max=torch.maximum(self.diff_max, other.diff_max),
        )

    def local_values(self) -> torch.Tensor:
        """(5,) fp32 in `IS_METRIC_NAMES` order; 0 for a quantity with nothing counted (as TRL logs it)."""
        zero = torch.zeros((), device=self.ratio_sum.device)
        has_ratio, has_diff = self.ratio_count > 0, self.diff_count > 0
        return torch.stack(
            [
                torch.where(has_diff, self.diff_sum / self.diff_count.clamp(min=1), zero),
                torch.where(has_diff, self.diff_max, zero),
                torch.where(has_ratio, self.ratio_min, zero),
                torch.where(has_ratio, self.ratio_sum / self.ratio_count.clamp(min=1), zero),
                torch.where(has_ratio, self.ratio_max, zero),
            ]
        ).float()


def validate_mode(mode: str, clip_min: float | None, clip_max: float | None) -> None:
    """`ValueError` for an unknown mode or unusable bounds."""
    if mode not in IS_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}; choose one of {IS_MODES}.")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"IS clip_min ({clip_min}) must be smaller than clip_max ({clip_max}).")
    if mode.endswith("_truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"IS mode {mode!r} needs clip_min or clip_max (or both).")


def importance_sampling_ratio(
    old_logps: torch.Tensor,  # (B, T) training-policy logprobs of the sampled tokens
    sampling_logps: torch.Tensor,  # (B, T) behaviour logprobs recorded by the sampler
    mask: torch.Tensor,  # (B, T) 1 for completion tokens that count
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """IS weights: (B, T) for `token_*` modes, (B, 1) for `sequence_*` modes (see module docstring)."""
    validate_mode(mode, clip_min, clip_max)
    log_ratio = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)  # (B, T)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
    ratio = torch.exp(log_ratio)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def importance_sampling_stats(
    ratio: torch.Tensor, old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor
) -> ImportanceSamplingStats:
    """Stats of one batch: weights over counted tokens (all sequences for `sequence_*` ratios of shape (B, 1)),
    |log pi_old - log mu| over counted tokens whose difference is not NaN."""
    keep = mask.bool()
    flat = (ratio.flatten() if ratio.shape[-1] == 1 else ratio[keep]).float()
    delta = torch.abs(old_logps - sampling_logps)[keep].float()
    delta = delta[~torch.isnan(delta)]
    inf = torch.tensor(math.inf, device=ratio.device)

    def extreme(t: torch.Tensor, fn: str, empty: torch.Tensor) -> torch.Tensor:
        return getattr(t, fn)() if t.numel() else empty

    return ImportanceSamplingStats(
        ratio_sum=flat.sum(),
        ratio_count=torch.tensor(flat.numel(), device=ratio.device, dtype=torch.float32),
        ratio_min=extreme(flat, "min", inf),
        ratio_max=extreme(flat, "max", -inf),
        diff_sum=delta.sum(),
        diff_count=torch.tensor(delta.numel(), device=ratio.device, dtype=torch.float32),
        diff_max=extreme(delta, "max", -inf),
    )
