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
- `manager.logit_processor` (a `ContinuousBatchingLogitsProcessorList`) is what the batch processor, built later by
  `warmup()`, applies to every step's logits. `install_request_processors` prepends trl_cb's per-request
  processors to it (`ContinuousBatchingLogitsProcessor` subclasses: `prepare_tensor_args` receives the requests with
  a new token, in the order of the logits rows, on the engine thread before the forward), and
  `check_processors_kept` compares it with `model._get_logits_processor(config)` — what `generate()` would apply — so
  a processor the engine drops raises instead of changing the sampled distribution silently.
- `RequestState.initial_tokens`, `.generated_tokens` and `._true_initial_tokens` (`_request_history`): a request's
  prompt and completion so far, also after the engine re-queued it with its tokens folded into the prompt.
- The engine's attention (`switch_to_generation_attention`): after `switch_to_cb_friendly_attn` picks `sdpa` or
  `paged|eager` (the dense-mask implementations), we put `trl_cb.attention.ATTENTION_NAME` on the model instead and
  record the training implementation in `manager._original_attn_impl`. It must happen before the batch processor is
  built: the engine allocates and fills its dense mask only for `sdpa`/`paged|eager` (`attn_mask_is_needed`), and
  passes the varlen inputs (`cu_seq_lens_q`/`cu_seq_lens_k`, `cache`) to every attention call. Not done when the
  engine uses accelerator graphs (`continuous_batching_config.cuda_graph_booleans`): our plan reads host-side lengths.
- `request_stop(HARD_STOP)` (`stop_now`): the loop checks it before every batch, exits after at most the forward in
  progress, and fails what is left. `manager.destroy()` / `stop()` flush instead (every outstanding request is
  generated to the end first: 28-43 s on a long round), so aborts never use them.
- `background_thread_status.local_status == STOPPED` is set by the thread's own `finally` (`mark_as_stopped`): we
  wait for it instead of `Thread.join`, which a `KeyboardInterrupt` can break on CPython 3.11 (the thread is marked
  stopped while it still runs).
- `ContinuousBatchingManager.__init__` switches the model's attention implementation *before* it can raise (e.g. a
  page_size below 4): `create_manager` restores it (and train/eval mode) from what it saw before.
- `varlen_attention.py` itself uses only what transformers hands every attention function on an engine forward
  (`cache`, `cu_seq_lens_q/k`, `cache.update(...)`), pinned in the same contract tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor
from transformers.generation.continuous_batching.utils import WorkloadHints
from transformers.generation.logits_process import LogitsProcessorList

from ..errors import EngineDiedError, GenerationError
from . import varlen_attention as attention
from .guards import deferred_interrupts
from .policy_logprobs import PolicyLogprobRecorder
from .request_processors import HistoryProcessor, RequestHistory

__all__ = [
    "ContinuousBatchingManager",
    "WorkloadHints",
    "add_forked_request",
    "check_processors_kept",
    "create_manager",
    "engine_fatal_error",
    "install_request_processors",
    "output_logprobs",
    "reshapes_distribution",
    "fsdp2_unsharded",
    "inflight_generated_lengths",
    "release",
    "reset_prefix_cache",
    "request_hard_stop",
    "resume",
    "stop_now",
    "suspend",
    "wait_for_thread_exit",
    "restore_training_attention",
    "switch_to_generation_attention",
]

_fork_lock = threading.Lock()


