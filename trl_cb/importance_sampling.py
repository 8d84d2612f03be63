"""Importance-sampling (IS) correction between the CB sampler and the training policy.

For every completion token t, `log r_t = log pi_old(y_t) - log mu(y_t)`, both `log_softmax(logits / T)` over the
whole vocabulary: `pi_old` from the trainer's forward, `mu` from the sampler's own logits when it sampled y_t
(docs/index.md, "Importance-sampling correction"). NaN sampling logprobs give `log r_t = 0`; padding never counts.
Modes (`IS_MODES`): TRL's `token_*` / `sequence_*` (per token / product per sequence), and for stale async samples
`geometric_*` (per sequence, geometric mean of the token ratios) and `*_m2` (M2PO second-moment masks); each mode's
formula is in `importance_weights`. Why the off-policy modes, and the measurements: docs/async.md.

Invariants: `weight >= 0`; `ImportanceWeights` keeps the raw (pre-truncation) weight and the units the mode changed;
`ImportanceSamplingStats` are mergeable (a batch's row splits, merged, give the batch's stats, so metrics logged per
generation batch match TRL's whatever the micro-batching: `IS_METRIC_NAMES`), and trl_cb's off-policy diagnostics
(`IS_EXTRA_METRIC_NAMES`) are reduced exactly across processes from sums and extrema.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

IS_MODES = (
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "geometric_truncate",
    "geometric_mask",
    "token_m2",
    "geometric_m2",
)
#: Modes with one weight per token; every other mode has one weight per sequence.
TOKEN_LEVEL_MODES = ("token_truncate", "token_mask", "token_m2")
#: M2PO's second-moment bound on the token log-ratios (its paper's tau).
DEFAULT_M2_THRESHOLD = 0.04


#: TRL's metric names for the IS correction, in the order `ImportanceSamplingStats.local_values` returns them.
IS_METRIC_NAMES = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
#: trl_cb's off-policy diagnostics, in the order `ImportanceSamplingStats.extra_values` returns them: the raw weight
#: (before truncation or masking, over the mode's units) and the share of counted tokens / sequences whose weight the
#: mode changed (truncated, or masked to 0).
IS_EXTRA_METRIC_NAMES = (
    "sampling/importance_sampling_raw_ratio/min",
    "sampling/importance_sampling_raw_ratio/mean",
    "sampling/importance_sampling_raw_ratio/max",
    "sampling/importance_sampling_corrected/token_fraction",
    "sampling/importance_sampling_corrected/sequence_fraction",
)


def is_token_level(mode: str) -> bool:
    """Whether `mode` gives one weight per token ((B, T)) rather than one per sequence ((B, 1))."""
    return mode in TOKEN_LEVEL_MODES


@dataclass
class ImportanceWeights:
    """The weights of one batch: `weight` (what the loss uses), `raw` (before truncation/masking) and `changed` (the
    units whose weight the mode changed), all (B, T) for token-level modes and (B, 1) for sequence-level ones."""

    weight: torch.Tensor
    raw: torch.Tensor
    changed: torch.Tensor


@dataclass
class ImportanceSamplingStats:
    """Per-process sums, counts and extrema of the weights (over counted tokens, or sequences for sequence-level
    modes), of |log pi_old - log mu| (over counted tokens whose sampling logprob is not NaN), of the raw weights, and
    the counts of tokens and sequences the mode changed.

    Mergeable: the stats of the micro-batches of one generation batch, merged, equal the stats of the whole batch,
    so the logged values are TRL's (which computes them once per generation batch) whatever the micro-batching."""

    ratio_sum: torch.Tensor
    ratio_count: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    diff_sum: torch.Tensor
    diff_count: torch.Tensor
    diff_max: torch.Tensor
    raw_sum: torch.Tensor
    raw_min: torch.Tensor
    raw_max: torch.Tensor
    changed_tokens: torch.Tensor
    token_count: torch.Tensor
    changed_sequences: torch.Tensor
    sequence_count: torch.Tensor

    def merge(self, other: ImportanceSamplingStats) -> ImportanceSamplingStats:
        def combine(name: str) -> torch.Tensor:
            a, b = getattr(self, name), getattr(other, name)
            if name.endswith("_min"):
                return torch.minimum(a, b)
            if name.endswith("_max"):
                return torch.maximum(a, b)
            return a + b

        return ImportanceSamplingStats(**{f.name: combine(f.name) for f in fields(self)})

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

    def reduction_sums(self) -> torch.Tensor:
        """(8,) fp32: what `extra_values` needs from each process, to be gathered and reduced by
        `reduce_extra_values` (sums add, extrema take their extremum): exact across processes."""
        return torch.stack(
            [
                self.raw_sum,
                self.ratio_count,
                self.raw_min,
                self.raw_max,
                self.changed_tokens,
                self.token_count,
                self.changed_sequences,
                self.sequence_count,
            ]
        ).float()

    def extra_values(self) -> torch.Tensor:
        """(5,) fp32 in `IS_EXTRA_METRIC_NAMES` order, for this process alone."""
        return reduce_extra_values(self.reduction_sums()[None])


