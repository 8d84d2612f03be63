"""transformers' CB sampling internals, beside `_upstream` (same rule: the only other place they are touched).

How a step samples: with `sampler.py`'s exponential race instead of transformers' `torch.multinomial`
(`race_sample`; same probabilities, same logprob). What a step samples from: the engine's logits processors are
checked against the ones `generate()` builds (`check_processors_kept`), trl_cb's per-request processors run first
(`install_request_processors`), and, when the distribution is reshaped beyond temperature,
`engine/policy_logprobs.py`'s recorder before them all; it gathers the trainer-comparable logprob after the engine
samples and hands it to the host beside the engine's own (`recording_sample`, `with_policy_logprobs`,
`output_logprobs`). `_upstream_patches` puts these on the engine.
Pinned by tests/unit/test_contracts.py.

Invariant: a step's tokens, processed logprobs and recorded policy logprobs are read for the same rows in the same
order; what reads per-step state on the host runs only on a synchronous, uncompiled engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor
from transformers.generation.logits_process import LogitsProcessorList

from ..errors import GenerationError
from . import sampler
from .policy_logprobs import PolicyLogprobRecorder
from .request_processors import (
    POLICY_LOGPROBS_NEED_SYNC,
    REQUEST_KWARGS,
    HistoryProcessor,
    RequestHistory,
    SeededRows,
    TopLogprobs,
    require_synchronous_engine,
)

_P = TypeVar("_P")


def install_processors(
    manager: ContinuousBatchingManager,
    model: PreTrainedModel,
    generation_config: GenerationConfig,
    request_processors: Sequence[HistoryProcessor],
    record_policy_logprobs: bool,
) -> PolicyLogprobRecorder | None:
    """Before warmup: check the engine's processors, put trl_cb's per-request ones first and, with
    `record_policy_logprobs`, the recorder before everything (it must see the raw logits). Returns the recorder, to
    be wired in by `_upstream_patches` once warmup has built the batch processor."""
    check_processors_kept(manager, model, generation_config)
    if manager.continuous_batching_config.per_request_processors:
        per_request_min_p(manager)
    if request_processors:
        install_request_processors(manager, request_processors)
    if not record_policy_logprobs:
        return None
    require_synchronous_engine(resolved_engine_settings(manager), POLICY_LOGPROBS_NEED_SYNC)
    recorder = PolicyLogprobRecorder(generation_config.temperature)
    processor_list = manager.logit_processor
    if manager.continuous_batching_config.per_request_processors:  # each request may carry its own temperature
        processor_list.logits_processor.insert(0, PerRequestPolicyLogprobs(recorder))
        processor_list.tensors_required += 1
    else:
        processor_list.logits_processor.insert(0, recorder)
    processor_list.do_processing = True
    return recorder


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
            "generation config; trl_cb's field table (trl_cb/checks/generation_settings.py) needs updating for this "
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

    Takes no tensor argument (one zero row, as the interface requires one per processor); it reads each request's
    history and own settings (`REQUEST_KWARGS`, which requests may then carry) once per step in `prepare_tensor_args`,
    which the engine calls right before the forward, and applies the processors in order.
    """

    supported_kwargs: dict[str, type] = REQUEST_KWARGS
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


