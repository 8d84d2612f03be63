"""`ContinuousBatchingGenerator`: the one CB adapter GRPO, RLOO and standalone users share; runs one round.

A round: prompts -> validated (`checks/inputs.py`) -> runs of identical prompts deduped (prefilled once, forked into
their samples) -> the pool's persistent engine (`pool.py`) -> results in the caller's order -> `GenerationResult`.
Guarantees (the reasons and measurements: docs/index.md, "How it works", and docs/architecture.md):
- Order and completeness: prompt i's completions are at `[i*G:(i+1)*G]`; every request comes back or the round raises
  (`GenerationError`, `EngineDiedError`, `TimeoutError`), never fewer or shifted completions.
- Settings apply: each `GenerationConfig` field reaches the sampler exactly or is refused at construction.
- Fresh weights: the prefix cache is cleared every round; the engine reads the live module.
- Training is unaffected: mode, attention implementation, dtypes and values of the module are as before the round
  (`model_access.py`); no engine thread lives between rounds; the caller's RNG is never re-seeded.
- One round at a time per module (`guards.module_lock`, shared with async rollouts); Ctrl-C and `timeout` hard-stop
  the engine and reach the caller within about one forward; `close` is idempotent and interrupt-safe.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import ContinuousBatchingConfig

from ..checks import inputs
from ..checks import model as model_checks
from ..checks.engine_config import cb_kwargs, check_engine_settings
from ..checks.generation_settings import engine_generation_config
from ..engine import _upstream, _upstream_patches, _upstream_sampling, guards
from ..engine.openmp import guard_helps, hold_polite_waits_while_alive
from ..engine.sizing import CacheSize, Workload
from .model_access import ModelAccess, plain_module
from .pool import EnginePool

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

#: How often the collector wakes up to check that the engine thread is still alive.
_POLL_SECONDS = 0.2


@dataclass
class GenerationResult:
    """Completions in the caller's order, with two logprobs per token, both from the sampler's own fp32 logits.

    - `logprobs[i][t]`: log-softmax of the *processed* logits `completion_ids[i][t]` was sampled from (repetition
      penalty and min-length EOS suppression, temperature, then top-k/top-p/min-p/... truncation and
      renormalisation, in `generate()`'s order): the distribution actually sampled.
    - `policy_logprobs[i][t]`: `log_softmax(logits / temperature)` over the whole vocabulary: the quantity TRL's
      trainer computes for the same token. Importance sampling compares the trainer with this one, so the weight
      measures the numerical gap between sampler and trainer (and staleness), not the truncation. Equal to
      `logprobs` when nothing but temperature shapes the distribution.
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    num_generations: int
    timings: dict[str, float] = field(default_factory=dict)
    policy_logprobs: list[list[float]] = field(default_factory=list)


class ContinuousBatchingGenerator:
    """Generate completions and their sampling logprobs with transformers' continuous batching engine.

    Args:
        model: A transformers causal LM, or the same wrapped for training (DDP, FSDP, DeepSpeed, PEFT). With an
            `accelerator`, it is unwrapped the way TRL unwraps for generation (ZeRO-3 parameters gathered, FSDP1
            parameters summoned) for the duration of each round only; FSDP2 (`fully_shard`) parameters are held
            unsharded for the round and resharded after it, with or without an accelerator. Sharded strategies
            must call `generate` on every rank together (as the trainers do).
        generation_config: Sampling settings; `max_new_tokens` is required. Each field is applied exactly or refused
            with `ValueError` here (table: `generation_settings.FIELD_RULES`, docs/index.md). `eos_token_id=None`
            falls back to the model's EOS, as in `generate()`. `num_return_sequences` is ignored: the number of
            samples is `generate(..., num_generations=G)`.
        continuous_batching_config: `ContinuousBatchingConfig` or its kwargs. Unset `num_blocks` /
            `max_batch_tokens` / `page_size` are sized from the workload; `max_memory_percent` defaults to 0.5 and
            caps the cache; `return_logprobs` is always on.
        accelerator: The training `Accelerator`, if any.
        gather_deepspeed3_params: Gather ZeRO-3 parameters for generation (TRL's `ds3_gather_for_generation`).
        cast_dtype: Generate in this dtype (TRL's `bf16`/`fp16`) on copies of the weights; the training module's
            own parameters keep their dtype and values (`engine/precision.py`).
        cast_lm_head_to_fp32: Run the LM head in fp32 during generation (TRL's `cast_lm_head_to_fp32`; tied
            embeddings supported).
        timeout: Seconds a round may take before it is abandoned with `TimeoutError` (`None`: no limit).
        openmp_guard: Parked OpenMP workers sleep instead of spin while this generator lives (`engine/openmp.py`).
            `None`: on for a CPU model with a multi-threaded OpenMP torch, off otherwise (GPU engines).
        keep_generation_weights: Keep the `cast_dtype` copies between rounds (`True`), or make and free them every
            round (`False`). `None`: keep unless the parameters are sharded (ZeRO-3, FSDP). docs/distributed.md.

    Raises:
        checks.model.UnsupportedModelError: (a `ValueError`) at construction, for a model the engine cannot sample from
            exactly (MLA, per-layer head sizes, non-attention layers, dropped attention features; docs/models.md).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig,
        continuous_batching_config: ContinuousBatchingConfig | dict[str, Any] | None = None,
        accelerator: Accelerator | None = None,
        *,
        gather_deepspeed3_params: bool = True,
        cast_dtype: torch.dtype | None = None,
        cast_lm_head_to_fp32: bool = False,
        gradient_checkpointing_kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        openmp_guard: bool | None = None,
        keep_generation_weights: bool | None = None,
    ) -> None:
        inputs.check_type("model", model, torch.nn.Module)
        inputs.check_type("generation_config", generation_config, GenerationConfig)
        inputs.check_type(
            "continuous_batching_config", continuous_batching_config, (dict, ContinuousBatchingConfig), True
        )
        inputs.check_type("cast_dtype", cast_dtype, torch.dtype, optional=True)
        inputs.check_type("timeout", timeout, numbers.Real, optional=True)
        for name, flag in (("gather_deepspeed3_params", gather_deepspeed3_params),
                           ("cast_lm_head_to_fp32", cast_lm_head_to_fp32)):  # fmt: skip
            inputs.check_type(name, flag, bool)
        for name, flag in (("openmp_guard", openmp_guard), ("keep_generation_weights", keep_generation_weights)):
            inputs.check_type(name, flag, bool, optional=True)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}.")
        self._model = ModelAccess(
            model,
            accelerator,
            gather_deepspeed3_params,
            gradient_checkpointing_kwargs,
            cast_dtype,
            cast_lm_head_to_fp32,
            keep_generation_weights,
        )
        # Refuse now what the engine cannot serve exactly (checks/model.py); with sharded parameters the attention
        # probe runs at the first round instead, on the gathered module, before anything is submitted.
        self._model_checked = model_checks.check_model(plain_module(model))
        self.timeout = timeout
        self.generation_config = engine_generation_config(generation_config)
        self._pool = EnginePool(cb_kwargs(continuous_batching_config), stable_weights=self._model.stable_weights)
        check_engine_settings(self._pool.cb_kwargs, self.generation_config)
        self._round = 0
        #: Held for a whole round and by `close`: a close from another thread waits for the round to end.
        self._lock = threading.RLock()
        if guard_helps(plain_module(model).device) if openmp_guard is None else openmp_guard:
            hold_polite_waits_while_alive(self)  # OpenMP threads sleep, not spin, while we live (engine/openmp.py)
        guards.close_at_exit(self)

    @property
    def model(self) -> torch.nn.Module:
        """The model as given (possibly wrapped for training)."""
        return self._model.model

    @property
    def accelerator(self) -> Accelerator | None:
        """The training `Accelerator` given, if any."""
        return self._model.accelerator

    @property
    def num_engine_builds(self) -> int:
        """Engines built so far (a persistent engine keeps this at 1 across training steps)."""
        return self._pool.num_builds

    # ------------------------------------------------------------------------------------------------ public API

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        num_generations: int = 1,
        generation_config: GenerationConfig | None = None,
    ) -> GenerationResult:
        """Sample `num_generations` completions for each prompt; prompt i's are at `[i*G:(i+1)*G]`.

        `generation_config`, if given, replaces the generator's settings from this round on (the engine is rebuilt
        when sampling settings differ).
        """
        inputs.check_type("num_generations", num_generations, numbers.Integral)
        inputs.check_type("generation_config", generation_config, GenerationConfig, optional=True)
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
            raise TypeError(f"prompt_ids must be a sequence of token-id sequences, got {type(prompt_ids).__name__}.")
        if num_generations <= 0:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
        lock = guards.module_lock(self._model.lock_key())
        with guards.acquired(lock, self.timeout), guards.acquired(self._lock, self.timeout, "this generator"):
            if generation_config is not None:
                self.generation_config = self.checked_generation_config(generation_config)
            if len(prompt_ids) == 0:
                return GenerationResult(
                    completion_ids=[], logprobs=[], num_generations=num_generations, policy_logprobs=[]
                )
            prompts = [p.tolist() if hasattr(p, "tolist") else list(p) for p in prompt_ids]  # tensors / arrays too
            with self._model.generation_module() as module:
                return self._generate_on(module, prompts, num_generations)

    def checked_generation_config(self, generation_config: GenerationConfig) -> GenerationConfig:
        """The engine's form of `generation_config`; `ValueError` for settings it cannot apply exactly. Pure."""
        config = engine_generation_config(generation_config)
        check_engine_settings(self._pool.cb_kwargs, config)
        return config

    def validate_prompts(
        self, prompts: list[list[int]], module: PreTrainedModel, indices: Sequence[int] | None = None
    ) -> None:
        """`ValueError` for prompts this generator's engine would mangle (`checks/inputs.py`), e.g. before they are
        submitted by a caller that drives the engine itself (async rollouts)."""
        max_new_tokens = int(self.generation_config.max_new_tokens)
        inputs.validate_prompts(prompts, module, max_new_tokens, self._pool.cb_kwargs, indices=indices)

    def engine_for(
        self,
        module: PreTrainedModel,
        workload: Workload,
        before_start: Callable[[Any], None] | None = None,
        share_prefixes: bool = False,
    ) -> _upstream.ContinuousBatchingManager:
        """The running engine for `module` sized for `workload`, for async rollouts (the caller holds the module lock
        while it may run, stops it with `close`); `before_start` runs before its thread starts. Block sharing only with
        `share_prefixes`, hashes chained from the weight epoch the caller bumps at each update (`_upstream_prefix`)."""
        with guards.acquired(self._lock, what="this generator"):
            self._pool.cb_kwargs["allow_block_sharing"] = share_prefixes and _upstream_patches.install_epoch_hashes()
            was_training = module.training
            try:
                engine = self._pool.ensure(module, workload, self.generation_config)
                with guards.deferred_interrupts():
                    engine.busy = True  # requests stay in flight across calls: never reused by a `generate` round
                    if before_start is not None:
                        before_start(engine.manager)
                    _upstream.resume(engine.manager, module)  # the caller drives pauses from here on
                return engine.manager
            finally:
                module.train(was_training)  # the engine's constructor calls module.eval()

    def generation_weights(self, module: PreTrainedModel) -> contextlib.AbstractContextManager[None]:
        """Point `module`'s tensors at the generation-dtype copies (refreshed from its weights) until exit, for
        callers that drive the engine themselves (async rollouts): enter before the engine runs, exit once it is
        paused. A no-op without `cast_dtype` / `cast_lm_head_to_fp32`. See `engine/precision.py`."""
        return self._model.generation_weights(module)

    def close(self) -> None:
        """Hard-stop the engine thread (outstanding requests are abandoned), free its cache and the generation copies
        of the weights (`engine/precision.py`).

        Idempotent and interrupt-safe: SIGINT is deferred until the thread has exited; the engine is forgotten only
        once its thread is gone and the model's attention implementation is restored (restoring it earlier would
        crash an eager model's engine mid-forward). A later `generate` builds a new engine."""
        with guards.deferred_interrupts(), self._lock:
            self._pool.stop()
            self._pool.free_retired()
            self._model.precision.release()

    def _close_at_exit(self) -> None:
        """Interpreter exit: close unless another thread's round holds the engine (it ends when its thread does)."""
        if self._pool.holds_resources and self._lock.acquire(timeout=10):
            try:
                self._pool.stop()
                self._pool.free_retired()
            finally:
                self._lock.release()

    def __enter__(self) -> ContinuousBatchingGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _close_at_collection=guards.close_at_collection) -> None:  # bound now: globals go at exit
        _close_at_collection(self.close)

    @property
    def generation_copy_bytes(self) -> int:
        """Bytes held between rounds by the generation-dtype copies of the weights (0 when made per round)."""
        return self._model.precision.copy_bytes

    @property
    def cache_size(self) -> CacheSize | None:
        """The engine's current cache geometry (`None` before the first round or after `close`)."""
        engine = self._pool.engine
        return None if engine is None else engine.size

    # ------------------------------------------------------------------------------------------------ internals

    def _generate_on(
        self, module: PreTrainedModel, prompts: list[list[int]], num_generations: int
    ) -> GenerationResult:
        t0 = time.perf_counter()
        if not self._model_checked:
            self._model_checked = model_checks.check_model(module)
        gen_cfg = self.generation_config
        max_new_tokens = int(gen_cfg.max_new_tokens)
        groups, first_index = _dedupe(prompts, num_generations)
        self.validate_prompts([p for p, _ in groups], module, indices=first_index)
        workload = Workload(
            num_requests=len(prompts) * num_generations,
            max_prompt_len=max(len(p) for p in prompts),
            max_new_tokens=max_new_tokens,
            prefill_tokens=sum(len(p) for p, _ in groups),
            num_prompts=len(groups),
        )
        engine = self._pool.ensure(module, workload, gen_cfg)  # no engine thread runs when this returns
        t_engine = time.perf_counter()

        self._round += 1
        manager = engine.manager
        module.eval()
        # From here until the thread is suspended again, SIGINT is recorded and raised by `_collect` (or on exit):
        # an interrupt can then never land between starting the thread and keeping its handle, or inside cleanup.
        with guards.deferred_interrupts() as interrupts:
            try:
                engine.busy = True
                # Weights may have changed since the last round: drop cached KV blocks and the prefix ledger.
                _upstream.reset_prefix_cache(manager)
                _upstream.resume(manager, module)
                slots = _submit(manager, groups, max_new_tokens, gen_cfg.do_sample, self._round)
                outputs = _collect(manager, slots, interrupts, self.timeout)
                _upstream.suspend(manager)  # no engine thread between rounds (see `_upstream.suspend`)
                _upstream.restore_training_attention(manager)
                engine.busy = False
            except BaseException:
                # A failed or interrupted round may leave requests in the engine: hard-stop it, never reuse it.
                self._pool.stop()
                raise

        completion_ids, logprobs, policy_logprobs = _assemble(groups, slots, outputs, greedy=not gen_cfg.do_sample)
        t_end = time.perf_counter()
        return GenerationResult(
            completion_ids=completion_ids,
            logprobs=logprobs,
            num_generations=num_generations,
            timings={"engine_setup_s": t_engine - t0, "generate_s": t_end - t_engine},
            policy_logprobs=policy_logprobs,
        )


