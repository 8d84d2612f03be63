"""Decode steps replayed as accelerator graphs, kept across training steps while the weights stay where they were.

Why: on a GPU a small model's decode step is a few milliseconds of kernels behind tens of milliseconds of launches and
Python; a graph launches the whole step (forward, processors, sampling) at once. As in vLLM and SGLang, graphs survive
RL weight updates because weights are written in place (optimizer steps; `copy_` into the generation copies,
`precision.py`). Decode steps read the cache through block tables (`paged_decode.py`: no host reads), padded to a
power of two rows (`padded_decode`); each size is captured on first use and replayed after (`DecodeGraphs`).
Prefill and mixed steps run eagerly, unpadded.
Invariants: a replay computes what the eager step would (same kernels, same order); a graph never replays a moved
weight: the `WeightFingerprint` taken at capture is compared before each round and after each in-flight weight
update (`DecodeGraphs.check`), and a moved address drops every graph (re-captured on use, logged once). Graphs only
on stable weights (`ModelAccess.stable_weights`) and without per-step host processors (`request_processors.py`).
Upstream surface (tests/unit/test_contracts.py): `model_runner.compute_batch` / `_forward_process_and_sample` /
`maybe_pad_inputs` / `pad_inputs`; the IOs' `use_block_table`, `num_q_tokens`, `get_cb_kwargs`, `compute_stream`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.generation.continuous_batching import ContinuousBatchingManager

from . import _upstream_cache, _upstream_geometry, _upstream_window

logger = logging.getLogger(__name__)

__all__ = [
    "CudaGraphBackend",
    "DecodeGraphs",
    "GraphBackend",
    "WeightFingerprint",
    "backend_available",
    "backend_for",
    "GRAPHS_ATTR",
    "enable_block_table_decode",
    "graphed_compute",
    "graphs_of",
    "padded_decode",
]

#: Manager attribute (ours) holding its `DecodeGraphs` (set by `_upstream_patches.install`).
GRAPHS_ATTR = "_trl_cb_decode_graphs"


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """Captures `run` (one engine step) as a graph. The step's outputs must hold its result when `capture` returns."""

    def capture(self, run: Callable[[], None], stream: Any, module: torch.nn.Module) -> Graph: ...


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph`s sharing one memory pool: a warm eager run (allocations, lazy initialisation, and this
    step's result), then the capture on the engine's compute stream (graphs need a non-default stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], None], stream: Any, module: torch.nn.Module) -> Graph:
        stream = stream if stream is not None else torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()  # the step's result: capturing runs nothing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            run()
        return graph


def backend_for(device: torch.device) -> GraphBackend | None:
    """The graph backend of `device`: CUDA graphs on CUDA, none elsewhere (tests put a fake here)."""
    return CudaGraphBackend(device) if device.type == "cuda" else None


def backend_available(device: torch.device) -> bool:
    """Whether engines on `device` get decode graphs by default (a device with graphs: CUDA)."""
    return device.type == "cuda"


@dataclass(frozen=True)
class WeightFingerprint:
    """Where every parameter and buffer of a module lives: `(name, data_ptr, shape, dtype)`, in module order."""

    entries: tuple[tuple[str, int, tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, module: torch.nn.Module) -> WeightFingerprint:
        tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        return cls(tuple((name, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in tensors))

    def moved(self, other: WeightFingerprint) -> list[str]:
        """Names whose address, shape or dtype differ between the two (all names when the sets differ)."""
        if [e[0] for e in self.entries] != [e[0] for e in other.entries]:
            return sorted({e[0] for e in self.entries} ^ {e[0] for e in other.entries}) or ["<module structure>"]
        return [a[0] for a, b in zip(self.entries, other.entries, strict=True) if a != b]


@dataclass
class DecodeGraphs:
    """The graphs of one engine, keyed by padded row count, the fingerprint of the weights they read, and what they did
    since the engine was built (the counts)."""

    backend: GraphBackend
    fingerprint: WeightFingerprint | None = None
    graphs: dict[int, Graph] = field(default_factory=dict)
    #: Called after each replay with the padded row count (state a step's Python keeps beside its tensors).
    after_replay: list[Callable[[int], None]] = field(default_factory=list)
    captures: int = 0
    replays: int = 0
    #: Steps run without a graph (prefill and mixed steps, `graphed_compute`).
    eager_steps: int = 0
    #: Times every graph was dropped because a weight moved (`check`).
    invalidations: int = 0
    _warned: bool = False

    def check(self, module: torch.nn.Module) -> bool:
        """Drop every graph if a weight `module`'s graphs read moved since they were captured; True if dropped."""
        if not self.graphs:
            self.fingerprint = None
            return False
        now = WeightFingerprint.of(module)
        moved = self.fingerprint.moved(now) if self.fingerprint is not None else ["<not recorded>"]
        if not moved:
            return False
        log = logger.debug if self._warned else logger.warning
        log(
            "Weights moved since the engine's decode graphs were captured (%s%s): re-capturing them. Update "
            "parameters in place (optimizer steps, `copy_`) to keep the graphs across training steps.",
            ", ".join(moved[:3]),
            f" and {len(moved) - 3} more" if len(moved) > 3 else "",
        )
        self._warned = True
        self.graphs.clear()
        self.fingerprint = None
        self.invalidations += 1
        return True

    def step(self, key: int, run: Callable[[], None], stream: Any, module: torch.nn.Module) -> None:
        """Replay the graph of `key`, capturing it first if there is none."""
        graph = self.graphs.get(key)
        if graph is None:
            if self.fingerprint is None:
                self.fingerprint = WeightFingerprint.of(module)
            self.graphs[key] = self.backend.capture(run, stream, module)
            self.captures += 1
            return
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            graph.replay()
        self.replays += 1
        for hook in self.after_replay:
            hook(key)


def graphs_of(manager: ContinuousBatchingManager) -> DecodeGraphs | None:
    """The engine's graphs; None where it runs its decode steps eagerly."""
    return getattr(manager, GRAPHS_ATTR, None)


def enable_block_table_decode(manager: ContinuousBatchingManager, max_sequence_length: int) -> bool:
    """Before warmup (the batch processor does not exist yet): let decode steps read the cache through a block table
    of `max_sequence_length` tokens per request (upstream offers block tables only to flash kernels and turns them off
    while resolving the config; `paged_decode` reads them on any device). Sliding-window layers read their ring of
    pages through it (`_upstream_window`, synchronous IOs only); a latent layer gets its pages gathered before its
    layer expands them (`_upstream_cache.latent_block_table_read`; from transformers 5.24, where the layer calls the
    cache). Returns whether it was enabled: not for a layer type without either allocator. Hybrid models (recurrent
    layers) never get here: `_upstream_recurrent.check_engine_settings` refuses decode graphs for them first."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    config = manager.continuous_batching_config
    text_config = manager.model.config.get_text_config()
    layer_types = set(group_layers_by_attn_type(text_config))
    if (
        not layer_types <= {"full_attention", "sliding_attention"}
        or ("sliding_attention" in layer_types and not _upstream_window.windowed_block_tables_fit(config))
        or (_upstream_geometry.expands_cached_keys(text_config) and _upstream_cache.ATTENTION_UPDATES_CACHE)
    ):
        return False
    blocks = math.ceil(max_sequence_length / config.page_size) + 1
    config.max_blocks_per_request = blocks + blocks % 2  # even, as upstream sizes it
    return True


def padded_decode(runner: Any, ios: Any, limit: int) -> Callable[[int, int, bool], tuple[int, int]]:
    """The model runner's `maybe_pad_inputs`: block-table decode steps padded to a power of two rows (at most `limit`,
    the engine's `max_requests_per_batch`), so a few graphs serve every batch; other steps unpadded
    (`varlen_attention` plans them on the host, no graph). Upstream pads every step or none (`pad_inputs`); here it is
    set per step, right before the batch is prepared, and read by the preparation and model kwargs of that step."""
    from transformers.generation.continuous_batching.utils import pad_to_pow2

    runner.pad_inputs = False

    def maybe_pad_inputs(num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool) -> tuple[int, int]:
        block_table = use_decode_fast_path and ios.block_table.numel() > 0
        runner.pad_inputs = block_table
        return (pad_to_pow2(num_q_tokens, limit), 0) if block_table else (num_q_tokens, max_kv_read)

    return maybe_pad_inputs


def graphed_compute(runner: Any, ios: Any, graphs: DecodeGraphs, eager: Callable) -> Callable[[Any, dict], None]:
    """The model runner's `compute_batch`: block-table decode steps through `graphs` (captured on first use of a padded
    size, replayed after), every other step `eager`. The innermost wrapper: whatever else a step does runs outside the
    graph (`_upstream_patches`)."""

    def compute_batch(module: torch.nn.Module, batch_data: dict) -> None:
        stream = ios.compute_stream
        if stream is not None:  # the batch was prepared on this thread's current stream: the step runs after it
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        if not ios.use_block_table:
            graphs.eager_steps += 1
            return eager(module, batch_data)
        if runner.supports_logits_to_keep(module):
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        outputs = ios.get_cb_kwargs()

        def run() -> None:
            runner._forward_process_and_sample(module, batch_data, *outputs)

        graphs.step(ios.num_q_tokens, run, stream, module)

    return compute_batch