def create_manager(
    model: PreTrainedModel,
    generation_config: GenerationConfig,
    cb_config: ContinuousBatchingConfig,
    hints: WorkloadHints,
    request_processors: Sequence[HistoryProcessor] = (),
    record_policy_logprobs: bool = False,
    check_model: Callable[..., object] | None = None,
) -> ContinuousBatchingManager:
    """Build and warm up (on this thread, RNG preserved) a fresh manager; its thread is *not* started (`resume`
    starts it). Never reuses a cached one.

    The engine's processors are checked against `generate()`'s for `generation_config` (`check_processors_kept`),
    `request_processors` run before them at every step (`install_request_processors`) and trl_cb's attention is
    chosen (`_choose_attention`, which refuses through `check_model` a model the engine's attention would not serve
    exactly), all before the batch processor and its cache exist. With `record_policy_logprobs`, every result's
    logprobs also carry the trainer-comparable value (`install_policy_logprob_recorder`, `output_logprobs`). On any
    failure the model keeps
    its attention implementation and train/eval mode: the manager's constructor switches the former and calls
    `eval()` before it can raise.
    """
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        # A cached manager would be returned as-is and silently ignore our configs (notes: "persistent pitfalls").
        model.destroy_cached_continuous_batching_manager()
    devices = [model.device] if model.device.type == "cuda" else []
    attn_before, training_before = model.config._attn_implementation, model.training
    if attn_before == attention.ATTENTION_NAME:
        # Another engine on this model (async rollouts) keeps trl_cb's attention on the shared config, and upstream's
        # constructor accepts only its own names: build from `sdpa` (what ATTENTION_NAME runs outside an engine).
        model.set_attn_implementation("sdpa")
    try:
        with torch.random.fork_rng(devices=devices):
            manager = model.init_continuous_batching(
                generation_config=generation_config, continuous_batching_config=cb_config, workload_hints=hints
            )
            check_processors_kept(manager, model, generation_config)
            if request_processors:
                install_request_processors(manager, request_processors)
            _choose_attention(manager, model, check_model)  # before warmup builds the batch processor (no dense mask)
            if attn_before == attention.ATTENTION_NAME:
                manager._original_attn_impl = attn_before  # after this engine's rounds, the other engine's again
            recorder = PolicyLogprobRecorder(generation_config.temperature) if record_policy_logprobs else None
            if recorder is not None:
                _require_synchronous(manager, "recording the trainer-comparable logprob of each sampled token")
                manager.logit_processor.logits_processor.insert(0, recorder)  # sees the raw logits of every row
                manager.logit_processor.do_processing = True
            manager.warmup()
            if recorder is not None:
                install_policy_logprob_recorder(manager, recorder)
    except BaseException:
        if model.config._attn_implementation != attn_before:
            model.set_attn_implementation(attn_before)
        model.train(training_before)
        raise
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
    # Interrupt-safe: the handle is dropped only once the thread has exited (`wait_for_thread_exit`).
    with deferred_interrupts():
        status = manager.background_thread_status
        status.request_stop(status.FLUSH_AND_STOP, manager.distributed_helper.global_rank)
        manager._wake_up_loop.set()  # end the idle loop's 100 ms poll now rather than at its timeout
        if not wait_for_thread_exit(manager, timeout=None):  # pragma: no cover - unbounded wait
            raise EngineDiedError("The continuous batching engine thread did not stop.")


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
    """Restart a suspended engine's thread on its kept batch processor (no re-seeding, no re-allocation)."""
    switch_to_generation_attention(manager, model)
    if not manager.is_running():
        manager.start()


#: Manager attribute (ours): whether this engine runs `trl_cb.attention`, decided once, because its batch processor
#: was built without the dense mask and every later round must use the same implementation.
_VARLEN_FLAG = "_trl_cb_varlen_attention"


def _choose_attention(
    manager: ContinuousBatchingManager, model: PreTrainedModel, check_model: Callable[..., object] | None
) -> None:
    """Decide, once per engine, whether it runs `trl_cb.attention` (see `switch_to_generation_attention`).

    The model was checked (`compat.check_model`) against the engine attention it would get without accelerator
    graphs; with graphs on, a dense-mask implementation stays, so the model is checked again against that one (a
    soft-capped or sink model is refused here (`check_model(model, cuda_graphs=True)`, the caller's model check)
    rather than sampled without its soft-cap or sinks."""
    impl = model.config._attn_implementation
    graphs = any(manager.continuous_batching_config.cuda_graph_booleans)
    if graphs and attention.replaces(impl):
        if check_model is None:
            raise ValueError("An engine with accelerator graphs needs the model check (`check_model`) to be built.")
        check_model(model, cuda_graphs=True)
    setattr(manager, _VARLEN_FLAG, attention.replaces(impl, graphs))
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


# --------------------------------------------------------------------------------------------- logits processors