class PerRequestMinP(ContinuousBatchingLogitsProcessor):
    """`generate()`'s `MinPLogitsWarper` with each request's own `min_p` (the engine's kwarg, else the warper's): drop
    the tokens whose probability is below `min_p` x the row's top probability, at the same place among the warpers
    (after temperature, top-k and top-p). transformers has no per-request version; `per_request_min_p` swaps it in."""

    supported_kwargs: dict[str, type] = {"min_p": float}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, warper: Any) -> None:
        self.min_p = float(warper.min_p)
        self.filter_value = warper.filter_value
        self.min_tokens_to_keep = warper.min_tokens_to_keep

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.full_like(int32_tensor, self.min_p, dtype=torch.float32).view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        values = [r.state.logit_processor_kwargs.get("min_p", self.min_p) for r in requests_with_new_token]
        return torch.tensor(values, dtype=torch.float32).view(dtype=torch.int32)  # the engine's bulk dtype

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        min_p = tensor_arg[: scores.size(0)].view(dtype=torch.float32).to(scores.device).unsqueeze(-1)  # (rows, 1)
        probs = torch.softmax(scores, dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        keep = torch.topk(probs, min(self.min_tokens_to_keep, probs.size(-1)), dim=-1).indices
        return scores.masked_fill(remove.scatter_(-1, keep, False), self.filter_value)


def per_request_min_p(manager: ContinuousBatchingManager) -> None:
    """Replace the engine's `MinPLogitsWarper` (built when its config sets `min_p`) by `PerRequestMinP`, in place, so
    that requests may carry their own `min_p` (call before warmup, which sizes the tensor arguments)."""
    from transformers.generation.logits_process import MinPLogitsWarper

    processor_list = manager.logit_processor
    for i, processor in enumerate(processor_list.logits_processor):
        if isinstance(processor, MinPLogitsWarper):
            processor_list.logits_processor[i] = PerRequestMinP(processor)
            processor_list.tensors_required += 1
            processor_list.supported_keys.update(PerRequestMinP.supported_kwargs)


class PerRequestPolicyLogprobs(ContinuousBatchingLogitsProcessor):
    """The policy-logprob recorder on an engine with per-request processors: each row is divided by its own
    request's temperature (the engine's `temperature` kwarg, else the config's), as the engine's per-request
    temperature warper does, so `log_softmax(raw / T)` is the trainer's quantity for every request in a mixed batch."""

    supported_kwargs: dict[str, type] = {"temperature": float}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, recorder: PolicyLogprobRecorder) -> None:
        self.recorder = recorder

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        default = torch.full_like(int32_tensor, self.recorder.temperature, dtype=torch.float32)
        int32_tensor.copy_(default.view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        default = self.recorder.temperature
        temperatures = [r.state.logit_processor_kwargs.get("temperature", default) for r in requests_with_new_token]
        return torch.tensor(temperatures, dtype=torch.float32).view(dtype=torch.int32)  # the engine's bulk dtype

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        temperatures = tensor_arg[: scores.size(0)].view(dtype=torch.float32)  # (rows,)
        self.recorder.keep(scores, temperatures.to(scores.device).unsqueeze(-1))
        return scores


def _request_history(state: Any) -> RequestHistory:
    prompt_len = state._true_initial_tokens or len(state.initial_tokens)
    return RequestHistory(
        request_id=state.request_id,
        key=state,
        prompt_len=prompt_len,
        prefix=state.initial_tokens,
        generated=state.generated_tokens,
        settings=state.logit_processor_kwargs,
    )


def request_processor(manager: ContinuousBatchingManager, kind: type[_P]) -> _P | None:
    """The engine's trl_cb request processor of class `kind` (`SeededRows`, `TopLogprobs`), if it has one."""
    for processor in manager.logit_processor.logits_processor:
        if isinstance(processor, PerRequestProcessor):
            return next((p for p in processor.processors if isinstance(p, kind)), None)
    return None


def install_request_processors(manager: ContinuousBatchingManager, processors: Sequence[HistoryProcessor]) -> None:
    """Run `processors` first on every step's logits (before the batch processor is built: call before warmup).

    They need each request's tokens up to the row being sampled on the host, so the engine must prepare a step only
    after the previous one finished: no async batching, no CUDA graphs or compilation (which would freeze the
    processors' per-step tensors). `ValueError` if the resolved engine config has any of them.
    """
    require_synchronous_engine(resolved_engine_settings(manager))
    processor_list = manager.logit_processor
    processor_list.logits_processor = LogitsProcessorList(
        [PerRequestProcessor(processors), *processor_list.logits_processor]
    )
    processor_list.tensors_required += 1
    processor_list.supported_keys.update(PerRequestProcessor.supported_kwargs)
    processor_list.do_processing = True


def resolved_engine_settings(manager: ContinuousBatchingManager) -> dict[str, Any]:
    """The resolved engine config's values of `ASYNCHRONOUS_ENGINE_SETTINGS` (set by the manager's constructor)."""
    cfg = manager.continuous_batching_config
    return {
        "use_cuda_graph": any(cfg.cuda_graph_booleans),
        "use_async_batching": cfg.use_async_batching,
        "varlen_compile_config": cfg.varlen_compile_config,
        "decode_compile_config": cfg.decode_compile_config,
    }


def reshapes_distribution(model: PreTrainedModel, generation_config: GenerationConfig) -> bool:
    """Whether `generate()` would apply any logits processor besides temperature for `generation_config` (the
    engine's own copy, trl_cb's per-request fields excluded): then the sampled distribution is not the one TRL's
    trainer models, and the trainer-comparable logprob must be recorded separately."""
    from transformers.generation.logits_process import TemperatureLogitsWarper

    return any(not isinstance(p, TemperatureLogitsWarper) for p in model._get_logits_processor(generation_config))


def race_sampler_fits(manager: ContinuousBatchingManager) -> bool:
    """Whether the engine samples with `race_sample` (exact in distribution, a few vectorised passes instead of
    `torch.multinomial`'s serial per-element draws): a sampling engine that is not compiled (greedy keeps the
    engine's argmax; a compiled one keeps the sampler it traced). Composed by `_upstream_patches`."""
    runner = manager.batch_processor.model_runner
    settings = resolved_engine_settings(manager)
    compiled = any(settings[k] for k in ("use_cuda_graph", "varlen_compile_config", "decode_compile_config"))
    return runner.do_sample and not compiled


def race_sample(
    return_logprobs: bool, seeded: SeededRows | None = None, alternatives: TopLogprobs | None = None
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A `ModelRunner._sample(scores, output_ids)` replacement that samples with `sampler.sample_with_logprobs` and
    writes what the engine's own does, where it does. Internal (pinned by tests/unit/test_contracts.py, which runs both
    samplers on one distribution): scores `(1, rows, vocab)`; the tokens go to `output_ids[0, :rows]` and, with
    `return_logprobs`, their fp32 logprobs bit-cast to int32 to `output_ids[1, :rows]`. `seeded`: the step's seeded
    rows draw from their own generators; `alternatives` records the asking rows' most likely tokens."""

    def sample(scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        own = seeded.generators if seeded is not None else None
        tokens, logprobs = sampler.sample_with_logprobs(scores[0], rows=own)  # (rows,), (rows,)
        if alternatives is not None:
            alternatives.record(scores[0])
        rows = tokens.size(0)
        output_ids[0, :rows].copy_(tokens)
        if return_logprobs:
            output_ids[1, :rows].copy_(logprobs.view(dtype=torch.int32))  # the engine's bulk dtype

    return sample


def recording_sample(
    sample: Callable[[torch.Tensor, torch.Tensor], None], recorder: PolicyLogprobRecorder
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`sample`, then `recorder.record` of the step's sampled tokens (`output_ids[0, :rows]`)."""

    def sample_and_record(scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        sample(scores, output_ids)
        recorder.record(output_ids)

    return sample_and_record


def with_policy_logprobs(
    prepare: Callable[[], tuple[Any, Any, Any]], recorder: PolicyLogprobRecorder
) -> Callable[[], tuple[Any, Any, Any]]:
    """`prepare_batch_update()` whose logprobs are `(processed, policy)` pairs: each token's recorded value beside the
    engine's own. The request state stores the pairs in its `logprobs` list, so they follow the tokens through forks
    and re-queues; `output_logprobs` splits them. Internal (pinned by tests/unit/test_contracts.py):
    `prepare_batch_update()` returns `(requests, tokens, logprobs)` for the rows `_sample` wrote, in the same order."""

    def batch_update_with_policy_logprobs() -> tuple[Any, Any, Any]:
        requests, tokens, logprobs = prepare()
        if logprobs is not None and tokens:
            policy = recorder.read(len(tokens))
            if policy is not None:
                logprobs = list(zip(logprobs, policy, strict=True))
        return requests, tokens, logprobs

    return batch_update_with_policy_logprobs


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
