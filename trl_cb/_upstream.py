"""The only place trl_cb touches transformers' continuous-batching internals.

Why one module: transformers' CB engine is young and moves between minor releases. Every attribute or behaviour we
rely on beyond the documented `init_continuous_batching` / `add_request` / `get_result` / `pause` / `stop` /
`destroy` surface is reached through a function here, and `tests/unit/test_contracts.py` pins each one, so an
upstream change fails one cheap test with a clear message instead of corrupting rollouts.

What we rely on, and why:
- `ContinuousBatchingManager.num_return_sequences` is read by `add_request` to set the request's number of forked
  children. Setting it per request lets each unique prompt fork exactly as many samples as TRL asked for (a group
  may be split across ranks), without rebuilding the engine when G changes (train vs eval).
- `manager.batch_processor.cache.reset()` clears the prefix-hash ledger, which otherwise survives between rounds and
  lets a later prompt reuse KV blocks computed with the previous weights (see docs/index.md, "Fresh weights").
- `manager._original_attn_impl` records the attention implementation CB switched away from; we restore it after
  each round so the training forward never runs through the paged path (transformers issues 48296/48297).
- `manager.warmup()` builds the batch processor on the calling thread. That constructor seeds the *global* RNG
  (`torch.manual_seed`); doing it here, inside `fork_rng`, keeps the caller's RNG stream untouched.
- `manager.background_thread_status.fatal_error` tells a crashed engine from an idle one.
- torch FSDP2's per-group reshard setting (`fsdp2_unsharded`): saved and restored around a round.
- `background_thread_status.request_stop(FLUSH_AND_STOP)`, `manager._wake_up_loop` and `manager._generation_thread`
  (`suspend`): the thread is stopped between rounds and restarted by `start()` on the kept batch processor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.utils import WorkloadHints

from .errors import EngineDiedError

__all__ = [
    "ContinuousBatchingManager",
    "WorkloadHints",
    "add_forked_request",
    "create_manager",
    "engine_fatal_error",
    "fsdp2_unsharded",
    "inflight_generated_lengths",
    "reset_prefix_cache",
    "resume",
    "suspend",
    "restore_training_attention",
    "switch_to_generation_attention",
]

_fork_lock = threading.Lock()


def create_manager(
    model: PreTrainedModel,
    generation_config: GenerationConfig,
    cb_config: ContinuousBatchingConfig,
    hints: WorkloadHints,
) -> ContinuousBatchingManager:
    """Build, warm up (on this thread, RNG preserved) and start a fresh manager. Never reuses a cached one."""
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        # A cached manager would be returned as-is and silently ignore our configs (notes: "persistent pitfalls").
        model.destroy_cached_continuous_batching_manager()
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        manager = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config, workload_hints=hints
        )
        try:
            manager.warmup()
        except BaseException:
            restore_training_attention(manager)
            raise
    manager.start()
    return manager


def add_forked_request(
    manager: ContinuousBatchingManager, input_ids: list[int], request_id: str, num_samples: int, max_new_tokens: int
) -> list[str]:
    """Submit one prompt whose prefill is shared by `num_samples` sampled continuations; return their request ids.

    The engine prefills the prompt once, then forks `num_samples - 1` children that share its full KV blocks.
    """
    with _fork_lock:
        manager.num_return_sequences = num_samples
        try:
            rid = manager.add_request(input_ids, request_id=request_id, max_new_tokens=max_new_tokens)
        finally:
            manager.num_return_sequences = 1
    if rid is None:
        raise EngineDiedError(f"The continuous batching engine refused request {request_id}: it is stopping.")
    return [rid] + [f"{rid}__child#{i}" for i in range(num_samples - 1)]


def reset_prefix_cache(manager: ContinuousBatchingManager) -> None:
    """Drop every cached KV block and the prefix-hash ledger. Call only with no request in flight."""
    processor = manager.batch_processor
    if processor is None:
        return
    if manager.is_running():
        with manager.pause():
            processor.cache.reset()
    else:
        processor.cache.reset()


def suspend(manager: ContinuousBatchingManager) -> None:
    """Stop the engine's thread (no request may be in flight) but keep its batch processor and cache for `resume`.

    No engine thread lives between rounds. Its existence alone no longer changes training speed: an idle torch thread
    owns an OpenMP team, which switches libgomp from spinning to sleeping waits (forward+backward 23 -> 37 ms on an
    idle machine, but 10x faster on a loaded one); trl_cb now holds that policy for the generator's whole life
    (`trl_cb/openmp.py`), so stopping or keeping this thread measured the same (docs/benchmarks.md).
    """
    # Not `manager.stop()`: it also runs `gc.collect()` and caches the manager on the model, which cost ~0.28 s per
    # round here. The loop exits on FLUSH_AND_STOP once nothing is pending; the batch processor stays on the manager.
    status = manager.background_thread_status
    status.request_stop(status.FLUSH_AND_STOP, manager.distributed_helper.global_rank)
    manager._wake_up_loop.set()  # end the idle loop's 100 ms poll now rather than at its timeout
    thread = manager._generation_thread
    if thread is not None:
        thread.join()
        manager._generation_thread = None


def resume(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """Restart a suspended engine's thread on its kept batch processor (no re-seeding, no re-allocation)."""
    switch_to_generation_attention(manager, model)
    if not manager.is_running():
        manager.start()


