"""Importance-sampling (IS) correction on the trainers' CB path: the sampler's logprobs against the policy's.

How the weight reaches the loss: TRL multiplies its loss by an IS ratio only on the vLLM path. Both trainers' policy
terms are linear in the advantage A (`-min(c * A, clip(c) * A)` and the like), so for a weight w >= 0,
`w * term(A) == term(w * A)`: w is folded into the advantages, which TRL accepts as (B, T) for this kind of extension;
VESPO, which consumes the ratio itself, gets it as `importance_sampling_ratio`. The KL term is not weighted (as in
TRL). When the weights cannot change between scoring and the loss, the old-policy logprobs are those of TRL's own loss
forward (no extra forward; `can_defer`). The ratio itself: `trl_cb/importance_sampling.py`.

Invariant: TRL's five IS metrics are logged once per generation batch with TRL's reduction, whatever the
micro-batching: a deferred correction merges each micro-batch's stats and logs them after the batch's last one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..importance_sampling import (
    DEFAULT_M2_THRESHOLD,
    IS_EXTRA_METRIC_NAMES,
    IS_METRIC_NAMES,
    ImportanceSamplingStats,
    importance_sampling_stats,
    importance_weights,
    reduce_extra_values,
    reweight_gradient,
)
from ..rollouts.rollout_groups import TokenValues
from . import trl_internals

__all__ = ["IS_METRIC_NAMES", "DeferredCorrection", "ImportanceSamplingCorrection", "padded_sampling_logps"]

#: Key of the (B, T) sampling logprobs in a scored batch whose IS correction waits for the loss forward.
_DEFERRED_IS_KEY = "cb_deferred_sampling_per_token_logps"
#: Key of the 0-dim id of the generation batch a deferred micro-batch belongs to (TRL's split keeps 0-dim tensors).
_DEFERRED_IS_BATCH = "cb_deferred_is_batch"
#: Key of the (B, T) per-token weights a sequence-level loss (RLOO) applies to its logprobs' gradient in the loss.
_GRADIENT_WEIGHTS_KEY = "cb_is_gradient_weights"
#: Key of a 0-dim marker: RLOO's scoring skipped its old-logps forward; the loss forward provides `old_logps`.
_OLD_LOGPS_FROM_LOSS_KEY = "cb_old_logps_from_loss"


@dataclass
class DeferredCorrection:
    """One generation batch whose IS correction waits for the loss forwards of its micro-batches."""

    mode: str  # "train" or "eval": where its metrics are logged
    parts_left: int  # micro-batches still to come
    stats: ImportanceSamplingStats | None = None  # merged over the micro-batches done so far


def padded_sampling_logps(output: dict[str, Any], sampled: list[TokenValues] | None) -> torch.Tensor:
    """(B, T) sampling logprobs aligned with `output["completion_ids"]`: the batch's own when TRL put them there,
    else `sampled` (one row per completion) padded."""
    if "sampling_per_token_logps" in output:  # GRPO's batch has them (`TrainerRollouts.score`; TRL's, tool turns too)
        return output["sampling_per_token_logps"]
    if sampled is None:
        raise RuntimeError("The CB path produced no sampling logprobs for this batch.")
    width = output["completion_ids"].size(1)
    rows = [torch.as_tensor(lp, dtype=torch.float32) for lp in sampled]  # lists or fp32 tensors
    padded = trl_internals.pad(rows, padding_value=0.0, padding_side="right")
    padded = torch.nn.functional.pad(padded, (0, width - padded.size(1)))
    return padded.to(output["completion_ids"].device)


class ImportanceSamplingCorrection:
    """The trainer's IS correction (a part of `TrainerRollouts`), the one writer of its state: `batches` (generation
    batches registered so far: the next one's id) and `pending` (deferred corrections by batch id). `per_token_loss`:
    GRPO's loss takes (B, T) advantages; RLOO's (B,), so token-level weights go to its gradient."""

    def __init__(self, trainer: Any, per_token_loss: bool) -> None:
        self.trainer = trainer
        self.per_token_loss = per_token_loss
        self.batches = 0
        self.pending: dict[int, DeferredCorrection] = {}

    def correct(self, output: dict[str, Any], sampled: list[TokenValues] | None) -> None:
        """Apply the IS correction to a scored batch now, or defer it to the loss forward when that is exact.
        `sampled`: the round's sampler-side logprobs, one row per completion (unused when TRL's batch carries them
        as `sampling_per_token_logps`)."""
        if not self.enabled():
            return
        trainer = self.trainer
        mode = "train" if trainer.model.training else "eval"
        if self.can_defer(output):
            # The loss forward computes these same logprobs with the same weights; the ratio is applied there, per
            # micro-batch, and the stats are logged once the generation batch's last micro-batch is done. TRL splits
            # a training generation batch into `steps_per_generation` micro-batch dicts (reused, not re-split, for
            # `num_iterations`; the keys are popped at first use); eval uses it whole.
            batch_id = self.batches
            self.batches += 1
            parts = trainer.args.steps_per_generation if mode == "train" else 1
            self.pending[batch_id] = DeferredCorrection(mode, parts)
            output[_DEFERRED_IS_KEY] = padded_sampling_logps(output, sampled)
            output[_DEFERRED_IS_BATCH] = torch.tensor(batch_id)
        else:
            sampling = padded_sampling_logps(output, sampled)
            self.log_stats(self.apply(output, sampling=sampling), mode)

    def old_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """(B, T) training-policy logprobs of the sampled tokens (reused when TRL computed them)."""
        if output.get("old_per_token_logps") is not None:
            return output["old_per_token_logps"]
        return trl_internals.policy_logps(self.trainer, output)

    def can_defer(self, output: dict[str, Any]) -> bool:
        """Whether the IS ratio may use the loss forward's logprobs instead of an extra no-grad forward now.

        Valid exactly when TRL itself treats the loss forward's detached logprobs as the old policy's (GRPO leaves
        `old_per_token_logps` unset then): every micro-batch of this generation batch is trained on before the next
        optimizer step, i.e. gradient_accumulation_steps is a multiple of steps_per_generation x num_iterations, so
        the weights at loss time are the weights at scoring time. RLOO's old-policy logprobs follow the same rule
        (`old_logps_from_loss`). Not with Liger's fused loss, which never calls `_get_per_token_logps_and_entropies`.
        """
        return output.get("old_per_token_logps") is None and self._weights_fixed_until_loss()

    def _weights_fixed_until_loss(self) -> bool:
        """`can_defer`'s rule on the schedule: no optimizer step between scoring a generation batch and the loss
        forwards of all its micro-batches, and TRL's loss computes its logprobs (no Liger)."""
        args = self.trainer.args
        if getattr(args, "use_liger_kernel", False):
            return False
        generate_every = args.steps_per_generation * getattr(args, "num_iterations", 1)
        return args.gradient_accumulation_steps % generate_every == 0

    def old_logps_from_loss(self) -> bool:
        """Whether RLOO's scoring may skip its extra no-grad forward: the old-policy sequence logprobs (`old_logps`)
        are then the loss forward's, detached, as GRPO's TRL does under the same rule (`can_defer`).

        Why: TRL's RLOO always runs that forward, a whole extra forward per batch (~15% of a step on the CPU
        benchmark), whose values equal the loss forward's when the weights cannot change in between. Not with a KL
        term (`beta != 0`: TRL also reads the per-token values there) and not outside training. With dropout the two
        forwards drew different masks, so TRL's ratio was not 1 at the first iteration; it is now, as in GRPO.
        """
        trainer = self.trainer
        if self.per_token_loss or not trainer.args.use_transformers_continuous_batching or not trainer.model.training:
            return False
        return getattr(trainer, "beta", 0.0) == 0.0 and self._weights_fixed_until_loss()

    def trl_score(self, score: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """TRL's scoring (`score()`), its RLOO old-logps forward skipped when `old_logps_from_loss`."""
        if not self.old_logps_from_loss():
            return score()
        with trl_internals.old_logps_forward_skipped(self.trainer):
            output = score()
        output[_OLD_LOGPS_FROM_LOSS_KEY] = torch.tensor(True)
        return output

    def compute_loss(self, inputs: dict[str, Any], trl_loss: Callable[[], torch.Tensor]) -> torch.Tensor:
        """TRL's loss (`trl_loss()`, reading `inputs`); a deferred IS correction (`can_defer`) is applied to `inputs`
        as soon as TRL's loss forward has produced the policy's logprobs, before TRL reads the advantages (pinned by
        test_contracts), and per-token weights of a sequence-level loss (RLOO) scale the gradient of those logprobs
        there."""
        sampling = inputs.pop(_DEFERRED_IS_KEY, None)
        batch = inputs.pop(_DEFERRED_IS_BATCH, None)
        gradient_weights = inputs.pop(_GRADIENT_WEIGHTS_KEY, None)  # set at scoring when the correction was eager
        old_from_loss = inputs.pop(_OLD_LOGPS_FROM_LOSS_KEY, None) is not None
        if sampling is None and gradient_weights is None and not old_from_loss:
            return trl_loss()

        def correct(logps: torch.Tensor) -> torch.Tensor:
            if old_from_loss:  # RLOO reads `old_logps` after this forward: its sums, as TRL forms them, detached
                inputs["old_logps"] = (logps.detach() * inputs["completion_mask"]).sum(1)
            weights = gradient_weights
            if sampling is not None:
                self._add_deferred_stats(int(batch), self.apply(inputs, sampling=sampling, old=logps.detach()))
                weights = inputs.pop(_GRADIENT_WEIGHTS_KEY, None)
            return logps if weights is None else reweight_gradient(logps, weights)

        return trl_internals.with_policy_logps_hook(self.trainer, trl_loss, correct)

    def apply(
        self, output: dict[str, Any], sampling: torch.Tensor, old: torch.Tensor | None = None
    ) -> ImportanceSamplingStats:
        """Weight `output`'s advantages by the IS ratio (see module docstring); return the batch's IS stats.

        `old` / `sampling`: the training policy's and the sampler's logprobs of the sampled tokens, (B, T); `old` is
        computed from `output` when not given."""
        args = self.trainer.args
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        old = self.old_logps(output) if old is None else old
        weights = importance_weights(
            old,
            sampling,
            mask,
            args.cb_importance_sampling_mode,
            args.cb_importance_sampling_clip_min,
            args.cb_importance_sampling_clip_max,
            getattr(args, "cb_importance_sampling_m2_threshold", DEFAULT_M2_THRESHOLD),
            normalize=bool(getattr(args, "cb_importance_sampling_normalize", False)),
        )
        ratio = weights.weight  # (B, T) or (B, 1)
        output["importance_sampling_ratio"] = ratio
        if getattr(args, "loss_type", None) != "vespo":
            advantages = output["advantages"]
            if self.per_token_loss:
                output["advantages"] = advantages.unsqueeze(1) * ratio  # (B, T) or (B, 1)
            elif ratio.size(1) == 1:
                output["advantages"] = advantages * ratio.squeeze(1)  # (B,)
            else:  # token-level weights on a sequence-level loss: applied to the gradient in `compute_loss`
                output[_GRADIENT_WEIGHTS_KEY] = ratio
        return importance_sampling_stats(ratio, old, sampling, mask, weights)

    def _add_deferred_stats(self, batch_id: int, stats: ImportanceSamplingStats) -> None:
        """Merge one micro-batch's stats into its generation batch's; log them once the batch's last part is in."""
        entry = self.pending.get(batch_id)
        if entry is None:  # pragma: no cover - every deferred batch is registered by `correct`
            raise RuntimeError(f"trl_cb: IS stats for unknown generation batch {batch_id}.")
        entry.parts_left -= 1
        entry.stats = stats if entry.stats is None else entry.stats.merge(stats)
        if entry.parts_left == 0:
            del self.pending[batch_id]
            self.log_stats(entry.stats, entry.mode)

    def log_stats(self, stats: ImportanceSamplingStats, mode: str) -> None:
        """Append TRL's five IS metrics for one generation batch, reduced across processes as TRL reduces them
        (mean of means, max of maxima, NaN-aware min/mean/max of the weights), and trl_cb's off-policy diagnostics
        (`IS_EXTRA_METRIC_NAMES`, reduced exactly from sums and extrema). One collective, one host sync."""
        local = torch.cat([stats.local_values(), stats.reduction_sums()])[None]
        ranks = self.trainer.accelerator.gather(local).reshape(-1, local.shape[1])  # (processes, 5 + 8)
        trl_values, sums = ranks[:, : len(IS_METRIC_NAMES)], ranks[:, len(IS_METRIC_NAMES) :]
        reduced = torch.stack(
            [
                trl_values[:, 0].mean(),
                trl_values[:, 1].max(),
                trl_internals.nanmin(trl_values[:, 2]),
                trl_values[:, 3].nanmean(),
                trl_internals.nanmax(trl_values[:, 4]),
                *reduce_extra_values(sums),
            ]
        ).tolist()
        for name, value in zip(IS_METRIC_NAMES + IS_EXTRA_METRIC_NAMES, reduced, strict=True):
            trl_internals.log_metric(self.trainer, mode, name, value)

    def enabled(self) -> bool:
        args = self.trainer.args
        return bool(args.use_transformers_continuous_batching and args.cb_importance_sampling_correction)
