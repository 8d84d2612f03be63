"""trl_cb's behaviour inside transformers' CB engine: every engine method trl_cb changes is set here, once.

Why one module: several features change the same method, and their order is part of their correctness (the graph
innermost). `install` builds each method from upstream's and the features' pure builders and assigns it once; feature
modules never assign to an engine object (test_upstream_patches.py). Composed, outermost first (`>`): `compute_batch`:
step threads (CPU) > mask placeholder > a hybrid's step plan (`_upstream_recurrent`; its state slots freed and forked
with the cache's blocks) > decode graphs or eager (`decode_graphs`) > upstream; `_sample`: policy-logprob recorder >
race sampler or upstream; `maybe_pad_inputs`: decode padding; `prepare_batch_update`: (processed, policy) logprob pairs
> upstream; a sliding-window allocator's block-table methods and key counts (`_upstream_window`); `schedule_batch`:
steady decode batch > upstream; `prepare_batch_tensors`: steady decode advance > read rows by tensor ops
(`_upstream_cache`) > upstream; `update_batch`: steady rows inline > forks copied (`_upstream_fork`) > upstream;
`handle_batch_error` / `fail_all_requests`: lazy states written > upstream; `cache.search_prefix_match`: two prompt
tokens left (`_upstream_prefix`) > upstream; `cache.update`: one-gather reads, block-table marks > upstream;
`_run_generation_loop`: a context (`run_loop_in`); on the classes: block hashes chained from the weight epoch
(`install_epoch_hashes`), a hybrid's mixer `forward` through its stepper. Upstream surface: test_contracts.py.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.generation.continuous_batching import ContinuousBatchingManager

from . import (
    _upstream_cache,
    _upstream_decode,
    _upstream_fork,
    _upstream_prefix,
    _upstream_recurrent,
    _upstream_window,
    openmp,
)
from . import _upstream_sampling as _sampling
from . import decode_graphs as _graphs
from .policy_logprobs import PolicyLogprobRecorder

__all__ = [
    "LOOP_ATTRIBUTE",
    "adopt_compute_stream",
    "install",
    "install_epoch_hashes",
    "placeholder_mask",
    "run_loop_in",
]


@dataclass
class Features:
    """What an engine gets beyond upstream's behaviour (decided by `_upstream.create_manager`)."""

    attention_name: str  # trl_cb's attention implementation (`varlen_attention.ATTENTION_NAME`)
    recorder: PolicyLogprobRecorder | None = None  # record the trainer-comparable logprob of each sampled token
    graphs_backend: _graphs.GraphBackend | None = None  # run block-table decode steps as graphs on this backend
    #: a hybrid model's recurrent layers: each step planned onto their state slots (never with graphs)
    recurrent: _upstream_recurrent.RecurrentStepper | None = None


