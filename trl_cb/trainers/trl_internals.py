"""The only place trl_cb's trainers touch TRL beyond its public API (as `engine/_upstream.py` is for transformers).

Each private attribute or helper is reached through one function here, pinned by tests/unit/test_contracts.py:
`_tokenize_prompts`, `_metrics`, `_get_per_token_logps_and_entropies` (called, wrapped for one `_compute_loss`, and
answered without a forward for RLOO's old-policy logprobs in one scoring),
`trl.models.utils.disable_gradient_checkpointing`, `trl.trainer.utils.pad/nanmin/nanmax`, `profiling_context`; for
async tool calling (`tool_turns.py`): `_get_tool_suffix_ids`, `_standalone_tools`, `_env_tools`, `_multi_environment`,
`_environment_pool`, `environment_factories`, `max_tool_calling_iterations`, `chat_template(_kwargs)`, `async_loop`,
`trl.chat_template_utils.parse_response`. The trainers also override TRL's `_generate_single_turn`,
`_generate_and_score_completions`, `_tool_call_loop` and `_compute_loss` (`mixin.py`, `is_correction.py`); their
signatures and call order are pinned there too. transformers' warnings that TRL's calls raise are silenced by
`trl_cb/upstream_warnings.py` (the configs need it too, and sit below the trainers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from trl.extras.profiling import profiling_context
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanmax, nanmin, pad

__all__ = [
    "async_loop",
    "environment_pool",
    "log_metric",
    "max_tool_rounds",
    "multi_environment",
    "parse_turn",
    "render_prompt",
    "tool_functions",
    "tool_suffix_ids",
    "tools_for",
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
    takes them from its own forward (`ImportanceSamplingCorrection.old_logps_from_loss`: when, and why exact).

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


# ------------------------------------------------------------------------------- tool calling (tool_turns.py)


def multi_environment(trainer: Any) -> bool:
    """Whether `environment_factory` was a dict (each row's `environment` names its environment)."""
    return bool(getattr(trainer, "_multi_environment", False))


def tools_for(trainer: Any, environment: Any) -> list[Any] | None:
    """The tools a sample of `environment` (a name; `None`: the single or no environment) may call, as TRL renders
    them into its prompt (`None` for none: TRL's `or None`)."""
    if trainer.environment_factories is not None:
        return trainer._env_tools[environment] or None
    return trainer.tools or None


def render_prompt(trainer: Any, prompt: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
    """One conversational prompt's ids as TRL's `_tokenize_prompts` renders it (chat template, tools, kwargs)."""
    tokenized = trainer.processing_class.apply_chat_template(
        conversation=[prompt],
        tools=tools,
        chat_template=trainer.chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **trainer.chat_template_kwargs,
    )
    return list(tokenized["input_ids"][0])


def tool_functions(trainer: Any, environment: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(sync, async)` tool functions by name for a sample with `environment` (or none): the standalone tools and the
    environment's public methods but `reset` and `get_reward` (TRL's `_sync_tool_dicts` / `_async_tool_dicts`)."""
    methods = []
    if environment is not None:
        methods = [
            getattr(environment, name)
            for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")
        ]
    sync, coroutines = {}, {}
    for tool in [*trainer._standalone_tools, *methods]:
        (coroutines if inspect.iscoroutinefunction(tool) else sync)[tool.__name__] = tool
    return sync, coroutines


def max_tool_rounds(trainer: Any) -> int:
    return trainer.max_tool_calling_iterations


def tool_suffix_ids(trainer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The ids TRL appends after a turn for its tool results (`_get_tool_suffix_ids`: the chat template's rendering
    of the tool messages and the next generation prompt)."""
    return list(trainer._get_tool_suffix_ids(tool_messages))


def parse_turn(tokenizer: Any, ids: list[int], prefix: list[int], tools: list[Any] | None) -> dict[str, Any]:
    """A model turn as TRL parses it (`trl.chat_template_utils.parse_response`, falling back to text)."""
    from trl.chat_template_utils import parse_response

    return parse_response(tokenizer, ids, prefix=prefix, tools=tools)


def async_loop(trainer: Any) -> Any:
    """The event loop TRL runs async tools and rewards on (its daemon thread)."""
    return trainer.async_loop


@contextmanager
def environment_pool(trainer: Any, environments: list[tuple[Any, Any]]) -> Iterator[None]:
    """Inside the block TRL's environment pool holds `environments` (`(name, instance)`, in the order TRL will draw
    them for the batch), then its own instances again."""
    saved = trainer._environment_pool
    pool: dict[Any, list[Any]] = {name: [] for name in saved}
    for name, environment in environments:
        pool.setdefault(name, []).append(environment)
    trainer._environment_pool = pool
    try:
        yield
    finally:
        trainer._environment_pool = saved