def _submit(
    manager: _upstream.ContinuousBatchingManager,
    groups: list[tuple[list[int], int]],
    max_new_tokens: int,
    do_sample: bool,
    round_index: int,
) -> list[list[str]]:
    """Each group's prompt, prefilled once and forked into its samples (one request when greedy); their ids."""
    slots = []
    for index, (prompt, count) in enumerate(groups):
        samples, request_id = (count if do_sample else 1), f"r{round_index}_p{index}"
        slots.append(_upstream.add_forked_request(manager, prompt, request_id, samples, max_new_tokens))
    return slots


def _dedupe(prompts: list[list[int]], num_generations: int) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Runs of identical prompts as (prompt, samples) groups, and where each run starts in `prompts`: TRL repeats
    each prompt G times; each run is prefilled (and validated) once."""
    groups: list[tuple[list[int], int]] = []
    first_index: list[int] = []
    for i, prompt in enumerate(prompts):
        if groups and groups[-1][0] == prompt:
            groups[-1] = (prompt, groups[-1][1] + num_generations)
        else:
            groups.append((prompt, num_generations))
            first_index.append(i)
    return groups, first_index


def _assemble(
    groups: list[tuple[list[int], int]], slots: list[list[str]], outputs: dict[str, Any], greedy: bool
) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Completions, processed and policy logprobs in the caller's order (each group's samples in a row)."""
    completion_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    policy_logprobs: list[list[float]] = []
    for (_, count), request_ids in zip(groups, slots, strict=True):
        for rid in request_ids:
            out = outputs[rid]
            processed, policy = _upstream_sampling.output_logprobs(out)
            completion_ids.append(list(out.generated_tokens))
            logprobs.append(processed)
            policy_logprobs.append(policy)
        if greedy:  # greedy: one request per prompt, replicated (identical by definition)
            for rows in (completion_ids, logprobs, policy_logprobs):
                rows.extend([rows[-1][:] for _ in range(count - 1)])
    return completion_ids, logprobs, policy_logprobs


def _collect(
    manager: _upstream.ContinuousBatchingManager,
    slots: list[list[str]],
    interrupts: guards.InterruptShield,
    timeout: float | None,
) -> dict[str, Any]:
    """Every result of this round's requests (`slots`), or the reason why not: Ctrl-C, timeout, a failed request,
    a dead engine. Results of earlier rounds' requests are dropped."""
    expected = {rid for request_ids in slots for rid in request_ids}
    outputs: dict[str, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(outputs) < len(expected):
        interrupts.check()  # a Ctrl-C recorded since the last result: abort now (the caller hard-stops)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"Continuous batching round did not finish within {timeout} s.")
        result = manager.get_result(timeout=_POLL_SECONDS)
        if result is None:
            _upstream.check_alive(
                manager, f"with {len(expected) - len(outputs)} of {len(expected)} requests outstanding"
            )
            continue
        if result.request_id not in expected:
            logger.warning("Dropping a stale result for request %s from an earlier round.", result.request_id)
            continue
        if _upstream.finished_output(result) is not None:
            outputs[result.request_id] = result
    return outputs
