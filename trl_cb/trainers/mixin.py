"""`GRPOTrainer` and `RLOOTrainer`: TRL's trainers with the CB path routed through one shared adapter.

Hops (file per hop): prompts -> `ContinuousBatchingGenerator` (rollouts/generator.py) -> completions and sampling
logprobs -> TRL scores them -> the IS correction weights the policy-gradient term (is_correction.py) -> TRL's loss.
With `cb_async_generation`, finished groups of an `AsyncRolloutController` replace the per-step generation call
(async_bridge.py) and go through the same scoring. TRL internals: trl_internals.py.
"""

from __future__ import annotations

import functools
from typing import Any

import trl
from transformers import ProcessorMixin

from ..checks import model as model_checks
from ..checks.engine_config import validate_generation_settings
from ..engine import guards
from ..rollouts.generator import ContinuousBatchingGenerator
from ..rollouts.model_access import plain_module
from ..rollouts.rollout_groups import TokenValues, as_lists
from ..upstream_warnings import quiet_trl_gradient_checkpointing
from . import trl_internals
from .async_bridge import ASYNC_STATE_FILE, AsyncRolloutsMixin
from .generators import build_generator
from .is_correction import IS_METRIC_NAMES, ImportanceSamplingMixin
from .remote import RemoteRolloutsMixin

__all__ = ["ASYNC_STATE_FILE", "IS_METRIC_NAMES", "ContinuousBatchingTrainerMixin", "GRPOTrainer", "RLOOTrainer"]