def check_processors_kept(
    manager: ContinuousBatchingManager, model: PreTrainedModel, generation_config: GenerationConfig
) -> None:
    """`ValueError` unless the engine applies, in order, exactly the processors `generate()` builds from
    `generation_config`, each with the same settings.

    The engine keeps a processor as-is or swaps it 1:1 for its per-request version (`CLASSIC_TO_CB_PROCESSORS_MAP`,
    which copies the settings into attributes of the same names), and drops the ones it marks unsupported. So the
    check pairs them up by position: same class or its per-request class, and every setting the two share equal.
    """
    from transformers.generation.continuous_batching.cb_logits_processors import CLASSIC_TO_CB_PROCESSORS_MAP

    expected = list(model._get_logits_processor(generation_config))
    kept = list(manager.logit_processor.logits_processor)
    problems = [] if len(kept) == len(expected) else [f"kept {len(kept)} of {len(expected)}"]
    for want, got in zip(expected, kept):
        if type(got) not in (type(want), CLASSIC_TO_CB_PROCESSORS_MAP.get(type(want))):
            problems.append(f"{type(want).__name__} became {type(got).__name__}")
            continue
        shared = set(vars(want)) & set(vars(got))
        changed = sorted(name for name in shared if not _same_setting(vars(want)[name], vars(got)[name]))
        if changed:
            problems.append(f"{type(want).__name__} changed {changed}")
    if problems:
        raise ValueError(
            f"The continuous batching engine does not apply the logits processors generate() would "
            f"({[type(p).__name__ for p in expected]}): {'; '.join(problems)}. Sampling would not follow the "
            "generation config; trl_cb's field table (trl_cb/generation_settings.py) needs updating for this "
            "transformers version."
        )


def _same_setting(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # objects without a plain equality: compare identity
        return a is b


class PerRequestProcessor(ContinuousBatchingLogitsProcessor):
    """Adapts trl_cb `HistoryProcessor`s to the engine's processor interface, as one engine processor.

    Takes no per-request kwargs and no tensor argument (one zero row, as the interface requires one per processor);
    it reads each request's history once per step in `prepare_tensor_args`, which the engine calls right before the
    forward, and applies the processors in order.
    """

    supported_kwargs: dict[str, type] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, processors: Sequence[HistoryProcessor]) -> None:
        self.processors = list(processors)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        histories = [_request_history(future.state) for future in requests_with_new_token]
        for processor in self.processors:
            processor.prepare(histories)
        return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:
            scores = processor(scores)
        return scores


def _request_history(state: Any) -> RequestHistory:
    prompt_len = state._true_initial_tokens or len(state.initial_tokens)
    return RequestHistory(
        request_id=state.request_id,
        key=state,
        prompt_len=prompt_len,
        prefix=state.initial_tokens,
        generated=state.generated_tokens,
    )


def install_request_processors(manager: ContinuousBatchingManager, processors: Sequence[HistoryProcessor]) -> None:
    """Run `processors` first on every step's logits (before the batch processor is built: call before warmup).

    They need each request's tokens up to the row being sampled on the host, so the engine must prepare a step only
    after the previous one finished: no async batching, no CUDA graphs or compilation (which would freeze the
    processors' per-step tensors). `ValueError` if the resolved engine config has any of them.
    """
    _require_synchronous(manager, "repetition_penalty / min_new_tokens / min_length (read each request's history)")
    processor_list = manager.logit_processor
    processor_list.logits_processor = LogitsProcessorList(
        [PerRequestProcessor(processors), *processor_list.logits_processor]
    )
    processor_list.tensors_required += 1
    processor_list.do_processing = True


def _require_synchronous(manager: ContinuousBatchingManager, what: str) -> None:
    """`ValueError` unless the resolved engine config steps synchronously and uncompiled: `what` reads host-side
    per-step state that async batching (step n+1 prepared before step n's tokens exist), accelerator graphs and
    compilation (frozen per-step tensors) would break."""
    cfg = manager.continuous_batching_config  # resolved by the manager's constructor
    compiled = cfg.varlen_compile_config is not None or cfg.decode_compile_config is not None
    if any(cfg.cuda_graph_booleans) or cfg.use_async_batching or compiled:
        raise ValueError(
            f"{what} needs the engine's synchronous, uncompiled path: set use_cuda_graph=False and "
            f"use_async_batching=False and no compile config (resolved: use_cuda_graph={cfg.use_cuda_graph}, "
            f"use_async_batching={cfg.use_async_batching}, varlen_compile_config={cfg.varlen_compile_config}, "
            f"decode_compile_config={cfg.decode_compile_config})."
        )