def install(manager: ContinuousBatchingManager, model: PreTrainedModel, features: Features) -> None:
    """After warmup: set every engine method of the module docstring's table, once, composed in its order."""
    processor = manager.batch_processor
    runner, ios, scheduler, cache = (
        processor.model_runner,
        processor.inputs_and_outputs,
        processor.scheduler,
        processor.cache,
    )
    recorder = features.recorder

    # ModelRunner._sample and IOs.prepare_batch_update: what a step samples and hands to the host
    seeded = _sampling.request_processor(manager, _sampling.SeededRows)
    alternatives = _sampling.request_processor(manager, _sampling.TopLogprobs)
    race = _sampling.race_sampler_fits(manager)
    if (seeded or alternatives) and not race:  # they would be dropped silently
        raise ValueError("seeds and top_logprobs need the engine's sampler uncompiled and sampling (do_sample=True)")
    sample = _sampling.race_sample(runner.return_logprobs, seeded, alternatives) if race else runner._sample
    prepare_update = ios.prepare_batch_update
    if recorder is not None:
        sample = _sampling.recording_sample(sample, recorder)
        prepare_update = _sampling.with_policy_logprobs(prepare_update, recorder)

    # ModelRunner.maybe_pad_inputs and compute_batch: graphs innermost, then the mask placeholder, then step threads
    compute = runner.compute_batch
    if features.graphs_backend is not None:
        graphs = _graphs.DecodeGraphs(features.graphs_backend)
        if recorder is not None:
            graphs.after_replay.append(recorder.replayed)
        setattr(manager, _graphs.GRAPHS_ATTR, graphs)
        runner.maybe_pad_inputs = _graphs.padded_decode(
            runner, ios, manager.continuous_batching_config.max_requests_per_batch
        )
        compute = _graphs.graphed_compute(runner, ios, graphs, compute)
    if features.recurrent is not None:  # the step's rows mapped to their state slots, right around the forward
        compute = _upstream_recurrent.with_step_plan(features.recurrent, ios, compute)
    compute = _with_placeholder_mask(compute, model, features.attention_name)
    compute = _with_step_threads(compute, model)

    # SlidingAttentionCacheAllocator's block-table methods and key counts, and the cache's block-table length limit:
    # a windowed layer's ring read through block tables (decode graphs; `_upstream_window`)
    rings = _upstream_window.rings(cache) if ios.block_table.numel() > 0 else []
    if rings:
        for ring in rings:
            ring.fill_block_table, ring.get_cache_for_block_table, ring.get_seqlen_k = _upstream_window.ring_methods(
                ring, ios
            )
            ring.supports_block_table = True
        cache.max_decode_fast_path_length = _upstream_window.decode_fast_path_length(cache)

    # Scheduler.schedule_batch, IOs.prepare_batch_tensors, processor.update_batch: the steady decode path in front
    schedule, prepare, update = scheduler.schedule_batch, ios.prepare_batch_tensors, processor.update_batch
    prepare = _upstream_cache.with_read_index_rows(processor, prepare) or prepare
    update = _upstream_fork.with_fast_fork(scheduler, update)
    runner._sample, runner.compute_batch = sample, compute  # read by the fast path's `fits` below: set first
    ios.prepare_batch_update = prepare_update
    processor.update_batch = update  # the fast path's inline update calls it for the rows it does not take
    if _upstream_decode.fast_path_fits(processor):
        fast = _upstream_decode.with_fast_path(
            processor, schedule, prepare, update, states_read_per_step=features.recurrent is not None
        )
        setattr(processor, _upstream_decode.FAST_PATH_ATTR, fast)
        schedule, prepare, update = fast.schedule, fast.prepare, fast.update
        # upstream's error paths read the request states, which the fast path writes lazily
        processor.handle_batch_error = _upstream_decode.writing_states_first(processor, processor.handle_batch_error)
        processor.fail_all_requests = _upstream_decode.writing_states_first(processor, processor.fail_all_requests)
    scheduler.schedule_batch, ios.prepare_batch_tensors, processor.update_batch = schedule, prepare, update

    # PagedAttentionCache.free_blocks / free_all_requests / prepare_fork_request: a recurrent state slot lives as
    # long as its sequence's KV blocks; the mixers' `forward` (on their classes) finds the stepper on the cache
    if features.recurrent is not None:
        lifetimes = _upstream_recurrent.with_slot_lifetimes(cache, features.recurrent.slots)
        cache.free_blocks, cache.free_all_requests, cache.prepare_fork_request = lifetimes
        cache.use_prefix_sharing = False  # a matched prefix has keys but no recurrent state
        setattr(cache, _upstream_recurrent.STEPPER_ATTR, features.recurrent)
        for cls in features.recurrent.mixer_classes:
            _route_mixer_forward(cls)

    # PagedAttentionCache.search_prefix_match: a forked request's prefill never matched empty
    if cache.use_prefix_sharing:
        cache.search_prefix_match = _upstream_prefix.with_two_tokens_left(cache.search_prefix_match)

    # PagedAttentionCache.update (5.24): the model's layers write the cache
    cache_update = _upstream_cache.with_direct_reads(cache, model, features.attention_name, cache.update)
    if cache_update is not None:
        _upstream_cache.drop_paged_cache_from_outputs(model)
        cache.update = cache_update


_mixer_lock = threading.Lock()


def _route_mixer_forward(cls: type) -> None:
    """`cls.forward` routed through the engine's stepper (`_upstream_recurrent.routed_forward`): once per class, per
    process; a call without an engine cache (a training forward) runs upstream's forward itself
    (tests/unit/engine/test_hybrid_engine.py `test_the_training_forward_is_untouched`)."""
    with _mixer_lock:
        if _upstream_recurrent.ORIGINAL_FORWARD in cls.__dict__:
            return
        setattr(cls, _upstream_recurrent.ORIGINAL_FORWARD, cls.forward)
        cls.forward = _upstream_recurrent.routed_forward(cls.forward)


_epoch_lock = threading.Lock()
_epoch_hashes = False


