"""Importance-sampling (IS) correction between the CB sampler and the training policy.

What is compared: for every completion token t,

    log w_t = log pi_old(y_t | x, y_<t) - log mu(y_t | x, y_<t)

- `pi_old` is TRL's training logprob: the trainer's model, logits divided by `temperature`, log-softmax over the
  *whole* vocabulary (no top-k/top-p renormalisation), computed in a no-grad forward after generation.
- `mu` is the behaviour policy: the logprob the CB engine recorded when it sampled y_t — log-softmax of the
  *processed* logits (temperature, then top-k/top-p filtering and renormalisation), fp32.

With top-k = 0 and top-p = 1 the two differ only by numerics (kernels, dtype, batch shape): w ~ 1. With truncated
sampling mu puts all its mass on the kept tokens, so log mu >= log pi and w <= 1: IS then reweights the samples
towards the untruncated policy being trained. Modes (TRL's semantics, applied to the CB path):

- `token_*`: one ratio per token; `sequence_*`: one per sequence, exp of the summed log-ratios.
- `*_truncate`: clamp to [clip_min, clip_max]; `*_mask`: ratios outside the bounds become 0 (sample ignored).

Tokens whose sampling logprob is NaN get ratio 1 (no correction), never NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class ImportanceSamplingStats:
    """Per-process statistics over completion tokens (sequences for `sequence_*` modes)."""

    ratio_min: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    logp_diff_mean: torch.Tensor
    logp_diff_max: torch.Tensor


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
    """Min/mean/max of the weights and mean/max |log pi_old - log mu| over counted tokens (0 when there are none)."""
    keep = mask.bool()
    flat = ratio.flatten() if ratio.shape[-1] == 1 else ratio[keep]
    delta = torch.abs(old_logps - sampling_logps)[keep]
    delta = delta[~torch.isnan(delta)]
    zero = torch.zeros((), device=ratio.device)

    def reduce(t: torch.Tensor, fn: str) -> torch.Tensor:
        return getattr(t, fn)() if t.numel() else zero

    return ImportanceSamplingStats(
        ratio_min=reduce(flat, "min"),
        ratio_mean=reduce(flat, "mean"),
        ratio_max=reduce(flat, "max"),
        logp_diff_mean=reduce(delta, "mean"),
        logp_diff_max=reduce(delta, "max"),
    )
