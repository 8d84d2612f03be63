"""`GRPOTrainer` and `RLOOTrainer`: TRL's trainers with the CB path routed through one rollout component.

Hops (file per hop): prompts -> `TrainerRollouts.generate` (trainer_rollouts.py: the trainer's engine, async groups
or rollout servers) -> completions and sampling logprobs -> TRL scores them -> the IS correction weights the
policy-gradient term (is_correction.py) -> TRL's loss. The trainer classes only route TRL's hooks to `self.rollouts`
when `use_transformers_continuous_batching` is on, and refuse at construction what the CB path cannot serve. TRL
internals: trl_internals.py.
"""

from __future__ import annotations

from typing import Any

import torch
import trl
from transformers import ProcessorMixin

from ..checks import model as model_checks
from ..checks.engine_config import validate_generation_settings
from ..engine import guards
from ..rollouts.model_access import plain_module
from ..rollouts.rollout_groups import as_lists
from ..upstream_warnings import quiet_trl_gradient_checkpointing
from .async_bridge import ASYNC_STATE_FILE
from .is_correction import IS_METRIC_NAMES
from .trainer_rollouts import TrainerRollouts

__all__ = ["ASYNC_STATE_FILE", "IS_METRIC_NAMES", "ContinuousBatchingTrainerMixin", "GRPOTrainer", "RLOOTrainer"]


def refuse_before_init(model: Any, args: Any, processing_class: Any) -> None:
    """Before TRL's `__init__`: refuse a multimodal processor, and a model given by name from its config alone (no
    weights downloaded)."""
    if args is None or not args.use_transformers_continuous_batching:
        return
    if isinstance(processing_class, ProcessorMixin):
        raise ValueError(
            "trl_cb's continuous batching path does not support multimodal models (processing_class is a "
            f"{type(processing_class).__name__}). Use a text-only model, or `use_vllm` / the `generate()` path."
        )
    if not isinstance(model, str):
        return
    from transformers import AutoConfig

    init_kwargs = getattr(args, "model_init_kwargs", None) or {}
    keys = ("revision", "trust_remote_code", "token", "cache_dir")
    try:
        config = AutoConfig.from_pretrained(model, **{k: init_kwargs[k] for k in keys if k in init_kwargs})
    except (OSError, ValueError):  # not a model we can read offline: TRL's own loading reports it
        return
    model_checks.check_config(config)


def refuse_after_init(trainer: Any) -> None:
    """After TRL built the trainer: refuse any generation setting (TRL's `temperature`/`top_p`/`top_k`/`min_p`/
    `repetition_penalty` and `generation_kwargs`, merged into `generation_config` by TRL) the CB path would not apply
    exactly, and a model the engine cannot serve exactly (checks/model.py) — at construction rather than as an error
    (or a silently different sampler) at the first step."""
    if trainer.args.use_transformers_continuous_batching:
        validate_generation_settings(trainer.generation_config, trainer.args.transformers_continuous_batching_config)
        model_checks.check_model(plain_module(trainer.model))


class ContinuousBatchingTrainerMixin:
    """What GRPO and RLOO share on the CB path: construction checks, the rollout component (`self.rollouts`), TRL's
    scoring and loss hooks routed to it, and the engine stopped at the end of `train`."""

    #: Whether the trainer's loss is per token (GRPO: the IS weight may be (B, T)) or per sequence (RLOO: (B,)).
    _cb_per_token_loss: bool
    rollouts: TrainerRollouts

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """TRL's trainer `__init__`, with everything the CB path cannot serve refused before (model config,
        processor) and after (generation settings, built model) it, and async rollouts set up."""
        model = kwargs.get("model", args[0] if args else None)
        refuse_before_init(model, kwargs.get("args"), kwargs.get("processing_class"))
        self.rollouts = TrainerRollouts(self, self._cb_per_token_loss)  # first: `__del__` closes it whatever failed
        with quiet_trl_gradient_checkpointing():  # PEFT's wrapping (LoRA) reads transformers' deprecated name
            super().__init__(*args, **kwargs)
        refuse_after_init(self)
        self.rollouts.async_rollouts.setup()

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        return self.rollouts.score(inputs, super()._generate_and_score_completions)  # CB off: TRL's, unchanged

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        return self.rollouts.compute_loss(
            inputs, lambda: super(ContinuousBatchingTrainerMixin, self)._compute_loss(model, inputs)
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """TRL's `train`, with the CB engine stopped at the end, on errors and on Ctrl-C (no thread left behind), and
        async rollouts resuming their prompt stream from the checkpoint's saved position."""
        self.rollouts.resume(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.rollouts.close()

    def cb_sync_rollout_servers(self) -> int:
        """For a TRL `rollout_func` that samples from the servers itself (an OpenAI-client environment against
        `trl-cb serve`, docs/server.md "Training on trajectories from an OpenAI client"): connect, push this step's
        weights unless pushed already, and return the version the servers now serve (every token the environment
        gets should carry it: a later one was pushed by someone else, an earlier one is stale). A collective."""
        return self.rollouts.sync_servers()

    def __del__(self, _close_at_collection=guards.close_at_collection) -> None:  # bound now: globals go at exit
        rollouts = self.__dict__.get("rollouts")
        if rollouts is not None:
            _close_at_collection(rollouts.close)


class GRPOTrainer(ContinuousBatchingTrainerMixin, trl.GRPOTrainer):
    """TRL's `GRPOTrainer`; with `args.use_transformers_continuous_batching`, rollouts come from trl_cb's engine and
    the loss is importance-sampling corrected (see `GRPOConfig`)."""

    _cb_per_token_loss = True

    def _generate_single_turn(
        self,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: dict[str, Any],
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        if not self.args.use_transformers_continuous_batching:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        completion_ids, logprobs = self.rollouts.generate(prompt_ids)
        if getattr(self, "tools", None):  # TRL's tool loop extends each completion's logprob list turn by turn
            return completion_ids, as_lists(logprobs)
        # No lists for TRL to pad token by token: `TrainerRollouts.score` puts the padded (B, T) tensor in the batch
        return completion_ids, None

    def _tool_call_loop(
        self,
        prompts: list[Any],
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        completions: list[Any],
        logprobs: list[list[float]] | None,
        images: Any,
        multimodal_fields: dict[str, Any],
    ) -> tuple[Any, ...]:
        """TRL's tool loop; in async mode its results, from the loops the rollout producer already ran."""
        replayed = self.rollouts.tool_loop() if self.args.use_transformers_continuous_batching else None
        if replayed is not None:
            return replayed
        return super()._tool_call_loop(
            prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
        )


class RLOOTrainer(ContinuousBatchingTrainerMixin, trl.RLOOTrainer):
    """TRL's `RLOOTrainer`; with `args.use_transformers_continuous_batching`, rollouts come from trl_cb's engine and
    the (per-sequence) loss is importance-sampling corrected (see `RLOOConfig`)."""

    _cb_per_token_loss = False

    def _generate_single_turn(
        self, prompt_ids: list[list[int]], images: Any, multimodal_fields: dict[str, Any]
    ) -> list[list[int]]:
        if not self.args.use_transformers_continuous_batching:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
        completion_ids, _ = self.rollouts.generate(prompt_ids)
        return completion_ids
