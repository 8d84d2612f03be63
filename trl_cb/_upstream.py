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
- The engine's attention (`switch_to_generation_attention`): after `switch_to_cb_friendly_attn` picks `sdpa` or
  `paged|eager` (the dense-mask implementations), we put `trl_cb.attention.ATTENTION_NAME` on the model instead and
  record the training implementation in `manager._original_attn_impl`. It must happen before the batch processor is
  built: the engine allocates and fills its dense mask only for `sdpa`/`paged|eager` (`attn_mask_is_needed`), and
  passes the varlen inputs (`cu_seq_lens_q`/`cu_seq_lens_k`, `cache`) to every attention call. Not done when the
  engine uses accelerator graphs (`continuous_batching_config.cuda_graph_booleans`): our plan reads host-side lengths.
  `trl_cb/attention.py` itself uses only what transformers hands every attention function on an engine forward
  (`cache`, `cu_seq_lens_q/k`, `cache.update(...)`), pinned in the same contract tests.
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

from . import attention
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
            _choose_attention(manager, model)  # before warmup builds the batch processor (no dense mask)
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

    Why: any live thread that has run torch ops owns an OpenMP team; with more OpenMP threads than cores, libgomp
    throttles its spin-waits and the training thread's CPU ops slow down (measured: forward+backward 23 -> 37 ms with
    an idle torch thread alive, back to 23 ms once it exits). No engine thread lives between rounds.
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


#: Manager attribute (ours): whether this engine runs `trl_cb.attention`, decided once, because its batch processor
#: was built without the dense mask and every later round must use the same implementation.
_VARLEN_FLAG = "_trl_cb_varlen_attention"


def _choose_attention(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """Decide, once per engine, whether it runs `trl_cb.attention` (see `switch_to_generation_attention`)."""
    use = (
        model.config._attn_implementation in attention.DENSE_MASK_IMPLEMENTATIONS
        and attention.enabled()
        and not any(manager.continuous_batching_config.cuda_graph_booleans)  # our plan reads host-side lengths
    )
    setattr(manager, _VARLEN_FLAG, use)
    switch_to_generation_attention(manager, model)


def switch_to_generation_attention(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """Put the engine's attention implementation on the model (idempotent).

    transformers' choice first (flash when available, else `sdpa` / `paged|eager`); for an engine built to run
    `trl_cb.attention.ATTENTION_NAME` (per-request attention, honours softcap; `_choose_attention`), a dense-mask
    choice is replaced by it. `manager._original_attn_impl` keeps the training implementation.
    """
    if model.config._attn_implementation == attention.ATTENTION_NAME:
        return
    manager.switch_to_cb_friendly_attn(model, manager.continuous_batching_config.auto_switch_to_flash)
    chosen = model.config._attn_implementation
    if not getattr(manager, _VARLEN_FLAG, False) or chosen not in attention.DENSE_MASK_IMPLEMENTATIONS:
        return
    attention.register()
    original = manager._original_attn_impl or chosen  # CB records it only when it changed the implementation
    model.set_attn_implementation(attention.ATTENTION_NAME)
    manager._original_attn_impl = original


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
