"""The generator's engine, kept across rounds: built on demand, grown when a workload needs more cache, rebuilt when
the sampling settings or the module change, hard-stopped (never flushed) when a round is abandoned.

Invariants: at most one engine is live; it is reused only when its signature (module, dtype, block sharing, sampling
settings) matches, it is not `busy` (a round or async rollouts own it) and its cache holds the workload; a stopped
engine is forgotten only once its thread has exited, and freed later (`free_retired`), outside the abort path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import ContinuousBatchingConfig

from ..checks.generation_settings import (
    eos_token_ids,
    request_processor_settings,
    resolve_eos,
    sampling_signature,
    without_trl_cb_fields,
)
from ..engine import _upstream, _upstream_sampling, decode_graphs
from ..engine._upstream_recurrent import RECURRENT_STATE_NEEDS_SYNC, recurrent_layers
from ..engine.request_processors import (
    HISTORY_NEEDS_SYNC,
    POLICY_LOGPROBS_NEED_SYNC,
    SYNCHRONOUS_ENGINE,
    RequestProcessorSettings,
    build_request_processors,
    require_synchronous_engine,
)
from ..engine.sizing import CacheSize, Workload, default_page_size, size_cache
from ..errors import EngineDiedError

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EnginePool"]


@dataclass
class Engine:
    manager: _upstream.ContinuousBatchingManager
    module: PreTrainedModel  # held so that `id(module)` in `signature` cannot be reused by another object
    signature: tuple[Any, ...]
    workload: Workload
    size: CacheSize
    #: A round owns the engine (thread running, requests possibly in flight); cleared once it is suspended clean.
    busy: bool = False


@dataclass(frozen=True)
class _EngineChoices:
    """What `EnginePool` decides once per `ensure` for an engine serving a generation config."""

    settings: RequestProcessorSettings  # what trl_cb applies per request itself
    graphs: bool  # decode steps as accelerator graphs (`EnginePool.wants_graphs`)
    block_tables: bool  # decode steps read the cache through block tables (graphs, full attention only)


class EnginePool:
    """Builds, keeps and stops the engine of one generator; `cb_kwargs` are the user's checked engine settings.

    `stable_weights`: whether the weights the engine reads sit at the same addresses every round
    (`ModelAccess.stable_weights`); when not, accelerator graphs, which replay the addresses they were captured
    with, are off (an explicit `use_cuda_graph=True` is refused; `wants_graphs`)."""

    def __init__(self, cb_kwargs: dict[str, Any], stable_weights: bool = True) -> None:
        self.cb_kwargs = cb_kwargs
        self.stable_weights = stable_weights
        self.engine: Engine | None = None
        #: Engines stopped by an aborted round, freed later (`free_retired`): freeing runs upstream's
        #: `gc.collect()`, which must not delay the exception on its way to the caller.
        self._retired: list[_upstream.ContinuousBatchingManager] = []
        #: Engines built so far (a persistent engine keeps this at 1 across training steps).
        self.num_builds = 0

    @property
    def holds_resources(self) -> bool:
        return self.engine is not None or bool(self._retired)

    def ensure(self, module: PreTrainedModel, workload: Workload, generation_config: GenerationConfig) -> Engine:
        """An idle engine for `module` that serves `generation_config` and holds `workload` (no thread running)."""
        resolve_eos(generation_config, module)
        sharing = self.cb_kwargs.get("allow_block_sharing", True)
        signature = (id(module), module.dtype, sharing, sampling_signature(generation_config))
        choices = self._choices(module, generation_config)  # each engine setting decided once, here
        engine = self.engine
        if engine is not None and engine.busy:
            # An earlier round was cut short (or async rollouts own it): requests may still be in flight.
            logger.info("The continuous batching engine was left mid-round: stopping it and building a new one.")
            self.stop()
            engine = None
        if engine is not None and engine.signature == signature:
            if engine.size.holds(self.cache_size(module, workload, choices.block_tables)):
                return engine
            workload = workload.union(engine.workload)
            logger.info(
                "Workload grew to %d requests of up to %d tokens: re-sizing the continuous batching engine.",
                workload.num_requests,
                workload.max_prompt_len + workload.max_new_tokens,
            )
        elif engine is not None:
            logger.info("Generation settings or model changed: rebuilding the continuous batching engine.")
        self.stop()
        self.engine = self._build(module, workload, signature, generation_config, choices)
        self.num_builds += 1
        return self.engine

    def cache_size(self, module: PreTrainedModel, workload: Workload, block_tables: bool = False) -> CacheSize:
        """The cache geometry for `workload`: the user's settings where given, else sized from the workload.

        A prompt's full pages are counted once for its samples only where decode steps read the cache through block
        tables (`block_tables`) and blocks are shared: transformers' scheduler caps every other step at the cache's
        size in key reads (each row reading its shared pages again), so a cache sized for shared pages would make rows
        wait a step there (tests/unit/engine/test_sizing.py: same samples as a cache 4x larger)."""
        page_size = self.cb_kwargs.get("page_size") or default_page_size(module.device, module.dtype)
        shared = block_tables and self.cb_kwargs.get("allow_block_sharing", True)
        sized = size_cache(workload, page_size, module.device, shared)
        return CacheSize(
            page_size=page_size,
            num_blocks=self.cb_kwargs.get("num_blocks") or sized.num_blocks,
            max_batch_tokens=self.cb_kwargs.get("max_batch_tokens") or sized.max_batch_tokens,
        )

    def _choices(self, module: PreTrainedModel, generation_config: GenerationConfig) -> _EngineChoices:
        """The settings an engine built now for `generation_config` would run with, each decided once."""
        settings = request_processor_settings(generation_config)
        graphs = self.wants_graphs(module, needs_history=settings.needs_history)
        full_attention = set(_upstream.engine_layer_groups(module.config.get_text_config())) == {"full_attention"}
        block_tables = graphs and decode_graphs.backend_available(module.device) and full_attention
        return _EngineChoices(settings=settings, graphs=graphs, block_tables=block_tables)

    def wants_graphs(self, module: PreTrainedModel, needs_history: bool = False) -> bool:
        """Whether the engine runs its decode steps as accelerator graphs (`engine/decode_graphs.py`).

        The user's `use_cuda_graph` where set (a `(varlen, decode)` pair: its decode half), else on wherever the device
        has graphs (CUDA). Off, or refused when asked for explicitly, where a graph would replay stale state: weights
        gathered or copied per round (`stable_weights`), per-request history processors (`needs_history`), a hybrid
        model's recurrent layers (their state slots are mapped to the rows on the host each step)."""
        asked = self.cb_kwargs.get("use_cuda_graph")
        if isinstance(asked, (tuple, list)):
            asked = bool(asked[-1])
        hybrid = bool(recurrent_layers(module.config.get_text_config()))  # states stepped on the host: no graphs
        if asked is None:
            available = decode_graphs.backend_available(module.device) and self.stable_weights
            return available and not needs_history and not hybrid
        if asked and hybrid:
            require_synchronous_engine({"use_cuda_graph": True}, RECURRENT_STATE_NEEDS_SYNC)
        if asked and not self.stable_weights:
            raise ValueError(
                "use_cuda_graph=True needs the weights at the same addresses every round, but they are gathered "
                "(ZeRO-3/FSDP) or copied per round (cb_keep_generation_weights=False) here: unset use_cuda_graph, "
                "or keep the generation copies (unsharded models)."
            )
        if asked and needs_history:
            require_synchronous_engine({"use_cuda_graph": True}, HISTORY_NEEDS_SYNC)
        return bool(asked)

    def stop(self) -> None:
        """Hard-stop the engine's thread, give the model its attention back, and retire the engine (not yet freed).
        The engine is forgotten only once its thread has exited."""
        engine = self.engine
        if engine is None:
            return
        manager = engine.manager
        if not _upstream.stop_now(manager):
            raise EngineDiedError("The continuous batching engine thread did not stop within 60 s; it is kept.")
        _upstream.restore_training_attention(manager)
        self.engine = None
        self._retired.append(manager)

    def free_retired(self) -> None:
        while self._retired:
            _upstream.release(self._retired.pop())

    def _build(
        self,
        module: PreTrainedModel,
        workload: Workload,
        signature: tuple[Any, ...],
        generation_config: GenerationConfig,
        choices: _EngineChoices,
    ) -> Engine:
        self.free_retired()  # before allocating a new cache
        kwargs = dict(self.cb_kwargs)
        settings = choices.settings
        if settings.top_logprobs and not self.cb_kwargs.get("per_request_processors"):
            raise ValueError(
                "top_logprobs: only a rollout server returns the alternatives it records (`trl-cb serve`); a "
                "generation in process has nowhere to put them: unset it"
            )
        request_processors = build_request_processors(settings, eos_token_ids(generation_config))
        engine_config = without_trl_cb_fields(generation_config)
        # Truncating or penalising settings: record the trainer-comparable logprob beside the processed one.
        record_policy = bool(request_processors) or _upstream_sampling.reshapes_distribution(module, engine_config)
        if record_policy:  # both read per-step state on the host: synchronous, uncompiled engine only
            if settings.needs_history:
                require_synchronous_engine(self.cb_kwargs, HISTORY_NEEDS_SYNC)
            else:  # the recorder runs inside trl_cb's decode graphs (`decode_graphs.py`): only graphs are allowed
                require_synchronous_engine(_without_graphs(self.cb_kwargs), POLICY_LOGPROBS_NEED_SYNC)
            kwargs.update(SYNCHRONOUS_ENGINE)
        kwargs["use_cuda_graph"] = False  # transformers' own graphs stay off: trl_cb's run the decode steps
        size = self.cache_size(module, workload, choices.block_tables)
        if workload.num_prompts is not None and "num_blocks" not in self.cb_kwargs:
            # The cache holds every request of this workload at its longest: transformers' safety margin (no new
            # prefill while under 10% of the cache is free) would only make the last prompts of a round wait.
            kwargs.setdefault("safety_margin", 0.0)
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
                engine_config,
                ContinuousBatchingConfig(**kwargs),
                hints,
                request_processors,
                record_policy,
                graphs=choices.graphs,
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
        return Engine(manager=manager, module=module, signature=signature, workload=workload, size=size)


def _without_graphs(cb_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in cb_kwargs.items() if key != "use_cuda_graph"}
