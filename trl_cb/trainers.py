"""`GRPOTrainer` and `RLOOTrainer`: TRL's trainers with the CB path routed through one shared adapter.

Hops (file per hop): prompts -> `ContinuousBatchingGenerator` (generator.py) -> completions + sampling logprobs ->
TRL scores them -> `ContinuousBatchingTrainerMixin._cb_importance_sampling` weights the policy-gradient term
(importance_sampling.py) -> TRL's loss. With `async_generation`, `AsyncRolloutController` (async_rollouts.py) replaces
the per-step generation call: finished groups, and the dataset rows they came from, go through the same scoring.

How the IS weight reaches the loss: TRL multiplies its loss by an IS ratio only on the vLLM path. Both trainers'
policy terms are `-min(c * A, clip(c) * A)` (or another form linear in A), so for a non-negative weight w,
`w * term(A) == term(w * A)`. We therefore fold w into the advantages, which TRL documents as accepting shape (B, T)
for exactly this kind of extension; VESPO, which consumes the ratio itself, gets it as `importance_sampling_ratio`.
The KL term is not weighted (as in TRL). When the weights cannot change between scoring and the loss, the ratio's
old-policy logprobs are those of TRL's own loss forward (`_compute_loss`; no extra forward). Only these overrides touch
TRL internals; `tests/unit/test_contracts.py` pins them: `_generate_single_turn`, `_generate_and_score_completions`'
output keys, `_get_per_token_logps_and_entropies`, `_compute_loss`'s call order, `_metrics`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
import trl
from transformers import ProcessorMixin, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from trl.extras.profiling import profiling_context
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanmax, nanmin, pad

from . import compat, lifecycle
from .async_rollouts import AsyncRolloutController, PromptStream, RolloutGroup, default_max_staleness
from .generator import ContinuousBatchingGenerator, plain_module, validate_generation_settings, validate_prompts
from .importance_sampling import importance_sampling_ratio, importance_sampling_stats
from .upstream_warnings import quiet_trl_gradient_checkpointing

logger = logging.getLogger(__name__)

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

#: Per-process async state saved in each checkpoint directory (the prompt stream's resume position).
ASYNC_STATE_FILE = "trl_cb_async_state-rank{rank}.json"
#: Prompts tokenized per batch when the dataset is scanned for its longest prompt.
_SCAN_BATCH = 256


class ContinuousBatchingTrainerMixin:
    """Everything GRPO and RLOO share on the CB path: the persistent generator, IS correction, lifecycle."""

    _cb_generator: ContinuousBatchingGenerator | None = None
    #: Whether the trainer's loss is per token (GRPO: the IS weight may be (B, T)) or per sequence (RLOO: (B,)).
    _cb_per_token_loss: bool
    _cb_last_logprobs: list[list[float]] | None = None
    _cb_async: AsyncRolloutController | None = None
    _cb_async_groups: list[RolloutGroup] | None = None
    #: Stream position the next async controller starts from (advanced when a controller stops; set on resume).
    _cb_async_start: int = 0
    _cb_async_longest: int | None = None

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
        except Exception:  # TRL's own loading reports an unreachable model
            return
        compat.check_config(config)

    def _cb_check_model(self) -> None:
        """After TRL built the model: refuse what the engine cannot serve exactly (trl_cb/compat.py), at
        construction rather than as a failed request at the first step."""
        if self.args.use_transformers_continuous_batching:
            compat.check_model(plain_module(self.model))

    # ---------------------------------------------------------------------------------------------- generation

    def _cb_get_generator(self) -> ContinuousBatchingGenerator:
        """The trainer's one generator, built at the first generation and kept across steps."""
        wrapped = self.model_wrapped
        if self._cb_generator is not None and self._cb_generator.model is not wrapped:
            # The training wrapper changed (e.g. eval before train, then accelerate.prepare): new generator.
            self._cb_generator.close()
            self._cb_generator = None
        if self._cb_generator is None:
            args = self.args
            self._cb_generator = ContinuousBatchingGenerator(
                wrapped,
                self.generation_config,
                continuous_batching_config=args.transformers_continuous_batching_config,
                accelerator=self.accelerator,
                gather_deepspeed3_params=args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
                timeout=args.cb_generation_timeout,
                **self._cb_precision_kwargs(),
            )
        return self._cb_generator

    def _cb_precision_kwargs(self) -> dict[str, Any]:
        """Generation dtype as TRL's CB path picks it (`bf16`/`fp16`, fp32 LM head); applied to copies of the weights,
        never to the training module (`trl_cb/precision.py`)."""
        args = self.args
        return {
            "cast_dtype": torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None,
            "cast_lm_head_to_fp32": bool(getattr(args, "cast_lm_head_to_fp32", False)),
        }

    def _cb_generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """Completions and sampling logprobs for TRL's prompt list (each prompt already repeated per sample)."""
        if self._cb_async_groups is not None:
            return self._cb_async_completions(prompt_ids)
        generator = self._cb_get_generator()
        with profiling_context(self, "trl_cb.generate"):
            result = generator.generate(prompt_ids, num_generations=1)
        self._cb_last_logprobs = result.logprobs
        return result.completion_ids, result.logprobs

    def _cb_close(self) -> None:
        """Stop async rollouts and the generator (hard stop: nothing in flight is generated); interrupt-safe."""
        with lifecycle.deferred_interrupts():
            controller = self._cb_async
            if controller is not None:
                controller.stop()
                self._cb_async_start = self._cb_async_position()
                self._cb_async = None
            generator = self._cb_generator
            if generator is not None:
                generator.close()
                self._cb_generator = None

    # ------------------------------------------------------------------------------------------ async rollouts

    def _cb_async_setup(self) -> None:
        """Called at the end of `__init__`: refuse unsupported setups early and hook weight updates."""
        args = self.args
        if not getattr(args, "async_generation", False):
            return
        ds_plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_fsdp_enabled or (ds_plugin is not None and ds_plugin.zero_stage == 3):
            raise ValueError(
                "async_generation runs the engine on local, unsharded parameters: use a single process or DDP "
                "(ZeRO-3 and FSDP shard parameters between steps)."
            )
        if getattr(self, "tools", None):
            raise ValueError("async_generation does not support tool calling (multi-turn rollouts).")
        trainer = self

        class _PauseEngineForOptimizerStep(TrainerCallback):
            """The optimizer mutates weights in place: the engine must not run a forward meanwhile."""

            def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
                if trainer._cb_async is not None:
                    trainer._cb_async.begin_weight_update()

            def on_optimizer_step(self, *a: Any, **k: Any) -> None:
                if trainer._cb_async is not None:
                    trainer._cb_async.end_weight_update()

        class _SaveAsyncState(TrainerCallback):
            """Write the prompt stream's position into each checkpoint (`Trainer` calls `on_save` right after
            `_save_checkpoint` has written `checkpoint-<global_step>`)."""

            def on_save(self, args: Any, state: Any, control: Any, **k: Any) -> None:
                folder = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
                trainer._cb_save_async_state(os.path.join(args.output_dir, folder))

        self.add_callback(_PauseEngineForOptimizerStep())
        self.add_callback(_SaveAsyncState())

    def _cb_async_position(self) -> int:
        """Stream position of the first prompt no finished step has consumed (see `PromptStream`)."""
        controller = self._cb_async
        return self._cb_async_start + (controller.consumed_groups if controller is not None else 0)

    def _cb_save_async_state(self, checkpoint_dir: str) -> None:
        if not os.path.isdir(checkpoint_dir):
            logger.warning("No checkpoint directory %s: async rollout state not saved.", checkpoint_dir)
            return
        state = {"stream_position": self._cb_async_position(), "seed": self._cb_stream_seed()}
        path = os.path.join(checkpoint_dir, ASYNC_STATE_FILE.format(rank=self.accelerator.process_index))
        with open(path, "w") as f:
            json.dump(state, f)

    def _cb_load_async_state(self, checkpoint_dir: str) -> None:
        path = os.path.join(checkpoint_dir, ASYNC_STATE_FILE.format(rank=self.accelerator.process_index))
        if not os.path.isfile(path):
            logger.warning(
                "Resuming async rollouts from %s without saved stream state: the prompt stream restarts.",
                checkpoint_dir,
            )
            self._cb_async_start = 0
            return
        with open(path) as f:
            state = json.load(f)
        if state.get("seed") != self._cb_stream_seed():
            logger.warning("The checkpoint's prompt stream used another seed: its position is applied as is.")
        self._cb_async_start = int(state["stream_position"])
        logger.info("Async rollouts resume the prompt stream at item %d.", self._cb_async_start)

    def _cb_stream_seed(self) -> int:
        return self.args.seed * 1000 + self.accelerator.process_index

    def _cb_prompt_stream(self, start: int) -> PromptStream:
        """Endless shuffled stream of (dataset row, prompt ids), distinct per process, reproducible from the seed,
        starting at item `start` (a resumed run continues where the checkpoint left off)."""
        dataset = self.train_dataset

        def fetch(index: int) -> tuple[Any, list[int]]:
            row = dataset[index]
            return row, self._tokenize_prompts([row["prompt"]])[0][0]

        return PromptStream(len(dataset), self._cb_stream_seed(), fetch, start=start)

    def _cb_scan_prompts(self, module: torch.nn.Module, max_new_tokens: int, cb_kwargs: dict[str, Any]) -> int:
        """Tokenize and validate every prompt of `train_dataset` (the synchronous checks, naming the row) and return
        the longest prompt's length: the async engine is sized for it, so no row can fail to be scheduled later."""
        dataset = self.train_dataset
        t0 = time.perf_counter()
        longest = 0
        for begin in range(0, len(dataset), _SCAN_BATCH):
            rows = [dataset[i]["prompt"] for i in range(begin, min(begin + _SCAN_BATCH, len(dataset)))]
            ids = [list(p) for p in self._tokenize_prompts(rows)[0]]
            try:
                validate_prompts(ids, module, max_new_tokens, cb_kwargs)
            except ValueError as err:
                raise ValueError(f"train_dataset rows {begin}..{begin + len(ids) - 1}: {err}") from None
            longest = max(longest, max(len(p) for p in ids))
        logger.info(
            "Scanned %d prompts in %.2fs: the longest has %d tokens.", len(dataset), time.perf_counter() - t0, longest
        )
        return longest

    def _cb_async_controller(self) -> AsyncRolloutController:
        """The async controller, built (and its engine filled) the first time a training step needs it."""
        if self._cb_async is None:
            args = self.args
            generator = ContinuousBatchingGenerator(
                self.model_wrapped,
                self.generation_config,
                continuous_batching_config=args.transformers_continuous_batching_config,
                timeout=args.cb_generation_timeout,
                **self._cb_precision_kwargs(),
            )
            rows_per_step = args.generation_batch_size // self.accelerator.num_processes
            module = plain_module(self.model_wrapped)
            if self._cb_async_longest is None:
                max_new = int(generator.generation_config.max_new_tokens)
                self._cb_async_longest = self._cb_scan_prompts(module, max_new, generator._cb_kwargs)
            controller = AsyncRolloutController(
                generator,
                module,
                self._cb_prompt_stream(self._cb_async_start),
                num_generations=self.num_generations,
                groups_per_step=rows_per_step // self.num_generations,
                prefetch_depth=args.prefetch_depth,
                max_staleness=self._cb_max_staleness(),
                keep_stale=args.async_keep_stale,
                timeout=args.cb_generation_timeout,
            )
            controller.start(max_prompt_len=self._cb_async_longest)
            self._cb_async = controller
        return self._cb_async

    def _cb_max_staleness(self) -> int:
        """`args.max_staleness`, or (unset) the bound that drops nothing for this schedule: rollouts are taken once
        every `steps_per_generation * num_iterations / gradient_accumulation_steps` optimizer steps."""
        args = self.args
        if args.max_staleness is not None:
            return args.max_staleness
        steps_per_take = args.steps_per_generation * self.num_iterations / args.gradient_accumulation_steps
        return default_max_staleness(args.prefetch_depth, steps_per_take)

    def _cb_async_take(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Replace the sampler's rows by those of finished groups; stash the groups for `_generate_single_turn`."""
        controller = self._cb_async_controller()
        num_groups = len(inputs) // self.num_generations
        if num_groups != controller.groups_per_step:
            raise RuntimeError(
                f"Async rollouts expected {controller.groups_per_step} groups per step, got {num_groups}."
            )
        with profiling_context(self, "trl_cb.async_wait"):
            groups, metrics = controller.take(num_groups)
        for name, value in metrics.as_dict().items():
            self._metrics["train"][name].append(value)
        self._cb_async_groups = groups
        return [group.row for group in groups for _ in range(self.num_generations)]

    def _cb_async_completions(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        groups, G = self._cb_async_groups, self.num_generations
        expected = [g.prompt_ids for g in groups for _ in range(G)]
        if [list(p) for p in prompt_ids] != expected:
            raise RuntimeError("Async rollouts are out of step with the prompts TRL tokenized (multi-turn?).")
        completion_ids = [c for g in groups for c in g.completion_ids]
        logprobs = [lp for g in groups for lp in g.logprobs]
        self._cb_last_logprobs = logprobs
        return completion_ids, logprobs

    def _cb_async_active(self) -> bool:
        return bool(getattr(self.args, "async_generation", False) and self.model.training)

    @quiet_trl_gradient_checkpointing()  # TRL's generation/scoring helpers call transformers' deprecated names
    def _cb_score(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's scoring of `inputs` (or, in async mode, of finished groups), then IS correction."""
        self._cb_last_logprobs = None
        if self._cb_async_active():
            inputs = self._cb_async_take(inputs)
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._cb_async_groups = None
        if self._cb_uses_is():
            if self._cb_can_defer_is(output):
                # The loss forward computes these same logprobs with the same weights; the ratio is applied there.
                output[_DEFERRED_IS_KEY] = self._cb_sampling_logps(output)
            else:
                self._cb_importance_sampling(output, per_token_loss=self._cb_per_token_loss)
        return output

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """TRL's `train`, with the CB engine stopped at the end, on errors and on Ctrl-C (no thread left behind), and
        async rollouts resuming their prompt stream from the checkpoint's saved position."""
        if getattr(self.args, "async_generation", False) and resume_from_checkpoint:
            checkpoint = resume_from_checkpoint
            if isinstance(checkpoint, bool):  # as `Trainer.train` resolves it
                checkpoint = get_last_checkpoint(self.args.output_dir)
            if checkpoint is not None:
                self._cb_load_async_state(checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._cb_close()

    def __del__(self) -> None:
        try:
            self._cb_close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    # ------------------------------------------------------------------------------------- importance sampling

    def _cb_sampling_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """(B, T) sampling logprobs aligned with `output["completion_ids"]`."""
        if "sampling_per_token_logps" in output:  # GRPO pads them itself (tool turns included)
            return output["sampling_per_token_logps"]
        assert self._cb_last_logprobs is not None, "CB path produced no logprobs for this batch"
        width = output["completion_ids"].size(1)
        rows = [torch.tensor(lp, dtype=torch.float32) for lp in self._cb_last_logprobs]
        padded = pad(rows, padding_value=0.0, padding_side="right")
        padded = torch.nn.functional.pad(padded, (0, width - padded.size(1)))
        return padded.to(output["completion_ids"].device)

    def _cb_old_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """(B, T) training-policy logprobs of the sampled tokens (reused when TRL computed them)."""
        if output.get("old_per_token_logps") is not None:
            return output["old_per_token_logps"]
        prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            old, _, _ = self._get_per_token_logps_and_entropies(
                self.model, prompt_completion_ids, attention_mask, output["completion_ids"].size(1), batch_size
            )
        return old

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
        name = "_get_per_token_logps_and_entropies"
        applied = False
        original = getattr(self, name)
        shadowed = self.__dict__.get(name)  # an instance attribute already there (a user's patch) is put back

        def restore() -> None:
            if shadowed is None:
                self.__dict__.pop(name, None)
            else:
                self.__dict__[name] = shadowed

        def with_correction(*args: Any, **kwargs: Any) -> Any:
            nonlocal applied
            restore()  # one call only: the loss forward is TRL's first call in `_compute_loss`
            result = original(*args, **kwargs)
            self._cb_importance_sampling(
                inputs, per_token_loss=self._cb_per_token_loss, old=result[0].detach(), sampling=sampling
            )
            applied = True
            return result

        self.__dict__[name] = with_correction
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            restore()
        if not applied:  # never silently train without the correction
            raise RuntimeError(
                "trl_cb: TRL's loss did not compute the policy's logprobs through `_get_per_token_logps_and_entropies`"
                "; the deferred importance-sampling correction could not be applied."
            )
        return loss

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
            [ranks[:, 0].mean(), ranks[:, 1].max(), nanmin(ranks[:, 2]), ranks[:, 3].nanmean(), nanmax(ranks[:, 4])]
        ).tolist()
        metrics = self._metrics[mode]
        for name, value in zip(IS_METRIC_NAMES, reduced, strict=True):
            metrics[name].append(value)

    def _cb_uses_is(self) -> bool:
        return bool(self.args.use_transformers_continuous_batching and self.args.cb_importance_sampling_correction)


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
        return self._cb_generate(prompt_ids)

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
