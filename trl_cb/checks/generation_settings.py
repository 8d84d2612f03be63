"""Which `GenerationConfig` fields trl_cb's CB path honours, and the check that refuses the rest up front.

transformers' CB engine drops some logits processors, crashes on some fields and ignores others; each would sample
from another distribution than the one asked for, with logprobs of the wrong policy. So every field is classified in
`FIELD_RULES` (`Handling`): `EXACT` (the engine applies it as `generate()` does;
`_upstream_sampling.check_processors_kept` re-checks at every build), `TRL_CB` (trl_cb applies it per request:
`engine/request_processors.py`), `IRRELEVANT`, or `REFUSED` (set to a non-neutral value: `ValueError` naming the
field and why). A field not in the table (a new
transformers field, a custom attribute) is refused when set: a new field is never dropped silently.

Invariant of `engine_generation_config`: the copy has integer lengths and token ids, in-range sampling parameters, no
refused or unknown field set, `num_return_sequences == 1` and an explicit `top_k` when sampling. The engine is built
from `without_trl_cb_fields(copy)`; the `TRL_CB` fields reach the sampler as `RequestProcessorSettings`.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, PreTrainedModel

from ..engine.request_processors import UNSEEDED, RequestProcessorSettings
from .served_sampling import MAX_LOGIT_BIAS, SERVED_SAMPLING, logit_bias_pairs

__all__ = [
    "FIELD_RULES",
    "FieldRule",
    "Handling",
    "RequestProcessorSettings",
    "check_generation_config",
    "engine_generation_config",
    "eos_token_ids",
    "MAX_TOP_LOGPROBS",
    "MIN_SAMPLING_TEMPERATURE",
    "OPENAI_FIELDS",
    "SERVED_FIELDS",
    "logit_bias_pairs",
    "request_processor_settings",
    "resolve_eos",
    "sampling_signature",
    "settings_servers_cannot_apply",
    "without_trl_cb_fields",
]

logger = logging.getLogger(__name__)


class Handling(enum.Enum):
    EXACT = "exact"
    TRL_CB = "honoured by trl_cb"
    IRRELEVANT = "irrelevant to sampling"
    REFUSED = "refused"


def _unset(value: Any) -> bool:
    return value is None


def _unset_or(neutral: Any) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return value is None or value == neutral

    return check


@dataclass(frozen=True)
class FieldRule:
    handling: Handling
    reason: str
    #: Values that mean "off"; a REFUSED field holding one is accepted (e.g. `num_beams=1`).
    neutral: Callable[[Any], bool] = _unset


_E, _T, _I, _R = Handling.EXACT, Handling.TRL_CB, Handling.IRRELEVANT, Handling.REFUSED
_SPECULATIVE = "speculative / assisted decoding is not part of the CB engine"
_REMOVED = "a decoding strategy transformers moved out of `generate()` (Hub custom generate); not a CB sampler"
_HISTORY = "needs n-gram matching on each request's history, which neither CB nor trl_cb implements"
_LENGTH = (
    "its processor reads the sequence length from the input ids, which the engine passes as one token per row: "
    "it would be applied at the wrong steps"
)

#: Every `GenerationConfig` field (transformers 5.23), classified, and OpenAI's `OPENAI_FIELDS`. Anything else that is
#: set is refused.
FIELD_RULES: dict[str, FieldRule] = {
    # Length and stopping
    "max_new_tokens": FieldRule(_E, "required: a positive integer, the per-request token budget"),
    "max_length": FieldRule(_I, "`max_new_tokens` is required and takes precedence, as in `generate()`"),
    "min_new_tokens": FieldRule(_T, "EOS suppressed until the request has generated this many tokens"),
    "min_length": FieldRule(_T, "EOS suppressed until prompt + completion reach this length (per request)"),
    "eos_token_id": FieldRule(_E, "ends a completion (kept in it); unset falls back to the model's EOS"),
    "stop_strings": FieldRule(_R, "CB has no stop-string criterion: completions would run past the string"),
    "max_time": FieldRule(_R, "CB has no time criterion: completions would not be cut"),
    "early_stopping": FieldRule(_I, "beam search only (`num_beams > 1` is refused)"),
    "forced_bos_token_id": FieldRule(_R, _LENGTH),
    "forced_eos_token_id": FieldRule(_R, _LENGTH),
    "exponential_decay_length_penalty": FieldRule(_R, _LENGTH),
    # Strategy
    "do_sample": FieldRule(_E, "multinomial sampling; unset or False is greedy"),
    "num_beams": FieldRule(_R, "beam search has no per-token sampling policy to record", _unset_or(1)),
    "num_beam_groups": FieldRule(_R, _REMOVED, _unset_or(1)),
    "diversity_penalty": FieldRule(_R, _REMOVED, _unset_or(0.0)),
    "length_penalty": FieldRule(_I, "beam search only (`num_beams > 1` is refused)"),
    "penalty_alpha": FieldRule(_R, _REMOVED),
    "dola_layers": FieldRule(_R, _REMOVED),
    "low_memory": FieldRule(_R, _REMOVED),
    "constraints": FieldRule(_R, _REMOVED),
    "force_words_ids": FieldRule(_R, _REMOVED),
    "num_return_sequences": FieldRule(_I, "samples per prompt are `generate(..., num_generations=G)`"),
    # Warpers (sampling only) and other processors
    "temperature": FieldRule(_E, "logits divided by it before the other warpers"),
    "top_k": FieldRule(_E, "keep the k most likely tokens; unset means no top-k (generate() would use 50)"),
    "top_p": FieldRule(_E, "nucleus filtering, renormalised"),
    "min_p": FieldRule(_E, "drop tokens below min_p x the top probability (after temperature)"),
    "top_h": FieldRule(_E, "entropy-bounded truncation"),
    "typical_p": FieldRule(_E, "locally typical filtering"),
    "epsilon_cutoff": FieldRule(_E, "drop tokens below a probability floor"),
    "eta_cutoff": FieldRule(_E, "entropy-dependent probability floor"),
    "renormalize_logits": FieldRule(_E, "log-softmax of the processed logits (distribution unchanged)"),
    "remove_invalid_values": FieldRule(_E, "nan/inf logits replaced (finite logits unchanged)"),
    "repetition_penalty": FieldRule(_T, "every prompt and completion token of the request penalised", _unset_or(1.0)),
    # OpenAI's (and vLLM's) sampling fields, not `GenerationConfig`'s own: set as extra attributes (TRL's
    # `generation_kwargs`, or a rollout server's request), applied per request by trl_cb (engine/request_processors.py)
    "presence_penalty": FieldRule(_T, "subtracted from every token the completion has used (OpenAI's)", _unset_or(0)),
    "frequency_penalty": FieldRule(_T, "subtracted per use of each token in the completion (OpenAI's)", _unset_or(0)),
    "logit_bias": FieldRule(_T, "added to the listed token ids' logits (OpenAI's {id: bias})", _unset_or({})),
    "seed": FieldRule(
        _T, "each request samples from its own generator: same prompt and seed, same samples", _unset_or(-1)
    ),
    "top_logprobs": FieldRule(_T, "the k likeliest tokens of each sampled distribution (servers)", _unset_or(0)),
    "encoder_repetition_penalty": FieldRule(_R, "encoder-decoder only", _unset_or(1.0)),
    "no_repeat_ngram_size": FieldRule(_R, _HISTORY, _unset_or(0)),
    "encoder_no_repeat_ngram_size": FieldRule(_R, "encoder-decoder only", _unset_or(0)),
    "bad_words_ids": FieldRule(_R, _HISTORY),
    "sequence_bias": FieldRule(_R, _HISTORY),
    "suppress_tokens": FieldRule(_E, "the listed ids never sampled"),
    "begin_suppress_tokens": FieldRule(_R, _LENGTH),
    "guidance_scale": FieldRule(_R, "classifier-free guidance needs a second forward CB does not run", _unset_or(1)),
    "watermarking_config": FieldRule(_R, "watermarking processors are not per-request in CB"),
    "token_healing": FieldRule(_R, "rewrites the prompt tail; CB does not", _unset_or(False)),
    # Speculative / assisted decoding
    "is_assistant": FieldRule(_R, _SPECULATIVE, _unset_or(False)),
    "num_assistant_tokens": FieldRule(_R, _SPECULATIVE),
    "num_assistant_tokens_schedule": FieldRule(_R, _SPECULATIVE),
    "assistant_confidence_threshold": FieldRule(_R, _SPECULATIVE),
    "prompt_lookup_num_tokens": FieldRule(_R, _SPECULATIVE),
    "max_matching_ngram_size": FieldRule(_R, _SPECULATIVE),
    "assistant_early_exit": FieldRule(_R, _SPECULATIVE),
    "assistant_lookbehind": FieldRule(_R, _SPECULATIVE),
    "target_lookbehind": FieldRule(_R, _SPECULATIVE),
    "assistant_ensemble_weight": FieldRule(_R, _SPECULATIVE),
    "speculation_type": FieldRule(_R, _SPECULATIVE),
    "use_mtp": FieldRule(_R, "multi-token prediction decoding is not part of the CB engine", _unset_or(False)),
    # Engine, cache, outputs, special tokens: no effect on the sampled distribution here
    "continuous_batching_config": FieldRule(_R, "pass it as the generator's `continuous_batching_config`"),
    "use_cache": FieldRule(_I, "the CB engine always uses its paged KV cache"),
    "cache_implementation": FieldRule(_I, "the CB engine always uses its paged KV cache"),
    "cache_config": FieldRule(_I, "the CB engine always uses its paged KV cache"),
    "max_cache_len": FieldRule(_I, "the CB cache is sized by trl_cb (docs/index.md, Sizing)"),
    "prefill_chunk_size": FieldRule(_I, "the CB engine chunks prefill by its own token budget"),
    "compile_config": FieldRule(_I, "`generate()`'s compilation; CB compilation is a CB-config setting"),
    "disable_compile": FieldRule(_I, "`generate()`'s compilation; CB compilation is a CB-config setting"),
    "output_attentions": FieldRule(_I, "output format of `generate()`"),
    "output_hidden_states": FieldRule(_I, "output format of `generate()`"),
    "output_scores": FieldRule(_I, "output format of `generate()` (trl_cb always returns sampling logprobs)"),
    "output_logits": FieldRule(_I, "output format of `generate()`"),
    "return_dict_in_generate": FieldRule(_I, "output format of `generate()`"),
    "pad_token_id": FieldRule(_I, "CB batches without padding"),
    "bos_token_id": FieldRule(_I, "prompts are given as token ids; nothing is prepended"),
    "decoder_start_token_id": FieldRule(_I, "encoder-decoder only; CB runs decoder-only models"),
    "transformers_version": FieldRule(_I, "metadata"),
    "_from_model_config": FieldRule(_I, "metadata"),
}

#: Most alternatives per sampled token (`top_logprobs`; vLLM's `max_logprobs` default).
MAX_TOP_LOGPROBS = 20

#: OpenAI's sampling fields that `GenerationConfig` does not define, honoured as extra attributes of one.
OPENAI_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias", "seed", "top_logprobs")

#: TRL_CB fields, zeroed in the engine's copy (trl_cb applies them; transformers would drop or misapply them).
_TRL_CB_FIELDS = tuple(name for name, rule in FIELD_RULES.items() if rule.handling is Handling.TRL_CB)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _range_problems(cfg: GenerationConfig) -> list[str]:
    """Type and range checks of the fields trl_cb honours (refusing what would crash or be silently truncated)."""
    problems = []
    max_new_tokens = cfg.max_new_tokens
    if not _is_int(max_new_tokens) or max_new_tokens <= 0:
        problems.append(
            f"max_new_tokens must be a positive integer, got {max_new_tokens!r}. Without it the engine generates "
            "until its cache is full and then fails every request."
        )
    seed = getattr(cfg, "seed", None)
    if seed is not None and (not _is_int(seed) or not -1 <= seed < 2**63):
        problems.append(f"seed must be an integer in [0, 2**63) (-1: unseeded), got {seed!r}.")
    top = getattr(cfg, "top_logprobs", None)
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        problems.append(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}.")
    for name in ("min_new_tokens", "min_length", "top_k"):
        value = getattr(cfg, name, None)
        if value is not None and (not _is_int(value) or value < 0):
            problems.append(f"{name} must be an integer >= 0, got {value!r}.")
    eos = cfg.eos_token_id
    eos_list = eos if isinstance(eos, list | tuple) else [eos]
    if eos is not None and not all(_is_int(t) for t in eos_list):
        problems.append(f"eos_token_id must be an integer or a list of integers, got {eos!r}.")
    bounds: dict[str, tuple[float, float, bool, bool]] = {  # name: (low, high, low inclusive, high inclusive)
        "temperature": (0.0, math.inf, False, False),
        "top_p": (0.0, 1.0, False, True),
        "min_p": (0.0, 1.0, True, True),
        "top_h": (0.0, 1.0, False, True),
        "typical_p": (0.0, 1.0, False, True),
        "epsilon_cutoff": (0.0, 1.0, True, False),
        "eta_cutoff": (0.0, 1.0, True, False),
        "repetition_penalty": (0.0, math.inf, False, False),
        "presence_penalty": (-2.0, 2.0, True, True),
        "frequency_penalty": (-2.0, 2.0, True, True),
    }
    for name, (low, high, low_in, high_in) in bounds.items():
        value = getattr(cfg, name, None)
        if value is None:
            continue
        above = low <= value if low_in else low < value
        if not (_is_real(value) and above and (value <= high if high_in else value < high)):
            interval = f"{'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"
            problems.append(f"{name} must be a finite number in {interval}, got {value!r}.")
    problems.extend(_logit_bias_problems(getattr(cfg, "logit_bias", None)))
    return problems


def _logit_bias_problems(bias: Any) -> list[str]:
    if bias is None:
        return []
    pairs = bias.items() if isinstance(bias, dict) else bias
    try:
        ok = all(_is_int(t) and t >= 0 and _is_real(b) and abs(b) <= MAX_LOGIT_BIAS for t, b in pairs)
    except (TypeError, ValueError):
        ok = False
    if ok:
        return []
    return [
        f"logit_bias must map token ids (integers >= 0) to finite biases in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]."
    ]


def check_generation_config(generation_config: GenerationConfig) -> None:
    """`ValueError` listing every field set that the CB path would drop, crash on, or truncate (see `FIELD_RULES`)."""
    problems = []
    for name, value in generation_config.to_dict().items():
        rule = FIELD_RULES.get(name)
        if rule is None:
            if value is not None:
                problems.append(
                    f"{name}={value!r}: not a GenerationConfig field trl_cb knows, so it cannot tell whether the "
                    "continuous batching engine honours it"
                )
        elif rule.handling is Handling.REFUSED and not rule.neutral(value):
            problems.append(f"{name}={value!r}: {rule.reason}")
    problems.extend(_range_problems(generation_config))
    if problems:
        raise ValueError(
            "Generation settings the continuous batching path cannot apply exactly (samples and their logprobs "
            "would not follow the requested distribution):\n- "
            + "\n- ".join(problems)
            + "\nUnset them, or generate without continuous batching. Field table: docs/index.md, 'Sampling settings'."
        )


#: Lowest temperature sampling is served at. The engine divides fp32 logits by it: far below this the quotient
#: overflows (1e-45 divides by a denormal: inf - inf = nan, "probability tensor contains inf/nan"), and at this one
#: a logit gap of 10 is already a probability ratio of e^1000, i.e. greedy for every practical purpose.
MIN_SAMPLING_TEMPERATURE = 1e-2

#: The `GenerationConfig` fields a rollout server applies from a request: the sampling ones (`SERVED_SAMPLING`, the
#: one table), the length; EOS and padding are the served model's.
SERVED_FIELDS = frozenset({setting.name for setting in SERVED_SAMPLING}) | frozenset(
    {"max_new_tokens", "do_sample", "eos_token_id", "pad_token_id", "bos_token_id"}
)

#: The value that means "off" for the sampling fields a rollout server does not carry (None means off for all).
_OFF_VALUES: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "min_length": 0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "top_h": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "suppress_tokens": [],
}


def settings_servers_cannot_apply(settings: dict[str, Any]) -> list[str]:
    """The names in `settings` (`GenerationConfig` field: value) a rollout server would drop: sampling fields its API
    does not carry, set to anything but off. The one rule for both sides: the trainer refuses such a config before it
    uses servers (`trainers/remote.py`), the server refuses such a request body (`serving/protocol.py`, 422)."""
    refused = []
    for name, value in settings.items():
        rule = FIELD_RULES.get(name)
        if rule is None or rule.handling is Handling.IRRELEVANT or name in SERVED_FIELDS:
            continue
        if value is None or rule.neutral(value) or (name in _OFF_VALUES and value == _OFF_VALUES[name]):
            continue
        refused.append(name)
    return sorted(refused)


def request_processor_settings(generation_config: GenerationConfig) -> RequestProcessorSettings:
    """The `TRL_CB` fields of a checked config, in `generate()`'s semantics (`min_new_tokens` overrides
    `min_length`; a penalty of 1 is off)."""
    penalty = generation_config.repetition_penalty
    min_new_tokens = int(generation_config.min_new_tokens or 0)
    bias = getattr(generation_config, "logit_bias", None) or {}
    return RequestProcessorSettings(
        repetition_penalty=None if penalty is None or penalty == 1.0 else float(penalty),
        min_new_tokens=min_new_tokens,
        min_length=0 if min_new_tokens else int(generation_config.min_length or 0),
        presence_penalty=float(getattr(generation_config, "presence_penalty", None) or 0.0),
        frequency_penalty=float(getattr(generation_config, "frequency_penalty", None) or 0.0),
        logit_bias=logit_bias_pairs(bias),
        seed=UNSEEDED if getattr(generation_config, "seed", None) is None else int(generation_config.seed),
        top_logprobs=int(getattr(generation_config, "top_logprobs", None) or 0),
    )


def engine_generation_config(generation_config: GenerationConfig) -> GenerationConfig:
    """A checked private copy of the sampling settings: `top_k` explicit when sampling, one sequence per request."""
    check_generation_config(generation_config)
    cfg = GenerationConfig.from_dict(generation_config.to_dict())
    if cfg.do_sample and cfg.top_k is None:
        # `model.generate` silently adds top_k=50 when unset; CB adds nothing. Make "no top-k" explicit.
        cfg.top_k = 0
    cfg.num_return_sequences = 1
    return cfg


def without_trl_cb_fields(cfg: GenerationConfig) -> GenerationConfig:
    """`cfg` with the `TRL_CB` fields unset: what the engine's own processors are built from."""
    stripped = GenerationConfig.from_dict(cfg.to_dict())
    for name in _TRL_CB_FIELDS:
        setattr(stripped, name, None)
    return stripped


