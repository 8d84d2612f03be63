"""Hybrid models in the engine: recurrent layers (Gated DeltaNet, Mamba, short convolutions) beside paged attention.

Why: transformers' CB engine refuses any layer type but full and sliding-window attention ("Invalid layer type:
linear_attention", transformers issue 48305), so Qwen3.5 / Qwen3-Next and the Mamba-style hybrids could not be
sampled. Here the paged cache is built for the attention layers only (`attention_only_cache`), each recurrent layer's
per-sequence state lives in `recurrent_state.RecurrentStateSlots` (a slot lives as long as its sequence's KV blocks:
`_track_sequences`), every engine forward gets a step plan (`_upstream_recurrent_step`), and each mixer class's
`forward` is wrapped once per process to run through it when it gets an engine cache (unchanged otherwise).
Served on the engine's synchronous, uncompiled path without CPU offloading (`check_engine_settings`) and without
prefix matching (a cached prefix has keys but no state at its end).
Upstream surface (tests/unit/test_contracts.py): `group_layers_by_attn_type` (the cache and the config resolution
read it), the cache's `free_blocks` / `free_all_requests` / `prepare_fork_request` / `use_prefix_sharing`, the IOs'
`requests_in_batch`, the runner's `compute_batch`, and the mixers' convention (`hidden_states`, `cache=`, states read
through `get_conv_state` / `get_recurrent_state` with their `layer_idx`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.generation.continuous_batching import ContinuousBatchingManager, PagedAttentionCache
from transformers.generation.continuous_batching import cache as _cb_cache
from transformers.generation.continuous_batching import initialization as _cb_initialization
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

from ._upstream_recurrent_step import CACHE_KWARGS, RecurrentStepper
from ._upstream_sampling import resolved_engine_settings
from .recurrent_state import RecurrentStateSlots
from .request_processors import require_synchronous_engine

__all__ = [
    "RECURRENT_LAYER_TYPES",
    "RECURRENT_STATE_NEEDS_SYNC",
    "SERVED_LAYER_TYPES",
    "STATELESS_LAYER_TYPES",
    "RecurrentStepper",
    "attention_free_layers",
    "attention_layer_groups",
    "attention_only_cache",
    "check_engine_settings",
    "mixer_modules",
    "new_stepper",
    "recurrent_layers",
    "serving_problems",
    "stepper",
    "with_slot_lifetimes",
    "with_step_plan",
]

#: Layer types whose token mixer keeps a per-sequence state (served through `RecurrentStateSlots`).
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv"})
#: Layer types that mix no tokens (NemotronH's MLP-only layers): neither a cache nor a state.
STATELESS_LAYER_TYPES = frozenset({"moe", "mlp"})
#: Layer types that are attention *and* a recurrent mixer in parallel (Falcon-H1): the attention cache group they use.
PARALLEL_LAYER_TYPES = {"hybrid": "full_attention"}
#: Every non-attention layer type the engine serves (beside its attention types).
SERVED_LAYER_TYPES = RECURRENT_LAYER_TYPES | STATELESS_LAYER_TYPES | frozenset(PARALLEL_LAYER_TYPES)
#: Why the engine must be synchronous for recurrent layers (`request_processors.require_synchronous_engine`).
RECURRENT_STATE_NEEDS_SYNC = "A hybrid model's recurrent layers map each batch row to its state slot on the host"

STEPPER_ATTR = "_trl_cb_recurrent_stepper"  # on the engine's PagedAttentionCache (set by `_upstream_patches`)
ORIGINAL_FORWARD = "_trl_cb_original_forward"  # on a wrapped mixer class (set by `_upstream_patches`)
_groups_lock = threading.Lock()


# ------------------------------------------------------------------------------------------ which layers are which


def recurrent_layers(text_config: Any) -> list[int]:
    """Indices of the layers whose mixer keeps a per-sequence state (recurrent, or parallel attention + recurrent)."""
    layer_types = getattr(text_config, "layer_types", None) or []
    return [i for i, t in enumerate(layer_types) if t in RECURRENT_LAYER_TYPES or t in PARALLEL_LAYER_TYPES]


def attention_free_layers(text_config: Any) -> list[int]:
    """Indices of the layers that call no attention: recurrent and MLP-only layers (not parallel ones)."""
    layer_types = getattr(text_config, "layer_types", None) or []
    return [i for i, t in enumerate(layer_types) if t in RECURRENT_LAYER_TYPES or t in STATELESS_LAYER_TYPES]


def serving_problems(model: torch.nn.Module, text_config: Any) -> list[str]:
    """Why the engine cannot keep `model`'s recurrent states (empty: it can, or there are none): a recurrent layer
    without a mixer reading its state through the cache API (`mixer_modules`). Engine settings that cannot keep them
    (graphs, async batching, CPU offloading) are refused where they are decided (`check_engine_settings`)."""
    if not recurrent_layers(text_config):
        return []
    try:
        mixer_modules(model, text_config)
    except ValueError as err:
        return [str(err)]
    return []


def attention_layer_groups(text_config: Any, upstream: Callable[[Any], dict[str, list[int]]]) -> dict[str, list[int]]:
    """`upstream(text_config)` (transformers' `group_layers_by_attn_type`), with recurrent and stateless layers left
    out and parallel layers put in their attention group: the paged cache then allocates keys for attention only."""
    layer_types = getattr(text_config, "layer_types", None)
    if not layer_types or not set(layer_types) & SERVED_LAYER_TYPES:
        return upstream(text_config)
    groups: dict[str, list[int]] = {}
    for i, layer_type in enumerate(layer_types):
        if layer_type in RECURRENT_LAYER_TYPES or layer_type in STATELESS_LAYER_TYPES:
            continue
        layer_type = PARALLEL_LAYER_TYPES.get(layer_type, layer_type)
        if layer_type not in _cb_cache.ATTN_TYPE_TO_ALLOCATOR:
            raise ValueError(f"Invalid layer type: {layer_type}")
        groups.setdefault(layer_type, []).append(i)
    if not groups:
        raise ValueError("No attention layer: the engine's paged cache needs at least one")
    return groups


@contextlib.contextmanager
def attention_only_cache() -> Iterator[None]:
    """While an engine is built (its config resolved, its cache allocated): transformers groups the layers of a model
    with recurrent layers by `attention_layer_groups`. Process-wide for the duration (it patches the function both
    modules look up), serialised by a lock; models without recurrent layers get upstream's groups unchanged."""
    upstream = _cb_cache.group_layers_by_attn_type
    grouped = functools.partial(attention_layer_groups, upstream=upstream)
    with _groups_lock:
        _cb_cache.group_layers_by_attn_type = grouped
        _cb_initialization.group_layers_by_attn_type = grouped
        try:
            yield
        finally:
            _cb_cache.group_layers_by_attn_type = upstream
            _cb_initialization.group_layers_by_attn_type = upstream


@functools.cache
def _reads_recurrent_state(cls: type) -> bool:
    """Whether `cls.forward` reads a state through transformers' cache API (`get_conv_state` / `get_recurrent_state`):
    what marks a layer's token mixer, in every hybrid family of transformers 5.24. Cached per class (its source is
    read once per process, not per module of every engine build): the answer is the class's own, wrapped or not
    (`inspect.unwrap` reaches the original forward through `routed_forward`'s `functools.wraps`)."""
    forward = getattr(cls, "forward", None)
    try:
        source = inspect.getsource(inspect.unwrap(forward))
    except (OSError, TypeError):
        return False
    return "get_conv_state" in source or "get_recurrent_state" in source


def mixer_modules(model: torch.nn.Module, text_config: Any) -> dict[int, torch.nn.Module]:
    """The token-mixer module of each recurrent layer (`recurrent_layers`), found by its `layer_idx` and its forward
    reading a state through the cache API. `ValueError` naming the layers with none or more than one."""
    wanted = set(recurrent_layers(text_config))
    found: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if layer in wanted and _reads_recurrent_state(type(module)):
            found.setdefault(layer, []).append(module)
    bad = sorted(i for i in wanted if len(found.get(i, ())) != 1)
    if bad:
        raise ValueError(
            f"layers {bad} have no single module reading a recurrent state through transformers' cache API "
            "(get_conv_state / get_recurrent_state): the engine cannot keep their state"
        )
    return {i: modules[0] for i, modules in found.items()}


# ------------------------------------------------------------------------------------------------ installation


def stepper(cache: object) -> RecurrentStepper | None:
    """The recurrent stepper of an engine's cache; None for any other cache (or none)."""
    return getattr(cache, STEPPER_ATTR, None) if isinstance(cache, PagedAttentionCache) else None


def routed_forward(original: Callable) -> Callable:
    """A mixer class's `forward` routed through the engine's stepper when the call gets an engine cache; every other
    call (a training forward, a cached `generate()`) runs `original` itself, unchanged (`_upstream_patches` sets it on
    the class once per process: the classes are shared by every model of the family)."""

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        cache = next((kwargs[k] for k in CACHE_KWARGS if k in kwargs), None)
        found = stepper(cache)
        if found is None:
            return original(self, *args, **kwargs)
        return found.run(self, original, args, kwargs)

    return forward


def check_engine_settings(manager: ContinuousBatchingManager, model: PreTrainedModel, graphs: bool) -> None:
    """`ValueError` where `manager`'s resolved settings cannot keep `model`'s per-sequence states (no-op for a model
    without recurrent layers): accelerator graphs (trl_cb's, `decode_graphs.py`, or transformers'), an asynchronous or
    compiled engine (the step plan is built on the host), CPU offloading (it restores an offloaded request's keys, not
    its states). Call before the batch processor is built."""
    if not recurrent_layers(model.config.get_text_config()):
        return
    settings = resolved_engine_settings(manager)
    settings["use_cuda_graph"] = graphs or settings["use_cuda_graph"]
    require_synchronous_engine(settings, RECURRENT_STATE_NEEDS_SYNC)
    if (manager.continuous_batching_config.cpu_offload_space or 0) > 0:
        raise ValueError(
            "cpu_offload_space > 0 restores an offloaded request's keys but not its recurrent state: set "
            "cpu_offload_space=0 for a hybrid model (requests that do not fit are re-prefilled instead)"
        )


def new_stepper(manager: ContinuousBatchingManager, model: PreTrainedModel) -> RecurrentStepper | None:
    """The recurrent stepper of `manager`'s engine (built under `attention_only_cache`, its settings checked by
    `check_engine_settings`: a synchronous engine, whose `ContinuousBatchingIOs` the step plan reads), attached to its
    cache where the mixers find it; None for a model without recurrent layers. After warmup (the batch processor
    exists); `_upstream_patches.install` then attaches it to the cache, routes the mixer classes' `forward`
    (`routed_forward`, once per class), the engine's steps and the cache's lifetimes through it (`with_step_plan`,
    `with_slot_lifetimes`), and turns prefix matching off (a matched prefix has keys but no state)."""
    text_config = model.config.get_text_config()
    if not recurrent_layers(text_config):
        return None
    mixers = mixer_modules(model, text_config)
    return RecurrentStepper(text_config.num_hidden_layers, model.device, {type(m) for m in mixers.values()})


def with_step_plan(stepper: RecurrentStepper, ios: ContinuousBatchingIOs, compute: Callable) -> Callable:
    """`compute_batch` that plans the step (the batch's rows mapped to their state slots) before the forward."""

    def compute_with_plan(module: torch.nn.Module, batch_data: dict) -> None:
        stepper.plan_step(ios.requests_in_batch)
        try:
            compute(module, batch_data)
        finally:
            stepper.end_step()

    return compute_with_plan


def with_slot_lifetimes(cache: PagedAttentionCache, slots: RecurrentStateSlots) -> tuple[Callable, Callable, Callable]:
    """The cache's `free_blocks`, `free_all_requests` and `prepare_fork_request`, such that a sequence's slot lives
    as long as its KV blocks: freed with them, copied to the samples forked from it."""
    free_blocks, free_all = cache.free_blocks, cache.free_all_requests
    prepare_fork = cache.prepare_fork_request

    def free_blocks_and_state(request_id: str, no_cache: bool = False) -> None:
        free_blocks(request_id, no_cache)
        slots.free(request_id)

    def free_all_and_states(clear_ledgers: bool = False) -> None:
        free_all(clear_ledgers)
        slots.clear()

    def fork_with_state(src_state: Any, dst_req_ids: list[str], copy_src_and_dst: dict) -> list[str]:
        forked = prepare_fork(src_state, dst_req_ids, copy_src_and_dst)
        slots.fork(src_state.request_id, forked)
        return forked

    return free_blocks_and_state, free_all_and_states, fork_with_state
