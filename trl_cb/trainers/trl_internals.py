"""The only place trl_cb's trainers touch TRL beyond its public API (as `engine/_upstream.py` is for transformers).

Each private attribute or helper is reached through one function here, pinned by tests/unit/test_contracts.py:
`_tokenize_prompts`, `_metrics`, `_get_per_token_logps_and_entropies` (called, wrapped for one `_compute_loss`, and
answered without a forward for RLOO's old-policy logprobs in one scoring),
`trl.models.utils.disable_gradient_checkpointing`, `trl.trainer.utils.pad/nanmin/nanmax`, `profiling_context`. The
trainers also override TRL's `_generate_single_turn`, `_generate_and_score_completions` and `_compute_loss`
(`mixin.py`, `is_correction.py`); their signatures and call order are pinned there too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from trl.extras.profiling import profiling_context
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanmax, nanmin, pad

__all__ = [
    "log_metric",
    "nanmax",
    "nanmin",
    "old_logps_forward_skipped",
    "pad",
    "policy_logps",
    "profiling_context",
    "tokenize_prompts",
    "with_policy_logps_hook",
]

_LOGPS = "_get_per_token_logps_and_entropies"


def tokenize_prompts(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """Prompt token ids exactly as TRL's trainer builds them for generation (chat template included)."""
    return [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]


def log_metric(trainer: Any, mode: str, name: str, value: float) -> None:
    """Append `value` to the trainer's logged metric `name` (`mode`: "train" or "eval")."""
    trainer._metrics[mode][name].append(value)


def policy_logps(trainer: Any, output: dict[str, Any]) -> torch.Tensor:
    """(B, T) training-policy logprobs of `output`'s completion tokens: one no-grad forward, as TRL computes
    `old_per_token_logps`."""
    prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    args = trainer.args
    batch_size = args.per_device_train_batch_size if trainer.model.training else args.per_device_eval_batch_size
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, args.gradient_checkpointing_kwargs):
        logps, _, _ = getattr(trainer, _LOGPS)(
            trainer.model, prompt_completion_ids, attention_mask, output["completion_ids"].size(1), batch_size
        )
    return logps


@contextmanager
def _logps_replaced(trainer: Any, replacement: Callable[..., Any]) -> Iterator[None]:
    """`trainer._get_per_token_logps_and_entropies` is `replacement` inside the block; whatever was there before (a
    user's instance attribute included) is back after it."""
    shadowed = trainer.__dict__.get(_LOGPS)
    trainer.__dict__[_LOGPS] = replacement
    try:
        yield
    finally:
        if shadowed is None:
            trainer.__dict__.pop(_LOGPS, None)
        else:
            trainer.__dict__[_LOGPS] = shadowed


def with_policy_logps_hook(
    trainer: Any,
    compute_loss: Callable[[], torch.Tensor],
    on_logps: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Run TRL's `compute_loss()` and call `on_logps(policy logprobs)` right after its loss forward (TRL's first
    `_get_per_token_logps_and_entropies` call there), before TRL reads anything else of the batch; TRL's loss goes on
    with what `on_logps` returns (the tensor itself, or one with the same values: `reweight_gradient`).

    `RuntimeError` if the loss never made that call: a correction must never be skipped silently."""
    applied = False
    original = getattr(trainer, _LOGPS)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        nonlocal applied
        if applied:  # one call only: the loss forward is TRL's first call in `_compute_loss`
            return original(*args, **kwargs)
        result = original(*args, **kwargs)
        logps = on_logps(result[0])
        applied = True
        return (logps, *result[1:])

    with _logps_replaced(trainer, hooked):
        loss = compute_loss()
    if not applied:
        raise RuntimeError(
            f"trl_cb: TRL's loss did not compute the policy's logprobs through `{_LOGPS}`; the deferred "
            "importance-sampling correction could not be applied."
        )
    return loss


@contextmanager
def old_logps_forward_skipped(trainer: Any) -> Iterator[None]:
    """Inside the block (TRL's RLOO scoring one batch), TRL's no-grad `_get_per_token_logps_and_entropies` call for the
    old-policy logprobs returns NaN placeholders, (B, logits_to_keep), instead of running a forward; the loss then
    takes them from its own forward (`ImportanceSamplingMixin._cb_old_logps_from_loss`: when, and why exact).

    NaN, not zeros: a placeholder that reached a loss unreplaced makes it NaN, never a silently wrong gradient.
    `RuntimeError` for a second call, or one with gradients on (TRL's scoring changed: it is not the call meant)."""
    calls = 0

    def placeholder(
        model: Any, input_ids: torch.Tensor, attention_mask: Any, logits_to_keep: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, None, None]:
        nonlocal calls
        calls += 1
        if calls > 1 or torch.is_grad_enabled():
            raise RuntimeError(
                f"trl_cb: unexpected `{_LOGPS}` call while TRL's RLOO scoring skips its old-logps forward"
            )
        return torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device), None, None

    with _logps_replaced(trainer, placeholder):
        yield
