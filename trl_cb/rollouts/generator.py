"""`ContinuousBatchingGenerator`: the one CB adapter GRPO, RLOO and standalone users share.

Data path of one round: prompts -> `validate` (clear errors before anything reaches the engine) -> dedupe (each
unique prompt is prefilled once and forked into its samples) -> persistent engine -> results mapped back to the
caller's order -> `GenerationResult` (ids + sampling logprobs, same lengths).

Guarantees:
- Order: prompt i's completions are at `[i*G:(i+1)*G]`; consecutive identical prompts (TRL's repeated groups) are
  treated as one prompt with more samples, and the output order is still the input order.
- Completeness: every request of a round comes back, or the round raises (`GenerationError` names the request and
  its cause; `EngineDiedError` when the engine thread is gone). Never fewer, never shifted completions.
- Fresh weights: the engine reads the live module; the prefix cache is cleared at the start of every round, so no
  KV block computed with older weights is reused.
- Settings apply: every `GenerationConfig` field reaches the sampler exactly or is refused with `ValueError` at
  construction (`generation_settings.py`); the engine is rebuilt when the sampling settings or the module change,
  and re-sized (grown, with a log line) when a workload needs more cache than it has.
- Training is unaffected: the module's train/eval mode and attention implementation are restored after each round,
  a bf16/fp16 round runs on copies of the weights (the module's parameters keep their dtype and exact values;
  `precision.py`), and the engine's thread is stopped between rounds; OpenMP threads sleep rather than spin while
  the generator lives, so CPU training stays fast on a loaded machine with or without an engine thread
  (`openmp.py`).
- The caller's global RNG is never re-seeded; two rounds on the same prompts sample differently.
- One round at a time per module (`lifecycle.module_lock`, shared with async rollouts): a concurrent caller, from
  another thread or another generator on the same model, waits (at most `timeout`), never corrupts this round.
- Prompt abort: Ctrl-C and `timeout` hard-stop the engine (outstanding requests are abandoned, not generated) and
  reach the caller within about one forward pass. SIGINT is deferred while the engine thread may run and raised
  once it has exited and the model is restored, so a second Ctrl-C during cleanup cannot orphan the thread; the
  engine handle is dropped only after its thread is gone, and `close` is idempotent.
- A failed engine build leaves the model's attention implementation and train/eval mode as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import ContinuousBatchingConfig

from ..checks import model as compat
from ..checks.generation_settings import (
    engine_generation_config,
    eos_token_ids,
    request_processor_settings,
    sampling_signature,
    without_trl_cb_fields,
)
from ..engine import _upstream
from ..engine import guards as lifecycle
from ..engine.openmp import guard_helps, hold_polite_waits_while_alive
from ..engine.precision import GenerationPrecision
from ..engine.request_processors import build_request_processors
from ..engine.sizing import CacheSize, Workload, default_page_size, size_cache
from ..errors import EngineDiedError, GenerationError

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

#: CB-config keys that must be off for what reads each step on the host: trl_cb's per-request processors and the
#: policy-logprob recorder (`_upstream._require_synchronous`).
_SYNC_ONLY_KEYS = ("use_cuda_graph", "use_async_batching", "varlen_compile_config", "decode_compile_config")
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


@dataclass
class _Engine:
    manager: _upstream.ContinuousBatchingManager
    module: PreTrainedModel  # held so that `id(module)` in `signature` cannot be reused by another object
    signature: tuple[Any, ...]
    workload: Workload
    size: CacheSize
    #: A round owns the engine (thread running, requests possibly in flight); cleared once it is suspended clean.
    busy: bool = False


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
            own parameters keep their dtype and values (`trl_cb/precision.py`).
        cast_lm_head_to_fp32: Run the LM head in fp32 during generation (TRL's `cast_lm_head_to_fp32`; tied
            embeddings supported).
        timeout: Seconds a round may take before it is abandoned with `TimeoutError` (`None`: no limit).
        openmp_guard: Make the process's parked OpenMP workers sleep instead of spin while this generator lives
            (`trl_cb/openmp.py`): much faster CPU training on a loaded machine, 5-10% slower on an idle one. `None`:
            on for a CPU model with a multi-threaded OpenMP torch, off otherwise (GPU engines).
        keep_generation_weights: Keep the `cast_dtype` copies of the weights between rounds (`True`: refreshed in
            place, stable addresses, held all the time) or make and free them every round (`False`). `None`: keep
            unless the parameters are sharded (ZeRO-3, FSDP), where a kept copy would be the full model per rank.

    Raises:
        compat.UnsupportedModelError: (a `ValueError`) at construction, for a model the engine cannot sample from
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
        if accelerator is not None and not gather_deepspeed3_params and _zero_stage(accelerator) == 3:
            raise ValueError(
                "ds3_gather_for_generation=False is not supported with continuous batching: the engine's forwards "
                "would run ZeRO-3's per-layer all-gathers from its own thread, out of step across ranks (a hang). "
                "Keep ds3_gather_for_generation=True (the default)."
            )
        # Refuse now what the engine cannot serve exactly (trl_cb/compat.py); with sharded parameters the attention
        # probe runs at the first round instead, on the gathered module, before anything is submitted.
        self._compat_checked = compat.check_model(plain_module(model))
        self.model = model
        self.accelerator = accelerator
        self.gather_deepspeed3_params = gather_deepspeed3_params
        # Copies of the weights are kept between rounds unless each would be a full copy of a sharded model.
        sharded = _is_sharded(model, accelerator)
        keep = not sharded if keep_generation_weights is None else keep_generation_weights
        self._precision = GenerationPrecision(cast_dtype, cast_lm_head_to_fp32, keep_copies=keep)
        #: Whether the weights the engine reads sit at the same addresses every round: not when they are gathered
        #: (ZeRO-3, FSDP) or copied (per-round generation copies) anew for each round.
        self._stable_weights = not sharded and (keep or cast_dtype is None)
        self.gradient_checkpointing_kwargs = gradient_checkpointing_kwargs
        self.timeout = timeout
        self.generation_config = engine_generation_config(generation_config)
        if guard_helps(plain_module(model).device) if openmp_guard is None else openmp_guard:
            hold_polite_waits_while_alive(self)  # OpenMP threads sleep, not spin, while we live (openmp.py)
        self._cb_kwargs = _cb_kwargs(continuous_batching_config)
        _check_cb_kwargs_for_settings(self._cb_kwargs, self.generation_config)
        self._engine: _Engine | None = None
        self._round = 0
        #: Held for a whole round and by `close`: a close from another thread waits for the round to end.
        self._lock = threading.RLock()
        #: Engines stopped by an aborted round, freed later (`_free_retired`): freeing runs upstream's
        #: `gc.collect()` (~0.75 s measured), which must not delay the exception on its way to the caller.
        self._retired: list[_upstream.ContinuousBatchingManager] = []
        #: Engines built so far (a persistent engine keeps this at 1 across training steps).
        self.num_engine_builds = 0
        lifecycle.close_at_exit(self)

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
        if num_generations <= 0:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
        lock = lifecycle.module_lock(self._lock_key())
        with lifecycle.acquired(lock, self.timeout), lifecycle.acquired(self._lock, self.timeout, "this generator"):
            if generation_config is not None:
                new_config = engine_generation_config(generation_config)
                _check_cb_kwargs_for_settings(self._cb_kwargs, new_config)
                self.generation_config = new_config
            if len(prompt_ids) == 0:
                return GenerationResult(
                    completion_ids=[], logprobs=[], num_generations=num_generations, policy_logprobs=[]
                )
            prompts = [p.tolist() if hasattr(p, "tolist") else list(p) for p in prompt_ids]  # tensors / arrays too
            with self._generation_module() as module:
                return self._generate_on(module, prompts, num_generations)

    def _lock_key(self) -> torch.nn.Module:
        """The module the round lock is keyed by: the plain transformers model, as the async controller keys it."""
        try:
            return plain_module(self.model)
        except Exception:  # noqa: BLE001 - a wrapper `extract_model_from_parallel` does not know: lock the wrapper
            return self.model

    def engine_for(self, module: PreTrainedModel, workload: Workload) -> _upstream.ContinuousBatchingManager:
        """The running engine for `module`, sized for `workload`, for callers that keep requests in flight across
        weight updates (async rollouts). Prefix block sharing is turned off: its cache cannot be cleared while
        requests are in flight, and a shared block computed with old weights must never serve a new prompt.

        The caller holds `lifecycle.module_lock(module)` whenever the engine may run, and stops it with `close`."""
        with lifecycle.acquired(self._lock, what="this generator"):
            self._cb_kwargs["allow_block_sharing"] = False
            was_training = module.training
            try:
                engine = self._ensure_engine(module, workload)
                with lifecycle.deferred_interrupts():
                    engine.busy = True  # requests stay in flight across calls: never reused by a `generate` round
                    _upstream.resume(engine.manager, module)  # the caller drives pauses from here on
                return engine.manager
            finally:
                module.train(was_training)  # the engine's constructor calls module.eval()

    def generation_weights(self, module: PreTrainedModel) -> contextlib.AbstractContextManager[None]:
        """Point `module`'s tensors at the generation-dtype copies (refreshed from its weights) until exit, for
        callers that drive the engine themselves (async rollouts): enter before the engine runs, exit once it is
        paused. A no-op without `cast_dtype` / `cast_lm_head_to_fp32`. See `trl_cb/precision.py`."""
        return self._precision.applied(module)

    def close(self) -> None:
        """Hard-stop the engine thread (outstanding requests are abandoned), free its cache and the generation copies
        of the weights (`precision.py`).

        Idempotent and interrupt-safe: SIGINT is deferred until the thread has exited; the engine is forgotten only
        once its thread is gone and the model's attention implementation is restored (restoring it earlier would
        crash an eager model's engine mid-forward). A later `generate` builds a new engine."""
        with lifecycle.deferred_interrupts(), self._lock:
            self._stop_engine()
            self._free_retired()
            self._precision.release()

    def _stop_engine(self) -> None:
        """Hard-stop the engine's thread, give the model its attention back, and retire the engine (not yet freed).
        The engine is forgotten only once its thread has exited."""
        engine = self._engine
        if engine is None:
            return
        manager = engine.manager
        if not _upstream.stop_now(manager):
            raise EngineDiedError("The continuous batching engine thread did not stop within 60 s; it is kept.")
        _upstream.restore_training_attention(manager)
        self._engine = None
        self._retired.append(manager)

    def _free_retired(self) -> None:
        while self._retired:
            _upstream.release(self._retired.pop())

    def _close_at_exit(self) -> None:
        """Interpreter exit: close unless another thread's round holds the engine (it ends when its thread does)."""
        if (self._engine is not None or self._retired) and self._lock.acquire(timeout=10):
            try:
                self._stop_engine()
                self._free_retired()
            finally:
                self._lock.release()

    def __enter__(self) -> ContinuousBatchingGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at garbage collection
            pass

    @property
    def cache_size(self) -> CacheSize | None:
        """The engine's current cache geometry (`None` before the first round or after `close`)."""
        return None if self._engine is None else self._engine.size

    # ------------------------------------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _generation_module(self) -> Iterator[PreTrainedModel]:
        """Yield the plain transformers module with full parameters, ready for generation; undo on exit."""
        if self.accelerator is not None:
            from trl.models.utils import unwrap_model_for_generation

            unwrap = unwrap_model_for_generation(
                self.model,
                self.accelerator,
                gather_deepspeed3_params=self.gather_deepspeed3_params,
                gradient_checkpointing_kwargs=self.gradient_checkpointing_kwargs,
            )
            summon = _summon_full_params(self.model, self.accelerator)
        else:
            unwrap = contextlib.nullcontext(_extract_module(self.model))
            summon = contextlib.nullcontext()
        with unwrap as unwrapped, torch.no_grad(), summon, _upstream.fsdp2_unsharded(unwrapped):
            module = _base_transformers_model(unwrapped)
            # Generation runs on low-precision copies: the training module keeps its dtypes and exact values.
            with self._precision.applied(module):
                was_training = module.training
                try:
                    yield module
                finally:
                    module.train(was_training)

    def _generate_on(
        self, module: PreTrainedModel, prompts: list[list[int]], num_generations: int
    ) -> GenerationResult:
        t0 = time.perf_counter()
        if not self._compat_checked:
            self._compat_checked = compat.check_model(module)
        gen_cfg = self.generation_config
        max_new_tokens = int(gen_cfg.max_new_tokens)
        # Dedupe runs of identical prompts: TRL repeats each prompt G times; each run is prefilled once (and
        # validated once).
        groups: list[tuple[list[int], int]] = []  # (prompt, number of samples)
        first_index: list[int] = []  # where each run starts in `prompts` (for error messages)
        for i, prompt in enumerate(prompts):
            if groups and groups[-1][0] == prompt:
                groups[-1] = (prompt, groups[-1][1] + num_generations)
            else:
                groups.append((prompt, num_generations))
                first_index.append(i)
        validate_prompts([p for p, _ in groups], module, max_new_tokens, self._cb_kwargs, indices=first_index)
        workload = Workload(
            num_requests=len(prompts) * num_generations,
            max_prompt_len=max(len(p) for p in prompts),
            max_new_tokens=max_new_tokens,
            prefill_tokens=sum(len(p) for p, _ in groups),
        )
        engine = self._ensure_engine(module, workload)  # no engine thread runs when this returns
        t_engine = time.perf_counter()

        self._round += 1
        manager = engine.manager
        module.eval()
        # From here until the thread is suspended again, SIGINT is recorded and raised by `_collect` (or on exit):
        # an interrupt can then never land between starting the thread and keeping its handle, or inside cleanup.
        with lifecycle.deferred_interrupts() as interrupts:
            try:
                engine.busy = True
                _upstream.switch_to_generation_attention(manager, module)
                # Weights may have changed since the last round: drop cached KV blocks and the prefix ledger.
                _upstream.reset_prefix_cache(manager)
                _upstream.resume(manager, module)
                slots = self._submit(manager, groups, max_new_tokens)
                outputs = self._collect(manager, slots, interrupts)
                _upstream.suspend(manager)  # no engine thread between rounds (see `_upstream.suspend`)
                _upstream.restore_training_attention(manager)
                engine.busy = False
            except BaseException:
                # A failed or interrupted round may leave requests in the engine: hard-stop it, never reuse it.
                self._stop_engine()
                raise

        completion_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        policy_logprobs: list[list[float]] = []
        for (_, count), request_ids in zip(groups, slots, strict=True):
            for rid in request_ids:
                out = outputs[rid]
                processed, policy = _upstream.output_logprobs(out)
                completion_ids.append(list(out.generated_tokens))
                logprobs.append(processed)
                policy_logprobs.append(policy)
            if not gen_cfg.do_sample:  # greedy: one request per prompt, replicated (identical by definition)
                for rows in (completion_ids, logprobs, policy_logprobs):
                    rows.extend([rows[-1][:] for _ in range(count - 1)])
        t_end = time.perf_counter()
        return GenerationResult(
            completion_ids=completion_ids,
            logprobs=logprobs,
            num_generations=num_generations,
            timings={"engine_setup_s": t_engine - t0, "generate_s": t_end - t_engine},
            policy_logprobs=policy_logprobs,
        )

    def _submit(
        self, manager: _upstream.ContinuousBatchingManager, groups: list[tuple[list[int], int]], max_new_tokens: int
    ) -> list[list[str]]:
        slots = []
        for index, (prompt, count) in enumerate(groups):
            samples = count if self.generation_config.do_sample else 1
            request_id = f"r{self._round}_p{index}"
            slots.append(_upstream.add_forked_request(manager, prompt, request_id, samples, max_new_tokens))
        return slots

    def _collect(
        self,
        manager: _upstream.ContinuousBatchingManager,
        slots: list[list[str]],
        interrupts: lifecycle.InterruptShield,
    ) -> dict[str, Any]:
        expected = {rid for request_ids in slots for rid in request_ids}
        outputs: dict[str, Any] = {}
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while len(outputs) < len(expected):
            interrupts.check()  # a Ctrl-C recorded since the last result: abort now (the caller hard-stops)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Continuous batching round did not finish within {self.timeout} s.")
            result = manager.get_result(timeout=_POLL_SECONDS)
            if result is None:
                error = _upstream.engine_fatal_error(manager)
                if error is not None or not manager.is_running():
                    raise EngineDiedError(
                        f"The continuous batching engine stopped with {len(expected) - len(outputs)} of "
                        f"{len(expected)} requests outstanding" + (f": {error!r}" if error is not None else ".")
                    ) from error
                continue
            if result.request_id not in expected:
                logger.warning("Dropping a stale result for request %s from an earlier round.", result.request_id)
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise GenerationError(result.request_id, str(result.error))
            outputs[result.request_id] = result
        return outputs

    def _ensure_engine(self, module: PreTrainedModel, workload: Workload) -> _Engine:
        _resolve_eos(self.generation_config, module)
        sharing = self._cb_kwargs.get("allow_block_sharing", True)
        signature = (id(module), module.dtype, sharing, sampling_signature(self.generation_config))
        engine = self._engine
        if engine is not None and engine.busy:
            # An earlier round was cut short (or async rollouts own it): requests may still be in flight.
            logger.info("The continuous batching engine was left mid-round: stopping it and building a new one.")
            self._stop_engine()  # not `close`: the round's generation copies are in use
            engine = None
        if engine is not None and engine.signature == signature:
            if engine.size.holds(self._cache_size(module, workload)):
                return engine
            workload = workload.union(engine.workload)
            logger.info(
                "Workload grew to %d requests of up to %d tokens: re-sizing the continuous batching engine.",
                workload.num_requests,
                workload.max_prompt_len + workload.max_new_tokens,
            )
        elif engine is not None:
            logger.info("Generation settings or model changed: rebuilding the continuous batching engine.")
        self._stop_engine()  # not `close`: the round's generation copies are in use
        self._engine = self._build_engine(module, workload, signature)
        self.num_engine_builds += 1
        return self._engine

    def _cache_size(self, module: PreTrainedModel, workload: Workload) -> CacheSize:
        """The cache geometry for `workload`: the user's settings where given, else sized from the workload."""
        page_size = self._cb_kwargs.get("page_size") or default_page_size(module.device)
        if page_size is None:
            page_size = ContinuousBatchingConfig().page_size
        sized = size_cache(workload, page_size, module.device)
        return CacheSize(
            page_size=page_size,
            num_blocks=self._cb_kwargs.get("num_blocks") or sized.num_blocks,
            max_batch_tokens=self._cb_kwargs.get("max_batch_tokens") or sized.max_batch_tokens,
        )

    def _build_engine(self, module: PreTrainedModel, workload: Workload, signature: tuple[Any, ...]) -> _Engine:
        self._free_retired()  # before allocating a new cache
        kwargs = dict(self._cb_kwargs)
        gen_cfg = self.generation_config
        request_processors = build_request_processors(request_processor_settings(gen_cfg), eos_token_ids(gen_cfg))
        engine_cfg = without_trl_cb_fields(gen_cfg)
        # Truncating or penalising settings: record the trainer-comparable logprob beside the processed one.
        record_policy = bool(request_processors) or _upstream.reshapes_distribution(module, engine_cfg)
        if record_policy:  # both read per-step state on the host: synchronous, uncompiled engine only
            _check_sync_only_keys(
                self._cb_kwargs,
                "the sampling settings truncate or penalise the distribution, so each token's trainer-comparable "
                "logprob is recorded from the host at every step",
            )
            kwargs.update(use_cuda_graph=False, use_async_batching=False)
        if not self._stable_weights:
            # Accelerator graphs replay the addresses they were captured with; a persistent engine would read freed
            # memory from the second round on.
            if self._cb_kwargs.get("use_cuda_graph"):
                raise ValueError(
                    "use_cuda_graph=True needs the weights at the same addresses every round, but they are gathered "
                    "(ZeRO-3/FSDP) or copied per round (cb_keep_generation_weights=False) here: unset "
                    "use_cuda_graph, or keep the generation copies (unsharded models)."
                )
            kwargs["use_cuda_graph"] = False
        size = self._cache_size(module, workload)
        kwargs.update(
            page_size=size.page_size,
            num_blocks=size.num_blocks,
            max_batch_tokens=size.max_batch_tokens,
            return_logprobs=True,
        )
        hints = _upstream.WorkloadHints(
            max_prompt_length=workload.max_prompt_len,
            max_generated_length=workload.max_new_tokens,
            num_requests=workload.num_requests,
        )
        # No `module.eval()` here: the manager's constructor does it, and `create_manager` puts the mode (and the
        # attention implementation) back if construction fails.
        t0 = time.perf_counter()
        try:
            manager = _upstream.create_manager(
                module,
                engine_cfg,
                ContinuousBatchingConfig(**kwargs),
                hints,
                request_processors,
                record_policy,
                check_model=compat.check_model,
            )
        except MemoryError as err:
            raise MemoryError(
                f"The continuous batching cache for this workload ({workload.num_requests} requests of up to "
                f"{workload.max_prompt_len + workload.max_new_tokens} tokens: {size.num_blocks} blocks of "
                f"{size.page_size} tokens) exceeds max_memory_percent={kwargs.get('max_memory_percent')} of free "
                "memory. Lower the per-step batch or max_completion_length, or raise max_memory_percent."
            ) from err
        logger.info(
            "Continuous batching engine ready in %.2fs: %d blocks x %d tokens, max %d tokens per batch.",
            time.perf_counter() - t0,
            size.num_blocks,
            size.page_size,
            size.max_batch_tokens,
        )
        _upstream.restore_training_attention(manager)
        return _Engine(manager=manager, module=module, signature=signature, workload=workload, size=size)


