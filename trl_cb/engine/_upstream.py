"""The gateway to transformers' continuous-batching engine: build, start, suspend, stop and free it; read its state.

transformers' CB engine is young and moves between minor releases. Everything trl_cb relies on beyond the documented
`init_continuous_batching` / `add_request` / `get_result` / `pause` / `stop` / `destroy` surface is reached from the
modules named `_upstream*` (this one; `_upstream_patches`, which sets every engine method trl_cb changes, and the
feature modules whose builders it composes), and tests/unit/test_contracts.py pins each internal, so an upstream
change fails one cheap test with a clear message instead of corrupting rollouts. The list of what is relied on, and
why: docs/architecture.md, "Upstream surface".

Invariants: the caller's global RNG is never re-seeded (the batch processor is built inside `fork_rng`); the model
keeps its training attention implementation outside rounds (and after a failed build); no engine thread lives
between rounds (`suspend`); an abort never flushes (`stop_now` hard-stops, waiting for the thread's own end marker).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.utils import WorkloadHints

from ..errors import EngineDiedError, GenerationError
from . import _upstream_cache, _upstream_decode, _upstream_geometry, _upstream_recurrent, cuda_kernels
from . import _upstream_patches as _patches
from . import _upstream_sampling as _sampling
from . import decode_graphs as _graphs
from . import varlen_attention as attention
from .guards import deferred_interrupts
from .request_processors import CHILD_MARK, HistoryProcessor

logger = logging.getLogger(__name__)
_fork_lock = threading.Lock()

#: The transformers minor releases whose CB internals this module is checked against (tests/unit/test_contracts.py);
#: pyproject.toml pins the same range. A new minor release can change them without an error anywhere: 5.24.0 ran
#: unchanged trl_cb with CB logprobs 8.9 nats off teacher forcing (it moved the paged-cache write from the attention
#: function into the model; `_upstream_cache.engine_layer` follows both), which would train on wrong IS weights.
TESTED_TRANSFORMERS = ("5.23", "5.24")
#: Set to 1 to build an engine on an untested transformers release anyway (at your own risk: run the contract tests).
ALLOW_UNTESTED_ENV = "TRL_CB_ALLOW_UNTESTED_TRANSFORMERS"


def check_transformers_version(version: str | None = None) -> None:
    """`RuntimeError` unless transformers' `major.minor` is one trl_cb was checked against (or `ALLOW_UNTESTED_ENV`
    is set): an untested release may change the CB internals and corrupt logprobs without raising."""
    version = transformers.__version__ if version is None else version
    if ".".join(version.split(".")[:2]) in TESTED_TRANSFORMERS or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise RuntimeError(
        f"trl_cb was checked against transformers {', '.join(TESTED_TRANSFORMERS)} (its continuous-batching internals "
        f"change between minor releases), but transformers {version} is installed. Install a tested release (the "
        f"range in trl_cb's pyproject.toml), or set {ALLOW_UNTESTED_ENV}=1 and run trl_cb's contract tests "
        "(tests/unit/test_contracts.py) first: an untested release can produce wrong logprobs silently."
    )


def create_manager(
    model: PreTrainedModel,
    generation_config: GenerationConfig,
    cb_config: ContinuousBatchingConfig,
    hints: WorkloadHints,
    request_processors: Sequence[HistoryProcessor] = (),
    record_policy_logprobs: bool = False,
    graphs: bool = False,
) -> ContinuousBatchingManager:
    """Build and warm up (on this thread, RNG preserved) a fresh manager; its thread is *not* started (`resume`
    starts it). Never reuses a cached one.

    The engine's processors are checked against `generate()`'s for `generation_config`, `request_processors` run
    before them at every step, a policy-logprob recorder first of all with `record_policy_logprobs`
    (`_upstream_sampling`), and trl_cb's attention is chosen (`_choose_attention`), all before the batch processor
    and its cache exist; with `graphs` (and a graph backend for the device) decode steps read the cache through
    block tables and run as graphs kept across rounds (`decode_graphs.py`). After warmup `_upstream_patches.install`
    sets trl_cb's behaviour on the engine. The model leaves with the attention implementation it came with (`resume`
    switches it for each round), and on any failure, a KeyboardInterrupt included, with its train/eval mode too: the
    manager's constructor switches the former and calls `eval()` before it can raise, and the restore runs with SIGINT
    deferred (a second Ctrl-C inside it would otherwise leave the engine's implementation on the training model).
    """
    check_transformers_version()
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        # A cached manager would be returned as-is and silently ignore our configs (notes: "persistent pitfalls").
        model.destroy_cached_continuous_batching_manager()
    devices = [model.device] if model.device.type == "cuda" else []
    attn_before, training_before = attention_implementation(model), model.training
    if attn_before == attention.ATTENTION_NAME:
        # Another engine on this model (async rollouts) keeps trl_cb's attention on the shared config, and upstream's
        # constructor accepts only its own names: build from `sdpa` (what ATTENTION_NAME runs outside an engine).
        model.set_attn_implementation("sdpa")
    try:
        # A hybrid model's cache is built for its attention layers; its recurrent layers keep states beside it.
        text = model.config.get_text_config()
        with (
            torch.random.fork_rng(devices=devices),
            _upstream_recurrent.attention_only_cache(),
            _upstream_geometry.per_group_geometry(text),
        ):
            manager = model.init_continuous_batching(
                generation_config=generation_config, continuous_batching_config=cb_config, workload_hints=hints
            )
            recorder = _sampling.install_processors(
                manager, model, generation_config, request_processors, record_policy_logprobs
            )
            _choose_attention(manager, model)  # before warmup builds the batch processor (no dense mask)
            _upstream_recurrent.check_engine_settings(manager, model, graphs)
            if attn_before == attention.ATTENTION_NAME:
                manager._original_attn_impl = attn_before  # after this engine's rounds, the other engine's again
            backend = _graphs.backend_for(model.device) if graphs else None
            if graphs and backend is None:
                logger.warning("No graph backend on %s: decode steps run eagerly.", model.device)
            longest = hints.max_prompt_length + hints.max_generated_length
            block_tables = backend is not None and _graphs.enable_block_table_decode(manager, longest)
            if backend is not None and not block_tables:
                logger.info("This model's layers read no block table: decode steps run eagerly, without graphs.")
            manager.warmup()
            choose_cuda_kernel(manager, model)
            stepper = _upstream_recurrent.new_stepper(manager, model)  # a hybrid's recurrent layers, else None
            graph_backend = backend if block_tables else None
            features = _patches.Features(attention.ATTENTION_NAME, recorder, graph_backend, stepper)
            _patches.install(manager, model, features)
            restore_training_attention(manager)  # inside the try: an interrupt here is restored below too
    except BaseException:
        with deferred_interrupts():
            if attention_implementation(model) != attn_before:
                model.set_attn_implementation(attn_before)
            model.train(training_before)
        raise
    return manager


def choose_cuda_kernel(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """On CUDA: the fused attention kernels this engine uses (`cuda_kernels.choose`, checked once per slot shape; a
    kernel every shape agreed on, else the reference), kept on its cache where the attention paths read them
    (`_upstream_cache.KERNELS_ATTR`). A latent layer's attention sees the keys it expanded, not its slot: reference.
    Call after warmup."""
    if model.device.type != "cuda":
        return
    text = model.config.get_text_config()
    if _upstream_geometry.expands_cached_keys(text):
        return
    sinks = any(getattr(m, "sinks", None) is not None for m in model.modules())
    chosen = [
        cuda_kernels.choose(
            model.device,
            model.dtype,
            manager.continuous_batching_config.page_size,
            text.num_attention_heads,
            shape.kv_heads,
            shape.key_width,
            softcap=getattr(text, "attn_logit_softcapping", None),
            sinks=sinks,
        )
        for shape in sorted(set(_upstream_geometry.layer_shapes(text)), key=repr)
    ]
    packed, paged = ({getattr(k, field) for k in chosen} for field in ("packed", "paged"))
    kernels = cuda_kernels.Kernels(
        packed.pop() if len(packed) == 1 else cuda_kernels.REFERENCE,
        paged.pop() if len(paged) == 1 else cuda_kernels.REFERENCE,
    )
    setattr(manager.batch_processor.cache, _upstream_cache.KERNELS_ATTR, kernels)


def attention_implementation(model: PreTrainedModel) -> str:
    """The attention implementation `model` runs now (transformers keeps it in the private
    `config._attn_implementation`; `set_attn_implementation` is the public setter)."""
    return model.config._attn_implementation


def recorded_alternatives(manager: ContinuousBatchingManager) -> Callable[[str], Any] | None:
    """Where a finished request's `top_logprobs` are taken from (`TopLogprobs.pop`), on an engine that records
    them; else None."""
    found = _sampling.request_processor(manager, _sampling.TopLogprobs)
    return found.pop if found is not None else None


#: `add_forked_request`'s `eos_token_id` for requests that EOS does not end (transformers' "no EOS" id).
NO_EOS = -1


def add_forked_request(
    manager: ContinuousBatchingManager,
    input_ids: list[int],
    request_id: str,
    num_samples: int,
    max_new_tokens: int,
    processor_kwargs: dict[str, Any] | None = None,
    streaming: bool = False,
    eos_token_id: int | list[int] | None = None,
) -> list[str]:
    """Submit one prompt whose prefill is shared by `num_samples` sampled continuations; return their request ids.

    The engine prefills the prompt once, then forks `num_samples - 1` children that share its full KV blocks (and
    copy its `processor_kwargs`: per-request temperature / top_k / top_p on an engine built with
    `per_request_processors`). With `streaming`, every step of each sample also puts its output so far (unfinished)
    on the output queue (the children inherit it); the decode fast path then takes those rows the slow way.
    A one-token prompt is submitted as `num_samples` requests under the same ids instead: transformers forks after
    prefilling all but a prompt's last token, which leaves a one-token prompt an empty forward (it fails), and such a
    prompt has nothing to share. `eos_token_id`: the requests' own EOS ids (`NO_EOS`: none end them), else the
    engine's generation config's.
    """
    if len(input_ids) == 1 and num_samples > 1:
        ids = [request_id] + [f"{request_id}{CHILD_MARK}{i}" for i in range(num_samples - 1)]
        for rid in ids:
            add_forked_request(manager, input_ids, rid, 1, max_new_tokens, processor_kwargs, streaming, eos_token_id)
        return ids
    with _fork_lock:
        manager.num_return_sequences = num_samples
        try:
            # the call as before unless a caller watches steps or sets the EOS
            extra = {"streaming": True} if streaming else {}
            extra.update({} if eos_token_id is None else {"eos_token_id": eos_token_id})
            rid = manager.add_request(
                input_ids, request_id=request_id, max_new_tokens=max_new_tokens, **extra, **(processor_kwargs or {})
            )
        finally:
            manager.num_return_sequences = 1
    if rid is None:
        raise EngineDiedError(f"The continuous batching engine refused request {request_id}: it is stopping.")
    return [rid] + [f"{rid}{CHILD_MARK}{i}" for i in range(num_samples - 1)]


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

    No engine thread lives between rounds, so nothing runs forwards of the module while the trainer does. (The OpenMP
    wait policy an idle torch thread would bring is held by `openmp.py` either way.)
    """
    # Not `manager.stop()`: it also runs `gc.collect()` and caches the manager on the model, both per round. The loop
    # exits on FLUSH_AND_STOP once nothing is pending; the batch processor stays on the manager.
    # Interrupt-safe: the handle is dropped only once the thread has exited (`wait_for_thread_exit`).
    with deferred_interrupts():
        status = manager.background_thread_status
        status.request_stop(status.FLUSH_AND_STOP, manager.distributed_helper.global_rank)
        manager._wake_up_loop.set()  # end the idle loop's 100 ms poll now rather than at its timeout
        if not wait_for_thread_exit(manager, timeout=None):  # pragma: no cover - unbounded wait
            raise EngineDiedError("The continuous batching engine thread did not stop.")
    republish_threads()


def republish_threads() -> None:
    """Make the caller's intra-op thread count the default of threads started from now on again.

    `torch.set_num_threads` on the engine thread (`_upstream_patches`) also sets the count a new thread takes at its
    first parallel op; once the engine thread is gone, the caller's own count (unchanged) is published back."""
    torch.set_num_threads(torch.get_num_threads())


def request_hard_stop(manager: ContinuousBatchingManager) -> None:
    """Ask the loop to stop before its next batch (after at most the forward in progress), failing what is left.
    Returns at once; pair with `wait_for_thread_exit`."""
    status = manager.background_thread_status
    status.request_stop(status.HARD_STOP, manager.distributed_helper.global_rank)
    manager._wake_up_loop.set()


def wait_for_thread_exit(manager: ContinuousBatchingManager, timeout: float | None) -> bool:
    """Wait until the engine thread has exited; then drop its handle. False (handle kept) if `timeout` passed first.

    Not `Thread.join`: on CPython 3.11 a `KeyboardInterrupt` inside `join` marks the thread stopped while it still
    runs. We poll the loop's own end marker (`mark_as_stopped`, the last thing its `finally` does) and join only
    after it, when the thread has nothing left to run but a log line.
    """
    thread = manager._generation_thread
    if thread is None:
        return True
    if thread.ident is None:  # created but never started
        manager._generation_thread = None
        return True
    status = manager.background_thread_status
    deadline = None if timeout is None else time.monotonic() + timeout
    while thread.is_alive() and status.local_status != status.STOPPED:
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    thread.join(timeout=5.0)
    if thread.is_alive():  # pragma: no cover - only a log call was left to run
        return False
    manager._generation_thread = None
    return True


def stop_now(manager: ContinuousBatchingManager, timeout: float | None = 60.0) -> bool:
    """Hard-stop the engine thread (outstanding requests are abandoned, not generated) and wait for it to exit."""
    request_hard_stop(manager)
    return wait_for_thread_exit(manager, timeout)


def release(manager: ContinuousBatchingManager) -> None:
    """Free a stopped engine's batch processor (cache) and distributed resources. Call after `stop_now`."""
    manager.batch_processor = None
    manager.distributed_helper.destroy_cpu_comm_group()


def resume(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """Restart a suspended engine's thread on its kept batch processor (no re-seeding, no re-allocation); its decode
    graphs are dropped first if a weight they read moved (`decode_graphs.DecodeGraphs.check`)."""
    check_graphs(manager, model)
    switch_to_generation_attention(manager, model)
    if not manager.is_running():
        manager.start()


def check_graphs(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """Drop the engine's decode graphs if a weight of `model` they read moved (call with no step running: before a
    round, or inside a pause after the weights were written)."""
    graphs = _graphs.graphs_of(manager)
    if graphs is not None:
        graphs.check(model)


#: Manager attribute (ours): whether this engine runs `varlen_attention`, decided once, because its batch processor
#: was built without the dense mask and every later round must use the same implementation.
_VARLEN_FLAG = "_trl_cb_varlen_attention"


def _choose_attention(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """Decide, once per engine, whether it runs `varlen_attention` (see `switch_to_generation_attention`): where
    transformers would run a dense-mask implementation (`attention.replaces`). transformers' own accelerator graphs,
    which would need that dense mask, are never turned on (trl_cb's decode graphs read block tables instead)."""
    setattr(manager, _VARLEN_FLAG, attention.replaces(attention_implementation(model)))
    switch_to_generation_attention(manager, model)


def switch_to_generation_attention(manager: ContinuousBatchingManager, model: PreTrainedModel) -> None:
    """Put the engine's attention implementation on the model (idempotent).

    transformers' choice first (flash when available, else `sdpa` / `paged|eager`); for an engine built to run
    `varlen_attention.ATTENTION_NAME` (per-request attention, honours softcap; `_choose_attention`), a dense-mask
    choice is replaced by it. `manager._original_attn_impl` keeps the training implementation.
    """
    if attention_implementation(model) == attention.ATTENTION_NAME:
        return
    manager.switch_to_cb_friendly_attn(model, manager.continuous_batching_config.auto_switch_to_flash)
    chosen = attention_implementation(model)
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


def check_alive(manager: ContinuousBatchingManager, what: str) -> None:
    """`EngineDiedError` ("The continuous batching engine stopped {what}", with its fatal error) unless the engine's
    thread still runs."""
    error = engine_fatal_error(manager)
    if error is not None or not manager.is_running():
        suffix = f": {error!r}" if error is not None else "."
        raise EngineDiedError(f"The continuous batching engine stopped {what}{suffix}") from error


def finished_output(result: Any) -> Any | None:
    """`result` once its request has finished, `None` while it runs; `GenerationError` if the request failed."""
    if not result.is_finished():
        return None
    if result.error is not None:
        raise GenerationError(result.request_id, str(result.error))
    return result


def inflight_generated_lengths(manager: ContinuousBatchingManager) -> dict[str, int]:
    """Tokens generated so far by every request the scheduler holds (active or waiting). Call under `pause()`."""
    processor = manager.batch_processor
    if processor is None:
        return {}
    _upstream_decode.write_pending_states(processor)  # the decode fast path writes request states lazily
    scheduler = processor.scheduler
    states = {**scheduler.waiting_requests, **scheduler.active_requests}
    return {rid: len(state.generated_tokens) for rid, state in states.items()}


# ---------------------------------------------------------------------------------------- model compatibility


def engine_layer_groups(text_config: Any) -> dict[str, list[int]]:
    """Layer indices per attention type, exactly as the engine groups them for its cache allocators (recurrent and
    MLP-only layers of a hybrid model left out: `_upstream_recurrent.attention_layer_groups`).

    Raises `ValueError` ("Invalid layer type: ...") for a layer type the engine has no cache allocator for. A config
    without `layer_types` is all sliding when it sets `sliding_window`, else all full attention.
    """
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    return _upstream_recurrent.attention_layer_groups(text_config, group_layers_by_attn_type)


def engine_attention_layer_types() -> frozenset[str]:
    """The layer types the engine can cache (one allocator each): full and sliding-window attention."""
    from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR

    return frozenset(ATTN_TYPE_TO_ALLOCATOR)


def engine_cache_geometry(text_config: Any) -> list[_upstream_geometry.SlotShape]:
    """Each layer's cache slot (KV heads, key and value widths) as the engine builds it (`_upstream_geometry`: one
    shape per layer group). `ValueError` where a group's layers differ, a sliding group's keys and values differ in
    width, or a latent-attention family is not measured exact."""
    shapes = _upstream_geometry.layer_shapes(text_config)
    for kind, layers in engine_layer_groups(text_config).items():
        shape = _upstream_geometry.group_shape(shapes, layers)
        if kind != "full_attention" and shape.key_width != shape.value_width:
            raise ValueError(f"{kind} layers {layers}: keys and values of different widths ({shape}) are not served")
    return shapes