def reduce_extra_values(gathered: torch.Tensor) -> torch.Tensor:
    """`IS_EXTRA_METRIC_NAMES` values from the (P, 8) `reduction_sums` of P processes; 0 where nothing counted."""
    raw_sum, count, raw_min, raw_max, changed_tok, tokens, changed_seq, seqs = gathered.unbind(dim=1)
    zero = torch.zeros((), device=gathered.device)
    n, n_tok, n_seq = count.sum(), tokens.sum(), seqs.sum()
    return torch.stack(
        [
            torch.where(n > 0, raw_min.min(), zero),
            torch.where(n > 0, raw_sum.sum() / n.clamp(min=1), zero),
            torch.where(n > 0, raw_max.max(), zero),
            torch.where(n_tok > 0, changed_tok.sum() / n_tok.clamp(min=1), zero),
            torch.where(n_seq > 0, changed_seq.sum() / n_seq.clamp(min=1), zero),
        ]
    ).float()


def validate_mode(
    mode: str, clip_min: float | None, clip_max: float | None, m2_threshold: float | None = None
) -> None:
    """`ValueError` for an unknown mode or unusable bounds."""
    if mode not in IS_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}; choose one of {IS_MODES}.")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"IS clip_min ({clip_min}) must be smaller than clip_max ({clip_max}).")
    if mode.endswith("_truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"IS mode {mode!r} needs clip_min or clip_max (or both).")
    if m2_threshold is not None and not (m2_threshold > 0 and math.isfinite(m2_threshold)):
        raise ValueError(f"IS m2_threshold must be a finite number > 0, got {m2_threshold}.")


def importance_weights(
    old_logps: torch.Tensor,  # (B, T) training-policy logprobs of the sampled tokens
    sampling_logps: torch.Tensor,  # (B, T) behaviour logprobs recorded by the sampler
    mask: torch.Tensor,  # (B, T) 1 for completion tokens that count
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
    m2_threshold: float = DEFAULT_M2_THRESHOLD,
    normalize: bool = False,
) -> ImportanceWeights:
    """The IS weights of `mode` with their raw values and the units the mode changed.

    - `token_truncate` / `token_mask`: `r_t`, clamped to / zeroed outside [clip_min, clip_max] (TRL's).
    - `sequence_truncate` / `sequence_mask`: `exp(sum_t log r_t)`, clamped / zeroed (TRL's). For stale samples the
      product of 24-256 token ratios is heavy-tailed, and a mask on it drops the sequences the policy now prefers.
    - `geometric_truncate` / `geometric_mask`: `exp(mean_t log r_t)` per sequence (verl's geometric mode: length
      normalised), clamped / zeroed. Sequence level, so RLOO can use it.
    - `token_m2` / `geometric_m2` (M2PO): units (tokens; or sequences, ranked by their mean squared token log-ratio)
      are masked, largest `(log r)^2` first, until the mean `(log r_t)^2` of the counted tokens left is at most
      `m2_threshold`; kept units keep their weight (`r_t`, or the geometric mean), clamped at `clip_max` when set. The
      mask is computed over the tokens given at once (a micro-batch when the correction is deferred to the loss).
    `normalize=True` then divides the weights by their mean over the counted units (self-normalised IS; the mean is
    over what is given at once, like the M2 mask).
    AReaL's decoupled objective needs no mode of its own: TRL's old-policy logprobs come from the current weights, so
    they are its proximal policy, TRL's clip is relative to them, and `token_mask` with `clip_max=5` is its
    behaviour-weight rejection (`token_truncate` its truncated variant).
    """
    validate_mode(mode, clip_min, clip_max, m2_threshold)
    keep = mask.bool()
    token_log_ratio = torch.nan_to_num((old_logps - sampling_logps).masked_fill(~keep, 0.0), nan=0.0)  # (B, T)
    log_ratio = token_log_ratio
    if mode.startswith("sequence"):
        log_ratio = token_log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
    elif mode.startswith("geometric"):
        log_ratio = token_log_ratio.sum(dim=-1, keepdim=True) / keep.sum(dim=-1, keepdim=True).clamp(min=1)
    raw = torch.exp(log_ratio)
    if mode.endswith("_m2"):
        weight = raw.masked_fill(_second_moment_mask(token_log_ratio, keep, mode, m2_threshold), 0.0)
        if clip_max is not None:
            weight = weight.clamp(max=clip_max)
    elif mode.endswith("_truncate"):
        weight = torch.clamp(raw, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        weight = raw.masked_fill((raw < low) | (raw > high), 0.0)
    changed = weight != raw
    if normalize:
        weight = _self_normalized(weight, keep, per_token=is_token_level(mode))
    return ImportanceWeights(weight=weight, raw=raw, changed=changed)


def _self_normalized(weight: torch.Tensor, keep: torch.Tensor, per_token: bool) -> torch.Tensor:
    """`weight` divided by its mean over the counted units (tokens, or sequences with a counted token), so the batch's
    weights average 1: self-normalised (weighted) IS. Why: `E_mu[log pi/mu] = -KL(mu || pi) <= 0`, so the weights of
    stale samples average below 1 (a geometric weight is `exp(-KL)`-ish for every sequence; a mask drops mass) and
    shrink the step as much as they reweight it. A batch whose weights are all 0 stays 0."""
    units = keep if per_token else keep.any(dim=-1, keepdim=True)
    mean = (weight * units).sum() / units.sum().clamp(min=1)
    return torch.where(mean > 0, weight / mean.clamp(min=torch.finfo(weight.dtype).tiny), weight)


def reweight_gradient(logps: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`logps` with the same values and the gradient of token t multiplied by `weight[..., t]` (detached).

    How per-token IS weights reach a loss that sums token logprobs before anything else reads them (RLOO's
    `exp(sum_t log pi_t - old)` ratio): the weight cannot be folded into a per-sequence advantage, but the policy
    gradient `A * sum_t w_t * grad log pi_t` (truncated IS per token, as for GRPO's per-token loss) is exactly the
    gradient of this tensor's sum, while every value TRL computes from it (the ratio, its clip, the logged metrics)
    is unchanged."""
    weight = weight.detach()
    return logps.detach() + weight * (logps - logps.detach())


def importance_sampling_ratio(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
    m2_threshold: float = DEFAULT_M2_THRESHOLD,
    normalize: bool = False,
) -> torch.Tensor:
    """IS weights: (B, T) for token-level modes, (B, 1) for sequence-level ones (`importance_weights(...).weight`)."""
    return importance_weights(
        old_logps, sampling_logps, mask, mode, clip_min, clip_max, m2_threshold, normalize
    ).weight


def _second_moment_mask(
    token_log_ratio: torch.Tensor, keep: torch.Tensor, mode: str, threshold: float
) -> torch.Tensor:
    """M2PO's mask, True where a unit is masked: drop the units with the largest squared log-ratio until the mean
    squared token log-ratio over the counted tokens left is <= `threshold`. Returns (B, T) for `token_m2`, (B, 1) for
    `geometric_m2`.

    Units: the counted tokens (`token_m2`), or the sequences ranked by their mean squared token log-ratio, the bound
    being on the tokens they hold (`geometric_m2`). Why a prefix: adding units in ascending order of their value
    never lowers the running (token-weighted) mean, so the largest set within the bound is the longest ascending
    prefix whose mean is <= `threshold` (ties broken by position, so exactly that many units are kept). A unit with
    no counted token is never masked (it carries no gradient)."""
    squared = token_log_ratio.float().square() * keep  # (B, T), 0 where not counted
    if mode.startswith("token"):
        sums, counts = squared.flatten(), keep.flatten().float()
    else:
        sums, counts = squared.sum(dim=-1), keep.sum(dim=-1).float()
    values = sums / counts.clamp(min=1)
    order = torch.argsort(values, stable=True)
    running = torch.cumsum(sums[order], 0) / torch.cumsum(counts[order], 0).clamp(min=1)
    within = int((running <= threshold).sum())  # running is non-decreasing: a prefix of the order
    masked_sorted = torch.arange(len(order), device=order.device) >= within
    masked = torch.empty_like(masked_sorted).scatter_(0, order, masked_sorted) & (counts > 0)
    return masked.view_as(token_log_ratio) if mode.startswith("token") else masked.view(-1, 1)


def importance_sampling_stats(
    ratio: torch.Tensor,
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    weights: ImportanceWeights | None = None,
) -> ImportanceSamplingStats:
    """Stats of one batch: weights over counted tokens (all sequences for sequence-level ratios of shape (B, 1)),
    |log pi_old - log mu| over counted tokens whose difference is not NaN; raw weights and changed units from
    `weights` (without it: `ratio` is its own raw weight and nothing was changed)."""
    keep = mask.bool()
    per_sequence = ratio.shape[-1] == 1

    def units(t: torch.Tensor) -> torch.Tensor:
        return (t.flatten() if per_sequence else t[keep]).float()

    flat = units(ratio)
    raw = units(weights.raw) if weights is not None else flat
    changed = weights.changed if weights is not None else torch.zeros_like(ratio, dtype=torch.bool)
    changed_tokens = (changed.expand_as(keep) if per_sequence else changed) & keep
    delta = torch.abs(old_logps - sampling_logps)[keep].float()
    delta = delta[~torch.isnan(delta)]
    inf = torch.tensor(math.inf, device=ratio.device)

    def extreme(t: torch.Tensor, fn: str, empty: torch.Tensor) -> torch.Tensor:
        return getattr(t, fn)() if t.numel() else empty

    def count(t: torch.Tensor) -> torch.Tensor:
        return t.sum().to(device=ratio.device, dtype=torch.float32)

    return ImportanceSamplingStats(
        ratio_sum=flat.sum(),
        ratio_count=torch.tensor(flat.numel(), device=ratio.device, dtype=torch.float32),
        ratio_min=extreme(flat, "min", inf),
        ratio_max=extreme(flat, "max", -inf),
        diff_sum=delta.sum(),
        diff_count=torch.tensor(delta.numel(), device=ratio.device, dtype=torch.float32),
        diff_max=extreme(delta, "max", -inf),
        raw_sum=raw.sum(),
        raw_min=extreme(raw, "min", inf),
        raw_max=extreme(raw, "max", -inf),
        changed_tokens=count(changed_tokens),
        token_count=count(keep),
        changed_sequences=count(changed_tokens.any(dim=-1)),
        sequence_count=count(keep.any(dim=-1)),
    )