def reshapes_distribution(model: PreTrainedModel, generation_config: GenerationConfig) -> bool:
    """Whether `generate()` would apply any logits processor besides temperature for `generation_config` (the
    engine's own copy, trl_cb's per-request fields excluded): then the sampled distribution is not the one TRL's
    trainer models, and the trainer-comparable logprob must be recorded separately."""
    from transformers.generation.logits_process import TemperatureLogitsWarper

    return any(not isinstance(p, TemperatureLogitsWarper) for p in model._get_logits_processor(generation_config))


def install_policy_logprob_recorder(manager: ContinuousBatchingManager, recorder: PolicyLogprobRecorder) -> None:
    """After warmup: run `recorder.record` right after the engine samples each step, and hand each token's recorded
    value to the host beside the engine's own logprob. The request state then stores `(processed, policy)` pairs in
    its `logprobs` list, so they follow the tokens through forks and re-queues; `output_logprobs` splits them.

    Internals (pinned by tests/unit/test_contracts.py): `batch_processor.model_runner._sample(scores, output_ids)`
    writes the step's tokens to `output_ids[0, :rows]`, and `batch_processor.inputs_and_outputs
    .prepare_batch_update()` returns `(requests, tokens, logprobs)` for the same rows, in the same order."""
    processor = manager.batch_processor
    runner, ios = processor.model_runner, processor.inputs_and_outputs
    sample, prepare = runner._sample, ios.prepare_batch_update

    def sample_and_record(scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        sample(scores, output_ids)
        recorder.record(output_ids)

    def batch_update_with_policy_logprobs() -> tuple[Any, Any, Any]:
        requests, tokens, logprobs = prepare()
        if logprobs is not None and tokens:
            policy = recorder.read(len(tokens))
            if policy is not None:
                logprobs = list(zip(logprobs, policy, strict=True))
        return requests, tokens, logprobs

    runner._sample = sample_and_record
    ios.prepare_batch_update = batch_update_with_policy_logprobs


def output_logprobs(output: Any) -> tuple[list[float], list[float]]:
    """`(processed, policy)` logprobs of a finished request's tokens: the distribution the token was sampled from,
    and `log_softmax(logits / T)` over the whole vocabulary (TRL's training quantity), both from the sampler's logits.
    They are the same values when no recorder was installed (nothing but temperature shapes the distribution).
    `GenerationError` (with the request id) if the engine returned a logprob count other than the token count."""
    values = output.logprobs
    if len(values) != len(output.generated_tokens):
        raise GenerationError(
            output.request_id, f"{len(output.generated_tokens)} tokens but {len(values)} logprobs returned"
        )
    if values and isinstance(values[0], tuple):
        if not all(isinstance(v, tuple) for v in values):
            raise GenerationError(output.request_id, "a token was sampled without its trainer-comparable logprob")
        return [float(v[0]) for v in values], [float(v[1]) for v in values]
    processed = [float(v) for v in values]
    return processed, processed[:]


# ---------------------------------------------------------------------------------------- model compatibility


def engine_layer_groups(text_config: Any) -> dict[str, list[int]]:
    """Layer indices per attention type, exactly as the engine groups them for its cache allocators.

    Raises `ValueError` ("Invalid layer type: ...") for a layer type the engine has no cache allocator for. A config
    without `layer_types` is all sliding when it sets `sliding_window`, else all full attention.
    """
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    return group_layers_by_attn_type(text_config)


def engine_attention_layer_types() -> frozenset[str]:
    """The layer types the engine can cache (one allocator each): full and sliding-window attention."""
    from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR

    return frozenset(ATTN_TYPE_TO_ALLOCATOR)


def engine_cache_geometry(text_config: Any) -> tuple[int, int]:
    """(key/value heads, head size) of every key *and* value slot of the engine's cache, for every layer."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    return find_num_key_value_heads(text_config), find_head_dim(text_config)