# ---------------------------------------------------------------------------------------------------- helpers


def validate_prompts(
    prompts: list[list[int]],
    module: PreTrainedModel,
    max_new_tokens: int,
    cb_kwargs: dict[str, Any],
    indices: Sequence[int] | None = None,
) -> None:
    """Raise `ValueError` for input the engine would silently mangle (see docs/index.md, "Bad input").

    `indices`: the position of each prompt in the caller's list, for the messages (default: 0, 1, ...)."""
    vocab_size = module.config.get_text_config().vocab_size
    max_positions = getattr(module.config.get_text_config(), "max_position_embeddings", None)
    user_blocks, page_size = cb_kwargs.get("num_blocks"), cb_kwargs.get("page_size")
    for i, prompt in zip(range(len(prompts)) if indices is None else indices, prompts, strict=True):
        if len(prompt) == 0:
            raise ValueError(f"Prompt {i} is empty; continuous batching needs at least one prompt token.")
        for token in prompt:
            if not isinstance(token, numbers.Integral) or isinstance(token, bool):
                raise ValueError(f"Prompt {i} holds {token!r} ({type(token).__name__}); token ids must be integers.")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"Prompt {i} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}).")
        total = len(prompt) + max_new_tokens
        if max_positions is not None and total > max_positions:
            raise ValueError(
                f"Prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that is {total} "
                f"positions, beyond the model's max_position_embeddings={max_positions}."
            )
        if user_blocks is not None and page_size is not None and -(-total // page_size) > user_blocks:
            raise ValueError(
                f"Prompt {i} needs {-(-total // page_size)} cache blocks of {page_size} tokens, but num_blocks="
                f"{user_blocks} was set; raise num_blocks or leave it unset to size the cache from the workload."
            )


def validate_generation_settings(
    generation_config: GenerationConfig, continuous_batching_config: ContinuousBatchingConfig | dict[str, Any] | None
) -> None:
    """`ValueError` for settings the CB path would not apply exactly — what `ContinuousBatchingGenerator` refuses at
    construction, for callers (the trainers) that want the error before any model work."""
    _check_cb_kwargs_for_settings(_cb_kwargs(continuous_batching_config), engine_generation_config(generation_config))


def _resolve_eos(generation_config: GenerationConfig, module: PreTrainedModel) -> None:
    """`eos_token_id=None` means the model's EOS, as in `generate()` (whose config falls back to the model's
    generation config; the engine alone would disable EOS). Ids outside the vocabulary are refused."""
    if generation_config.eos_token_id is None:
        model_eos = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
        if model_eos is None:
            model_eos = getattr(module.config.get_text_config(), "eos_token_id", None)
        if model_eos is not None:
            logger.info("eos_token_id is unset: using the model's EOS %s, as generate() does.", model_eos)
            generation_config.eos_token_id = model_eos
    vocab_size = module.config.get_text_config().vocab_size
    outside = [t for t in eos_token_ids(generation_config) if t >= vocab_size]
    if outside:
        raise ValueError(f"eos_token_id {outside} is outside the model's vocabulary [0, {vocab_size}).")


def _check_cb_kwargs_for_settings(cb_kwargs: dict[str, Any], generation_config: GenerationConfig) -> None:
    """Refuse engine settings under which trl_cb's per-request processors cannot run exactly (before any build)."""
    if request_processor_settings(generation_config).needs_history:
        _check_sync_only_keys(
            cb_kwargs, "repetition_penalty / min_new_tokens / min_length are applied from each request's history"
        )


def _check_sync_only_keys(cb_kwargs: dict[str, Any], why: str) -> None:
    """`ValueError` naming the CB-config keys the user set that would make the engine asynchronous or compiled."""
    conflicting = {key: cb_kwargs[key] for key in _SYNC_ONLY_KEYS if cb_kwargs.get(key) not in (None, False)}
    if cb_kwargs.get("default_compile_level"):
        conflicting["default_compile_level"] = cb_kwargs["default_compile_level"]
    if conflicting:
        raise ValueError(
            f"{why} at every step, which needs the engine's synchronous, uncompiled path; unset "
            f"{sorted(conflicting)} in the continuous batching config, or drop those generation settings."
        )


def _cb_kwargs(config: ContinuousBatchingConfig | dict[str, Any] | None) -> dict[str, Any]:
    if config is None:
        kwargs: dict[str, Any] = {}
    elif isinstance(config, ContinuousBatchingConfig):
        defaults = ContinuousBatchingConfig()
        kwargs = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(defaults, f.name)
        }
    else:
        kwargs = dict(config)
    validate_cb_kwargs(kwargs)
    kwargs.setdefault("max_memory_percent", 0.5)
    return kwargs


