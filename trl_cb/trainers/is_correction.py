"""Importance-sampling (IS) correction on the trainers' CB path: the sampler's logprobs against the policy's.

How the weight reaches the loss: TRL multiplies its loss by an IS ratio only on the vLLM path. Both trainers' policy
terms are linear in the advantage A (`-min(c * A, clip(c) * A)` and the like), so for a weight w >= 0,
`w * term(A) == term(w * A)`: w is folded into the advantages, which TRL accepts as (B, T) for this kind of extension;
VESPO, which consumes the ratio itself, gets it as `importance_sampling_ratio`. The KL term is not weighted (as in
TRL). When the weights cannot change between scoring and the loss, the old-policy logprobs are those of TRL's own loss
forward (no extra forward; `_cb_can_defer_is`). The ratio itself: `trl_cb/importance_sampling.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..importance_sampling import importance_sampling_ratio, importance_sampling_stats
from . import trl_internals

__all__ = ["IS_METRIC_NAMES", "ImportanceSamplingMixin"]

#: TRL's metric names for the IS correction, in the order `_cb_importance_sampling` reduces them.
IS_METRIC_NAMES = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
#: Key of the (B, T) sampling logprobs in a scored batch whose IS correction waits for the loss forward.
_DEFERRED_IS_KEY = "cb_deferred_sampling_per_token_logps"


class ImportanceSamplingMixin:
    """The IS part of `ContinuousBatchingTrainerMixin`. Reads `_cb_last_logprobs` (the last round's sampling
    logprobs, set by the generation side) and `_cb_per_token_loss` (GRPO: (B, T) weights; RLOO: (B,))."""

    _cb_last_logprobs: list[list[float]] | None = None
    _cb_per_token_loss: bool

    def _cb_correct(self, output: dict[str, Any]) -> None:
        """Apply the IS correction to a scored batch now, or defer it to the loss forward when that is exact."""
        if not self._cb_uses_is():
            return
        if self._cb_can_defer_is(output):
            # The loss forward computes these same logprobs with the same weights; the ratio is applied there.
            output[_DEFERRED_IS_KEY] = self._cb_sampling_logps(output)
        else:
            self._cb_importance_sampling(output, per_token_loss=self._cb_per_token_loss)

    def _cb_sampling_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """(B, T) sampling logprobs aligned with `output["completion_ids"]`."""
        if "sampling_per_token_logps" in output:  # GRPO pads them itself (tool turns included)
            return output["sampling_per_token_logps"]
        if self._cb_last_logprobs is None:
            raise RuntimeError("The CB path produced no sampling logprobs for this batch.")
        width = output["completion_ids"].size(1)
        rows = [torch.tensor(lp, dtype=torch.float32) for lp in self._cb_last_logprobs]
        padded = trl_internals.pad(rows, padding_value=0.0, padding_side="right")
        padded = torch.nn.functional.pad(padded, (0, width - padded.size(1)))
        return padded.to(output["completion_ids"].device)

    def _cb_old_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """(B, T) training-policy logprobs of the sampled tokens (reused when TRL computed them)."""
        if output.get("old_per_token_logps") is not None:
            return output["old_per_token_logps"]
        return trl_internals.policy_logps(self, output)

    def _cb_can_defer_is(self, output: dict[str, Any]) -> bool:
        """Whether the IS ratio may use the loss forward's logprobs instead of an extra no-grad forward now.

        Valid exactly when TRL itself treats the loss forward's detached logprobs as the old policy's (GRPO leaves
        `old_per_token_logps` unset then): every micro-batch of this generation batch is trained on before the next
        optimizer step, i.e. gradient_accumulation_steps is a multiple of steps_per_generation x num_iterations, so
        the weights at loss time are the weights at scoring time. RLOO always runs the extra forward itself but keeps
        only the sequence sums; the same condition makes its per-token values equal the loss forward's. Not with
        Liger's fused loss, which never calls `_get_per_token_logps_and_entropies`.
        """
        args = self.args
        if output.get("old_per_token_logps") is not None or getattr(args, "use_liger_kernel", False):
            return False
        generate_every = args.steps_per_generation * getattr(args, "num_iterations", 1)
        return args.gradient_accumulation_steps % generate_every == 0

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss; a deferred IS correction (`_cb_can_defer_is`) is applied to `inputs` as soon as TRL's loss
        forward has produced the policy's logprobs, before TRL reads the advantages (pinned by test_contracts)."""
        sampling = inputs.pop(_DEFERRED_IS_KEY, None)
        if sampling is None:
            return super()._compute_loss(model, inputs)
        return trl_internals.with_policy_logps_hook(
            self,
            lambda: super(ImportanceSamplingMixin, self)._compute_loss(model, inputs),
            lambda old: self._cb_importance_sampling(
                inputs, per_token_loss=self._cb_per_token_loss, old=old, sampling=sampling
            ),
        )

    def _cb_importance_sampling(
        self,
        output: dict[str, Any],
        per_token_loss: bool,
        old: torch.Tensor | None = None,
        sampling: torch.Tensor | None = None,
    ) -> None:
        """Weight `output`'s advantages by the IS ratio and log TRL's IS metrics (see module docstring).

        `old` / `sampling`: the training policy's and the sampler's logprobs of the sampled tokens, (B, T); computed
        from `output` when not given."""
        args = self.args
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        sampling = self._cb_sampling_logps(output) if sampling is None else sampling
        old = self._cb_old_logps(output) if old is None else old
        mode_name = args.cb_importance_sampling_mode
        ratio = importance_sampling_ratio(
            old, sampling, mask, mode_name, args.cb_importance_sampling_clip_min, args.cb_importance_sampling_clip_max
        )  # (B, T) or (B, 1)
        output["importance_sampling_ratio"] = ratio
        if getattr(args, "loss_type", None) != "vespo":
            advantages = output["advantages"]
            if per_token_loss:
                output["advantages"] = advantages.unsqueeze(1) * ratio  # (B, T) or (B, 1)
            else:
                output["advantages"] = advantages * ratio.squeeze(1)  # sequence modes only: (B,)

        stats = importance_sampling_stats(ratio, old, sampling, mask)
        mode = "train" if self.model.training else "eval"
        # One collective and one host sync for all five (this runs per micro-batch when the correction is deferred).
        local = torch.stack(
            [stats.logp_diff_mean, stats.logp_diff_max, stats.ratio_min, stats.ratio_mean, stats.ratio_max]
        ).float()
        ranks = self.accelerator.gather(local[None]).reshape(-1, 5)  # (processes, 5)
        reduced = torch.stack(
            [
                ranks[:, 0].mean(),
                ranks[:, 1].max(),
                trl_internals.nanmin(ranks[:, 2]),
                ranks[:, 3].nanmean(),
                trl_internals.nanmax(ranks[:, 4]),
            ]
        ).tolist()
        for name, value in zip(IS_METRIC_NAMES, reduced, strict=True):
            trl_internals.log_metric(self, mode, name, value)

    def _cb_uses_is(self) -> bool:
        return bool(self.args.use_transformers_continuous_batching and self.args.cb_importance_sampling_correction)
