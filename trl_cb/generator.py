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
- Settings apply: the engine is rebuilt when the sampling settings or the module change, and re-sized (grown, with
  a log line) when a workload needs more cache than it has.
- Training is unaffected: the module's train/eval mode and attention implementation are restored after each round,
  and the engine's thread is stopped between rounds; OpenMP threads sleep rather than spin while the generator
  lives, so CPU training stays fast on a loaded machine with or without an engine thread (`openmp.py`).
- The caller's global RNG is never re-seeded; two rounds on the same prompts sample differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import ContinuousBatchingConfig

from . import _upstream
from .errors import EngineDiedError, GenerationError
from .openmp import hold_polite_waits_while_alive
from .sizing import CacheSize, Workload, default_page_size, size_cache

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

#: Sampling fields whose change requires a new engine (a live manager silently ignores them).
_SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id")
#: How often the collector wakes up to check that the engine thread is still alive.
_POLL_SECONDS = 0.2


@dataclass
class GenerationResult:
    """Completions in the caller's order; `logprobs[i][t]` is the sampling logprob of `completion_ids[i][t]`.

    The logprob is log-softmax of the *processed* logits the token was sampled from (temperature, then top-k/top-p
    renormalisation), in fp32 — the behaviour policy that importance sampling corrects for.
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    num_generations: int
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Engine:
    manager: _upstream.ContinuousBatchingManager
    module: PreTrainedModel  # held so that `id(module)` in `signature` cannot be reused by another object
    signature: tuple[Any, ...]
    workload: Workload
    size: CacheSize


class ContinuousBatchingGenerator:
    """Generate completions and their sampling logprobs with transformers' continuous batching engine.

    Args:
        model: A transformers causal LM, or the same wrapped for training (DDP, FSDP, DeepSpeed, PEFT). With an
            `accelerator`, it is unwrapped the way TRL unwraps for generation (ZeRO-3 parameters gathered, FSDP1
            parameters summoned) for the duration of each round only; FSDP2 (`fully_shard`) parameters are held
            unsharded for the round and resharded after it, with or without an accelerator. Sharded strategies
            must call `generate` on every rank together (as the trainers do).
        generation_config: Sampling settings; `max_new_tokens` is required. `num_return_sequences` is ignored: the
            number of samples is `generate(..., num_generations=G)`.
        continuous_batching_config: `ContinuousBatchingConfig` or its kwargs. Unset `num_blocks` /
            `max_batch_tokens` / `page_size` are sized from the workload; `max_memory_percent` defaults to 0.5 and
            caps the cache; `return_logprobs` is always on.
        accelerator: The training `Accelerator`, if any.
        gather_deepspeed3_params: Gather ZeRO-3 parameters for generation (TRL's `ds3_gather_for_generation`).
        cast_dtype: Cast the unwrapped module to this dtype before generating (TRL does so for `bf16`/`fp16`).
        timeout: Seconds a round may take before it is abandoned with `TimeoutError` (`None`: no limit).
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
    ) -> None:
        if accelerator is not None and not gather_deepspeed3_params and _zero_stage(accelerator) == 3:
            raise ValueError(
                "ds3_gather_for_generation=False is not supported with continuous batching: the engine's forwards "
                "would run ZeRO-3's per-layer all-gathers from its own thread, out of step across ranks (a hang). "
                "Keep ds3_gather_for_generation=True (the default)."
            )
        self.model = model
        self.accelerator = accelerator
        self.gather_deepspeed3_params = gather_deepspeed3_params
        self.cast_dtype = cast_dtype
        self.cast_lm_head_to_fp32 = cast_lm_head_to_fp32
        self.gradient_checkpointing_kwargs = gradient_checkpointing_kwargs
        self.timeout = timeout
        self.generation_config = _engine_generation_config(generation_config)
        hold_polite_waits_while_alive(self)  # OpenMP threads sleep, not spin, while we live (openmp.py)
        self._cb_kwargs = _cb_kwargs(continuous_batching_config)
        self._engine: _Engine | None = None
        self._round = 0
        #: Engines built so far (a persistent engine keeps this at 1 across training steps).
        self.num_engine_builds = 0

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
        if generation_config is not None:
            self.generation_config = _engine_generation_config(generation_config)
        if len(prompt_ids) == 0:
            return GenerationResult(completion_ids=[], logprobs=[], num_generations=num_generations)
        with self._generation_module() as module:
            return self._generate_on(module, [list(p) for p in prompt_ids], num_generations)

    def engine_for(self, module: PreTrainedModel, workload: Workload) -> _upstream.ContinuousBatchingManager:
        """The running engine for `module`, sized for `workload`, for callers that keep requests in flight across
        weight updates (async rollouts). Prefix block sharing is turned off: its cache cannot be cleared while
        requests are in flight, and a shared block computed with old weights must never serve a new prompt."""
        self._cb_kwargs["allow_block_sharing"] = False
        was_training = module.training
        try:
            manager = self._ensure_engine(module, workload).manager
            _upstream.resume(manager, module)  # the caller drives pauses from here on
            return manager
        finally:
            module.train(was_training)  # the engine's constructor calls module.eval()

    def close(self) -> None:
        """Stop the engine thread and free its cache. Safe to call twice; a later `generate` builds a new engine."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            _upstream.restore_training_attention(engine.manager)
            engine.manager.destroy()
        except Exception:  # pragma: no cover - best effort at teardown
            logger.exception("Error while stopping the continuous batching engine.")

    def __enter__(self) -> ContinuousBatchingGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

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
            if self.cast_dtype is not None:
                module.to(self.cast_dtype)
            if self.cast_lm_head_to_fp32:
                module.lm_head.to(torch.float32)
            was_training = module.training
            try:
                yield module
            finally:
                module.train(was_training)

    def _generate_on(
        self, module: PreTrainedModel, prompts: list[list[int]], num_generations: int
    ) -> GenerationResult:
        t0 = time.perf_counter()
        gen_cfg = self.generation_config
        max_new_tokens = int(gen_cfg.max_new_tokens)
        validate_prompts(prompts, module, max_new_tokens, self._cb_kwargs)

        # Dedupe runs of identical prompts: TRL repeats each prompt G times; each run is prefilled once.
        groups: list[tuple[list[int], int]] = []  # (prompt, number of samples)
        for prompt in prompts:
            if groups and groups[-1][0] == prompt:
                groups[-1] = (prompt, groups[-1][1] + num_generations)
            else:
                groups.append((prompt, num_generations))
        workload = Workload(
            num_requests=len(prompts) * num_generations,
            max_prompt_len=max(len(p) for p in prompts),
            max_new_tokens=max_new_tokens,
            prefill_tokens=sum(len(p) for p, _ in groups),
        )
        engine = self._ensure_engine(module, workload)
        t_engine = time.perf_counter()

        self._round += 1
        manager = engine.manager
        module.eval()
        _upstream.switch_to_generation_attention(manager, module)
        try:
            # Weights may have changed since the last round: drop cached KV blocks and the prefix ledger.
            _upstream.reset_prefix_cache(manager)
            _upstream.resume(manager, module)
            slots = self._submit(manager, groups, max_new_tokens)
            outputs = self._collect(manager, slots)
        except BaseException:
            # A failed or interrupted round may leave requests in the engine: never reuse it.
            self.close()
            raise
        finally:
            if self._engine is not None:
                _upstream.suspend(manager)  # no engine thread between rounds (see `_upstream.suspend`)
                _upstream.restore_training_attention(manager)

        completion_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        for (_, count), request_ids in zip(groups, slots, strict=True):
            for rid in request_ids:
                out = outputs[rid]
                if len(out.generated_tokens) != len(out.logprobs):
                    raise GenerationError(
                        rid, f"{len(out.generated_tokens)} tokens but {len(out.logprobs)} logprobs returned"
                    )
                completion_ids.append(list(out.generated_tokens))
                logprobs.append([float(x) for x in out.logprobs])
            if not gen_cfg.do_sample:  # greedy: one request per prompt, replicated (identical by definition)
                completion_ids.extend([completion_ids[-1][:] for _ in range(count - 1)])
                logprobs.extend([logprobs[-1][:] for _ in range(count - 1)])
        t_end = time.perf_counter()
        return GenerationResult(
            completion_ids=completion_ids,
            logprobs=logprobs,
            num_generations=num_generations,
            timings={"engine_setup_s": t_engine - t0, "generate_s": t_end - t_engine},
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

    def _collect(self, manager: _upstream.ContinuousBatchingManager, slots: list[list[str]]) -> dict[str, Any]:
        expected = {rid for request_ids in slots for rid in request_ids}
        outputs: dict[str, Any] = {}
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while len(outputs) < len(expected):
            result = manager.get_result(timeout=_POLL_SECONDS)
            if result is None:
                error = _upstream.engine_fatal_error(manager)
                if error is not None or not manager.is_running():
                    raise EngineDiedError(
                        f"The continuous batching engine stopped with {len(expected) - len(outputs)} of "
                        f"{len(expected)} requests outstanding" + (f": {error!r}" if error is not None else ".")
                    ) from error
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"Continuous batching round did not finish within {self.timeout} s.")
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
        sharing = self._cb_kwargs.get("allow_block_sharing", True)
        signature = (id(module), module.dtype, sharing, _sampling_signature(self.generation_config))
        engine = self._engine
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
        self.close()
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
        kwargs = dict(self._cb_kwargs)
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
        module.eval()
        t0 = time.perf_counter()
        try:
            manager = _upstream.create_manager(
                module, self.generation_config, ContinuousBatchingConfig(**kwargs), hints
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
    prompts: list[list[int]], module: PreTrainedModel, max_new_tokens: int, cb_kwargs: dict[str, Any]
) -> None:
    """Raise `ValueError` for input the engine would silently mangle (see docs/index.md, "Bad input")."""
    vocab_size = module.config.get_text_config().vocab_size
    max_positions = getattr(module.config.get_text_config(), "max_position_embeddings", None)
    user_blocks, page_size = cb_kwargs.get("num_blocks"), cb_kwargs.get("page_size")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"Prompt {i} is empty; continuous batching needs at least one prompt token.")
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


def _engine_generation_config(generation_config: GenerationConfig) -> GenerationConfig:
    """A private copy of the sampling settings, checked for what CB cannot honour."""
    max_new_tokens = generation_config.max_new_tokens
    if max_new_tokens is None or max_new_tokens <= 0:
        raise ValueError(
            f"generation_config.max_new_tokens must be a positive integer, got {max_new_tokens!r}. Without it "
            "the engine generates until its cache is full and then fails every request."
        )
    cfg = GenerationConfig.from_dict(generation_config.to_dict())
    unsupported = []
    if cfg.min_p is not None:
        unsupported.append(f"min_p={cfg.min_p}")
    if cfg.repetition_penalty not in (None, 1.0):
        unsupported.append(f"repetition_penalty={cfg.repetition_penalty}")
    if unsupported:
        raise ValueError(
            f"Continuous batching cannot apply {', '.join(unsupported)} (transformers drops these processors), so "
            "samples and their logprobs would not follow the requested distribution. Unset them, or use the "
            "`generate()` path."
        )
    if cfg.do_sample and cfg.top_k is None:
        # `model.generate` silently adds top_k=50 when unset; CB adds nothing. Make "no top-k" explicit.
        cfg.top_k = 0
    cfg.num_return_sequences = 1
    return cfg


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


def _sampling_signature(cfg: GenerationConfig) -> tuple[Any, ...]:
    return tuple(tuple(v) if isinstance(v := getattr(cfg, name, None), list) else v for name in _SAMPLING_FIELDS)


def _zero_stage(accelerator: Accelerator) -> int | None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else getattr(plugin, "zero_stage", None)


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