def valid_cb_keys() -> list[str]:
    """Keyword arguments `ContinuousBatchingConfig` accepts."""
    return sorted(f.name for f in dataclasses.fields(ContinuousBatchingConfig))


def validate_cb_kwargs(kwargs: dict[str, Any]) -> None:
    """`ValueError` for an unknown key or a `max_memory_percent` outside (0, 1]."""
    unknown = sorted(set(kwargs) - set(valid_cb_keys()))
    if unknown:
        raise ValueError(
            f"Unknown continuous batching config key(s) {unknown}. Valid keys: {', '.join(valid_cb_keys())}."
        )
    mmp = kwargs.get("max_memory_percent")
    if mmp is not None and not (0 < float(mmp) <= 1):
        raise ValueError(f"max_memory_percent must be in (0, 1], got {mmp}.")


def _zero_stage(accelerator: Accelerator) -> int | None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else getattr(plugin, "zero_stage", None)


def _is_sharded(model: torch.nn.Module, accelerator: Accelerator | None) -> bool:
    """Whether parameters are sharded between rounds (ZeRO-3, FSDP): a kept generation copy would be a full one."""
    if accelerator is not None:
        from accelerate.utils import DistributedType

        if _zero_stage(accelerator) == 3 or getattr(accelerator, "distributed_type", None) == DistributedType.FSDP:
            return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _extract_module(model: torch.nn.Module) -> torch.nn.Module:
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def _summon_full_params(model: torch.nn.Module, accelerator: Accelerator) -> contextlib.AbstractContextManager[None]:
    from trl.distributed import DistributedBackend

    return DistributedBackend(accelerator).summon_full_params(model, recurse=False)


def plain_module(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside a training wrapper (DDP, accelerate) and PEFT, with parameters in place."""
    return _base_transformers_model(_extract_module(model))


def _base_transformers_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model that owns `init_continuous_batching`; for PEFT, the base model with adapters active."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and not hasattr(type(model), "init_continuous_batching"):
        model = get_base()
    if not hasattr(model, "init_continuous_batching"):
        raise TypeError(f"{type(model).__name__} does not support transformers continuous batching.")
    return model