class ContinuousBatchingTrainerMixin(AsyncRolloutsMixin, ImportanceSamplingMixin, RemoteRolloutsMixin):
    """Everything GRPO and RLOO share on the CB path: refusals at construction, the persistent generator, one
    generation round per step, and the engine's lifecycle; async rollouts and the IS correction come from the two
    mixins it combines."""

    #: Whether the trainer's loss is per token (GRPO: the IS weight may be (B, T)) or per sequence (RLOO: (B,)).
    _cb_per_token_loss: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """TRL's trainer `__init__`, with everything the CB path cannot serve refused before (model config,
        processor) and after (generation settings, built model) it, and the async hooks installed."""
        self._cb_check_processing_class(kwargs.get("args"), kwargs.get("processing_class"))
        self._cb_check_model_config(kwargs.get("model", args[0] if args else None), kwargs.get("args"))
        with quiet_trl_gradient_checkpointing():  # PEFT's wrapping (LoRA) reads transformers' deprecated name
            super().__init__(*args, **kwargs)
        self._cb_check_generation_settings()
        self._cb_check_model()
        self._cb_async_setup()

    def _cb_check_processing_class(self, args: Any, processing_class: Any) -> None:
        if (
            args is not None
            and args.use_transformers_continuous_batching
            and isinstance(processing_class, ProcessorMixin)
        ):
            raise ValueError(
                "trl_cb's continuous batching path does not support multimodal models (processing_class is a "
                f"{type(processing_class).__name__}). Use a text-only model, or `use_vllm` / the `generate()` path."
            )

    def _cb_check_generation_settings(self) -> None:
        """Refuse, at construction, any generation setting (TRL's `temperature`/`top_p`/`top_k`/`min_p`/
        `repetition_penalty` and `generation_kwargs`, merged into `self.generation_config` by TRL) the CB path
        would not apply exactly — instead of an error (or a silently different sampler) at the first step."""
        if self.args.use_transformers_continuous_batching:
            validate_generation_settings(self.generation_config, self.args.transformers_continuous_batching_config)

    def _cb_check_model_config(self, model: Any, args: Any) -> None:
        """Before TRL loads a model given by name: refuse from its config alone (no weights downloaded)."""
        if args is None or not args.use_transformers_continuous_batching or not isinstance(model, str):
            return
        from transformers import AutoConfig

        init_kwargs = getattr(args, "model_init_kwargs", None) or {}
        keys = ("revision", "trust_remote_code", "token", "cache_dir")
        try:
            config = AutoConfig.from_pretrained(model, **{k: init_kwargs[k] for k in keys if k in init_kwargs})
        except (OSError, ValueError):  # not a model we can read offline: TRL's own loading reports it
            return
        model_checks.check_config(config)

    def _cb_check_model(self) -> None:
        """After TRL built the model: refuse what the engine cannot serve exactly (checks/model.py), at
        construction rather than as a failed request at the first step."""
        if self.args.use_transformers_continuous_batching:
            model_checks.check_model(plain_module(self.model))

    # ---------------------------------------------------------------------------------------------- generation

    def _cb_get_generator(self) -> ContinuousBatchingGenerator:
        """The trainer's one generator, built at the first generation and kept across steps."""
        wrapped, state = self.model_wrapped, self.rollout_state
        if state.generator is not None and state.generator.model is not wrapped:
            # The training wrapper changed (e.g. eval before train, then accelerate.prepare): new generator.
            state.generator.close()
            state.generator = None
        if state.generator is None:
            state.generator = build_generator(wrapped, self.generation_config, self.args, self.accelerator)
        return state.generator

    def _cb_generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[TokenValues]]:
        """Completions (lists) and their sampler-side policy logprobs (`GenerationResult.policy_logprobs`: what TRL's
        trainer computes, so the IS weight compares like with like; lists, or tensors from a server's binary answer)
        for TRL's prompt list (each prompt repeated per sample). The logprobs are also kept in
        `rollout_state.sampling_logprobs` (its only writer, a new object each round) for `_cb_score` to hand to the IS
        correction."""
        if self.rollout_state.async_rollouts.step_groups is not None:
            completion_ids, logprobs = self._cb_async_completions(prompt_ids)
        elif self.args.cb_server_urls:  # rollouts from `trl-cb serve` replicas (trainers/remote.py)
            completion_ids, logprobs = self._cb_remote_generate(prompt_ids)
        else:
            generator = self._cb_get_generator()
            with trl_internals.profiling_context(self, "trl_cb.generate"):
                result = generator.generate(prompt_ids, num_generations=1)
            completion_ids, logprobs = result.completion_ids, result.policy_logprobs
        self.rollout_state.sampling_logprobs = logprobs
        return completion_ids, logprobs

    def _cb_close(self) -> None:
        """Stop async rollouts and the generator (hard stop: nothing in flight is generated); interrupt-safe."""
        with guards.deferred_interrupts():
            self._cb_async_stop()
            self._cb_remote_close()
            state = self.rollout_state
            generator, state.generator = state.generator, None
            if generator is not None:
                generator.close()

    @quiet_trl_gradient_checkpointing()  # TRL's generation/scoring helpers call transformers' deprecated names
    def _cb_score(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's scoring of `inputs` (or, in async mode, of finished groups), then IS correction. GRPO's sampling
        logprobs enter the batch as one padded tensor (`sampling_per_token_logps`, as TRL names it) built here from
        the rows (tensors from a server's binary answer, or lists), not from per-token lists TRL would pad itself."""
        state = self.rollout_state
        if self._cb_async_active():
            inputs = self._cb_async_take(inputs)
        before = state.sampling_logprobs
        with self._cb_async_replay():  # multi-turn: the groups' environments, as the rollout left them
            output = self._cb_trl_score(functools.partial(super()._generate_and_score_completions, inputs))
        # This batch's: `_cb_generate` (the one writer) put a new object there during TRL's scoring, else no CB round
        sampled = state.sampling_logprobs if state.sampling_logprobs is not before else None
        if self._cb_per_token_loss and sampled is not None and "sampling_per_token_logps" not in output:
            # GRPO: the sampler's logprobs TRL would have padded from lists (its loss reads them, e.g. for OPSM)
            output["sampling_per_token_logps"] = self._cb_sampling_logps(output, sampled)
        self._cb_correct(output, sampled)
        return output

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """TRL's `train`, with the CB engine stopped at the end, on errors and on Ctrl-C (no thread left behind), and
        async rollouts resuming their prompt stream from the checkpoint's saved position."""
        self._cb_async_resume(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._cb_close()

    def __del__(self, _close_at_collection=guards.close_at_collection) -> None:  # bound now: globals go at exit
        _close_at_collection(self._cb_close)


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
        completion_ids, logprobs = self._cb_generate(prompt_ids)
        if getattr(self, "tools", None):  # TRL's tool loop extends each completion's logprob list turn by turn
            return completion_ids, as_lists(logprobs)
        # No lists for TRL to pad token by token: `_cb_score` puts the padded (B, T) tensor into the batch instead
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
        replayed = self._cb_async_tool_loop() if self.args.use_transformers_continuous_batching else None
        if replayed is not None:
            return replayed
        return super()._tool_call_loop(
            prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
        )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        return self._cb_score(inputs)


class RLOOTrainer(ContinuousBatchingTrainerMixin, trl.RLOOTrainer):
    """TRL's `RLOOTrainer`; with `args.use_transformers_continuous_batching`, rollouts come from trl_cb's engine and
    the (per-sequence) loss is importance-sampling corrected (see `RLOOConfig`)."""

    _cb_per_token_loss = False

    def _generate_single_turn(
        self, prompt_ids: list[list[int]], images: Any, multimodal_fields: dict[str, Any]
    ) -> list[list[int]]:
        if not self.args.use_transformers_continuous_batching:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
        completion_ids, _ = self._cb_generate(prompt_ids)
        return completion_ids

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        return self._cb_score(inputs)