def switch_to_generation_attention(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """Put the CB-compatible attention implementation on the model (idempotent)."""
    manager.switch_to_cb_friendly_attn(model, manager.continuous_batching_config.auto_switch_to_flash)


def restore_training_attention(manager: ContinuousBatchingManager) -> None:
    """Give the model back the attention implementation it had before CB switched it (no-op if unchanged)."""
    original = getattr(manager, "_original_attn_impl", None)
    if original is not None:
        manager.model.set_attn_implementation(original)
        manager._original_attn_impl = None


def engine_fatal_error(manager: ContinuousBatchingManager) -> Exception | None:
    """The exception that killed the generation thread, if any."""
    status: Any = getattr(manager, "background_thread_status", None)
    return getattr(status, "fatal_error", None)


def resolved_cache_blocks(manager: ContinuousBatchingManager) -> int | None:
    """Number of whole-model KV blocks the engine's cache actually holds (after its own rounding)."""
    processor = manager.batch_processor
    return None if processor is None else int(processor.cache.num_blocks)


@contextmanager
def fsdp2_unsharded(module: torch.nn.Module) -> Iterator[None]:
    """Hold every FSDP2 (`fully_shard`) parameter group of `module` unsharded for a whole generation round.

    Why: TRL's `summon_full_params` is a no-op for FSDP2, whose hooks all-gather before each forward and reshard
    after it. The CB engine runs forwards on its own thread, a data-dependent number of times per rank, so per-forward
    collectives would pair up across ranks out of step (seen: gloo "connection closed", wrong results). We unshard
    once (collectively, all ranks together), turn reshard-after-forward off so the engine's forwards run no
    collective, and on exit reshard and restore each group's exact reshard setting (torch internals
    `_auto_reshard_after_forward` and `post_forward_mesh_info`, pinned by tests/unit/test_contracts.py).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        yield
        return
    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        yield
        return
    saved = []
    for m in fsdp_modules:
        state = m._get_fsdp_state()
        saved.append(
            (state, state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups])
        )
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in fsdp_modules:
            m.unshard()
        yield
    finally:
        for m in fsdp_modules:
            m.reshard()
        for state, auto, infos in saved:
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info


def inflight_generated_lengths(manager: ContinuousBatchingManager) -> dict[str, int]:
    """Tokens generated so far by every request the scheduler holds (active or waiting). Call under `pause()`."""
    processor = manager.batch_processor
    if processor is None:
        return {}
    scheduler = processor.scheduler
    states = {**scheduler.waiting_requests, **scheduler.active_requests}
    return {rid: len(state.generated_tokens) for rid, state in states.items()}