def install_epoch_hashes() -> bool:
    """Chain the block hashes of this process's engines from the weight epoch (`_upstream_prefix`): transformers'
    `compute_block_hash` and `PagedAttentionCache.mark_complete_blocks`, on the classes, once (idempotent;
    process-wide, which is safe for every engine: an epoch only ever makes fewer blocks match). Returns True (block
    sharing may be on)."""
    global _epoch_hashes
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    with _epoch_lock:
        if not _epoch_hashes:
            cache_allocator.compute_block_hash = _upstream_prefix.epoch_hash
            PagedAttentionCache.mark_complete_blocks = _upstream_prefix.with_start_epoch(
                PagedAttentionCache.mark_complete_blocks
            )
            _epoch_hashes = True
    return True


def placeholder_mask(device: torch.device) -> torch.Tensor:
    """(1, 1, 0, 0) bool: 4D, so transformers' mask builders hand it back untouched; empty, so nothing reads it."""
    return torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device)


def _with_placeholder_mask(compute: Callable, model: PreTrainedModel, attention_name: str) -> Callable:
    """A step without a dense mask gets `placeholder_mask` while `model` runs `attention_name` (see the module
    docstring); training forwards and other attention implementations are untouched."""
    placeholder = placeholder_mask(model.device)
    config = model.config

    def compute_without_mask(module: torch.nn.Module, batch_data: dict) -> None:
        if batch_data.get("attention_mask") is None and config._attn_implementation == attention_name:
            batch_data["attention_mask"] = placeholder
        compute(module, batch_data)

    return compute_without_mask


def _with_step_threads(compute: Callable, model: PreTrainedModel) -> Callable:
    """CPU engines with more than one intra-op thread: each step's threads set on the engine's own thread before its
    forward (`openmp.step_threads`). That changes the engine thread's OpenMP team size, not the caller's; threads
    started while a round runs would take the engine's count, so `_upstream.suspend` republishes the caller's.
    `batch_data["input_ids"]` is `(1, query_tokens)`."""
    threads = torch.get_num_threads()
    hidden_size = getattr(model.config.get_text_config(), "hidden_size", None)
    if model.device.type != "cpu" or threads <= 1 or not isinstance(hidden_size, int):
        return compute

    def compute_with_step_threads(module: torch.nn.Module, batch_data: dict) -> None:
        wanted = openmp.step_threads(batch_data["input_ids"].shape[-1], hidden_size, threads)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        compute(module, batch_data)

    return compute_with_step_threads


# --------------------------------------------------------------------------------------------- the engine's loop

#: The manager method `start()` hands to `threading.Thread(target=...)` (with the caller's arguments since 5.24),
#: looked up on the instance at `start()`.
LOOP_ATTRIBUTE = "_run_generation_loop"
#: Manager attribute (ours): the loop already runs inside a context (`run_loop_in` is idempotent).
_WRAPPED = "_trl_cb_loop_context"


def run_loop_in(
    manager: ContinuousBatchingManager, context: Callable[[], contextlib.AbstractContextManager[Any]]
) -> None:
    """Make every later `start()` run the engine's whole loop (batch preparation, forwards, read-back) inside
    `context()`, entered on the engine's own thread. Call before `start()`; a second call is a no-op."""
    if getattr(manager, _WRAPPED, False):
        return
    loop = getattr(manager, LOOP_ATTRIBUTE)

    @functools.wraps(loop)  # the thread keeps upstream's name (leak checks look for it)
    def loop_in_context(*args: Any, **kwargs: Any) -> None:  # 5.24 passes `use_inference_mode`, 5.23 nothing
        with context():
            loop(*args, **kwargs)

    setattr(manager, LOOP_ATTRIBUTE, loop_in_context)
    setattr(manager, _WRAPPED, True)


def adopt_compute_stream(manager: ContinuousBatchingManager, stream: Any) -> list[Any]:
    """Make `stream` the batch processor's compute stream, so the forward and sampling run on the same stream as the
    rest of the engine's thread (one in-order queue: no cross-stream hazard inside the engine). Only for synchronous
    IOs with a stream (a device that has streams; on CPU there is none and nothing changes).

    Returns the upstream streams still in use that the caller must order against the trainer as it orders `stream`:
    none, or with `use_async_batching` its compute, host-to-device and device-to-host streams (kept: their
    double-buffering is ordered by upstream's own events)."""
    processor = manager.batch_processor
    ios = processor.inputs_and_outputs
    if processor.use_async_batching:
        return [s for s in (ios.compute_stream, ios.h2d_stream, ios.d2h_stream) if s is not None]
    if ios.compute_stream is not None:
        ios.compute_stream.synchronize()  # the warm-up ran on it: done before `stream` takes over
        ios.compute_stream = stream
        processor.offloading_manager._compute_stream = stream  # its copies are ordered on the compute stream
    return []