def eos_token_ids(cfg: GenerationConfig) -> list[int]:
    """The EOS ids as a list (empty when there is none)."""
    eos = cfg.eos_token_id
    if eos is None:
        return []
    return [int(t) for t in (eos if isinstance(eos, list | tuple) else [eos]) if int(t) >= 0]


def sampling_signature(cfg: GenerationConfig) -> tuple[Any, ...]:
    """Every field that shapes the engine's sampling (all but IRRELEVANT ones and the per-request budget): a live
    manager silently ignores a new config, so a change of any of these must rebuild the engine."""
    names = sorted(
        name
        for name, rule in FIELD_RULES.items()
        if rule.handling is not Handling.IRRELEVANT and name != "max_new_tokens"
    )
    return tuple(_hashable(getattr(cfg, name, None)) for name in names)


def _hashable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def resolve_eos(generation_config: GenerationConfig, module: PreTrainedModel) -> None:
    """`eos_token_id=None` means the model's EOS, as in `generate()` (whose config falls back to the model's
    generation config; the engine alone would disable EOS). Ids outside the vocabulary are refused."""
    if generation_config.eos_token_id is None:
        model_eos = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
        if model_eos is None:
            model_eos = getattr(module.config.get_text_config(), "eos_token_id", None)
        if model_eos is not None:
            logger.info("eos_token_id is unset: using the model's EOS %s, as generate() does.", model_eos)
            generation_config.eos_token_id = model_eos
    vocab_size = module.config.get_text_config().vocab_size
    outside = [t for t in eos_token_ids(generation_config) if t >= vocab_size]
    if outside:
        raise ValueError(f"eos_token_id {outside} is outside the model's vocabulary [0, {vocab_size}).")
