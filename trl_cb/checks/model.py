"""Which models transformers' CB engine serves exactly, decided when the generator or trainer is built.

Allow by evidence: `check_model` runs one forward of a few tokens with a recording attention function (the probe)
and compares what every layer hands to attention with what the engine will do (one call per layer, key/value widths
and head counts of its cache slots, causal, the same window, no argument its attention drops); `check_config` gives
the same verdict from the config alone for the known cases (MLA, per-layer head sizes, non-attention layers). Every
deviation is refused with one `UnsupportedModelError` naming the model type, the reasons and the way out (details:
docs/models.md).

Invariant: a model `check_model` accepts runs through the same attention computation in the engine as in its own
forward (up to the kernel); tests/unit/checks/test_compat_matrix.py proves it per family. Accepted (model, attention)
pairs are remembered for the model's life, so the trainer's check and its generator's probe once.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from ..engine import _upstream, sharding
from ..engine import _upstream_geometry as _geometry
from ..engine import _upstream_recurrent as _recurrent
from ..engine import varlen_attention as attention

logger = logging.getLogger(__name__)

__all__ = [
    "SINK_ATTENTION_IMPLEMENTATIONS",
    "SOFTCAP_ATTENTION_IMPLEMENTATIONS",
    "UnsupportedModelError",
    "VERIFIED_HYBRIDS",
    "check_config",
    "check_model",
    "config_problems",
    "engine_attention_implementation",
    "probe_problems",
]

WAY_OUT = (
    "Set use_transformers_continuous_batching=False (TRL's generate() path; or use vLLM) to train this model; "
    "`trl-cb check-model MODEL` checks a model before a run."
)

#: Engine attention implementations whose attention function applies the `softcap` argument. transformers'
#: `paged|eager` ignores it and `sdpa` cannot apply it (docs/models.md); flash kernels take it.
SOFTCAP_ATTENTION_IMPLEMENTATIONS: set[str] = {
    "flash_attention_2", "flash_attention_3", "flash_attention_4", attention.ATTENTION_NAME,
}  # fmt: skip
#: Engine attention implementations that honour a learned attention sink (`module.sinks` / `s_aux`).
SINK_ATTENTION_IMPLEMENTATIONS: set[str] = {
    "paged|eager", "flash_attention_2", "flash_attention_3", attention.ATTENTION_NAME,
}  # fmt: skip

#: What a few well-known unsupported layer types are, for the error message (any other type is named as is; the
#: served ones, `_recurrent.SERVED_LAYER_TYPES` and the engine's attention types, never reach it).
_LAYER_TYPE_NAMES = {
    "chunked_attention": "chunked attention",
    "indexed_attention": "sparse (indexed) attention",
}
#: Hybrid families (text `model_type`) whose recurrent layers the engine serves: each measured exact against
#: transformers' own cached computation of the same tokens (tests/unit/engine/test_hybrid_engine.py). A family is
#: added when measured, not by its layer types alone: two families with the same layer types decode inexactly.
VERIFIED_HYBRIDS = frozenset({
    "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "lfm3", "granitemoehybrid", "falcon_h1", "jamba",
    "olmo_hybrid",
})  # fmt: skip
#: Hybrid families whose own cached decoding differs from their full forward (the engine reproduces the former, the
#: trainer computes the latter): measured on tiny random instances, transformers 5.24, their own generate() included.
_INEXACT_DECODE = {
    "nemotron_h": "its single-token Mamba-2 step differs from its full forward by ~3e-3 nats",
    "bamba": "its single-token Mamba-2 step differs from its full forward by up to 4.4 nats",
}
#: Config fields giving a key or value head size that may differ from `head_dim` (the only size the engine uses).
_HEAD_SIZE_FIELDS = ("qk_head_dim", "v_head_dim", "global_head_dim", "swa_head_dim")

_PROBE_NAME = "trl_cb_compat_probe"
_probe_lock = threading.Lock()
_probe_state = threading.local()
#: Modules (and their attention implementation) the probe has already accepted: the trainer and its generator
#: check the same module once.
_accepted: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


class UnsupportedModelError(ValueError):
    """The CB engine cannot sample exactly from this model. `reasons` lists every deviation found."""

    def __init__(self, model_type: str, reasons: list[str]) -> None:
        self.model_type = model_type
        self.reasons = list(reasons)
        listed = "".join(f"\n  - {r}" for r in self.reasons)
        super().__init__(
            f"transformers' continuous batching engine cannot serve model_type={model_type!r} exactly:{listed}\n"
            f"{WAY_OUT}"
        )


# ------------------------------------------------------------------------------------------------ config checks


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder config the engine reads (`get_text_config()`; the config itself if that is ambiguous)."""
    try:
        return config.get_text_config()
    except ValueError:
        return config


def config_problems(config: PretrainedConfig) -> list[str]:
    """Every reason, visible in the config alone, why the engine cannot serve the model (empty: none found)."""
    cfg = text_config(config)
    problems: list[str] = []
    layer_types = _get(cfg, "layer_types", None) or []
    unsupported = sorted(set(layer_types) - _upstream.engine_attention_layer_types() - _recurrent.SERVED_LAYER_TYPES)
    if unsupported:
        kinds = ", ".join(
            f"{t!r} ({_LAYER_TYPE_NAMES[t]})" if t in _LAYER_TYPE_NAMES else repr(t) for t in unsupported
        )
        problems.append(
            f"layer types {kinds}: the engine caches only {sorted(_upstream.engine_attention_layer_types())} layers"
        )
    if _recurrent.recurrent_layers(cfg) and _model_type(cfg) not in VERIFIED_HYBRIDS:
        problems.append(_unverified_hybrid(cfg))
    try:
        _upstream.engine_cache_geometry(cfg)
    except (RuntimeError, ValueError, AttributeError) as err:
        if _geometry.expands_cached_keys(cfg):
            problems.append(
                f"multi-head latent attention (kv_lora_rank={cfg.kv_lora_rank}) of a family not measured exact "
                f"through the engine (measured: {', '.join(sorted(_geometry.LATENT_FAMILIES))})"
            )
        else:
            problems.append(f"cache geometry: {type(err).__name__}: {_first_sentence(err)}")
    shape = _geometry.upstream_shape(cfg)
    if shape is not None and not _geometry.expands_cached_keys(cfg):
        for name in _HEAD_SIZE_FIELDS:
            value = _get(cfg, name, None)
            if isinstance(value, int) and value != shape.key_width:
                problems.append(
                    f"{name}={value} differs from head_dim={shape.key_width}, the head size the engine caches"
                )
    if _get(cfg, "use_bidirectional_attention", False):
        problems.append("bidirectional attention (use_bidirectional_attention=True): the engine attends causally")
    if _get(cfg, "attention_chunk_size", None) is not None and "chunked_attention" not in layer_types:
        problems.append(f"chunked attention (attention_chunk_size={cfg.attention_chunk_size})")
    return problems


def _unverified_hybrid(cfg: PretrainedConfig) -> str:
    """Why a hybrid family outside `VERIFIED_HYBRIDS` is refused."""
    kinds = sorted({t for t in _get(cfg, "layer_types", None) or [] if t in _recurrent.SERVED_LAYER_TYPES})
    known = _INEXACT_DECODE.get(_model_type(cfg))
    if known is not None:
        return (
            f"layer types {kinds}: {known} (transformers' cached decoding, which the engine reproduces, against the "
            "forward the trainer scores with)"
        )
    return (
        f"layer types {kinds} (recurrent state) of a family not yet measured exact in the engine (served: "
        f"{', '.join(sorted(VERIFIED_HYBRIDS))}; docs/models.md)"
    )


def check_config(config: PretrainedConfig) -> None:
    """Raise `UnsupportedModelError` if the config alone shows the engine cannot serve the model."""
    problems = config_problems(config)
    if problems:
        raise UnsupportedModelError(_model_type(config), problems)


# ------------------------------------------------------------------------------------------------ model checks


def engine_attention_implementation(model: PreTrainedModel) -> str:
    """The attention implementation the engine will run `model` with: transformers' switch (eager -> paged|eager),
    then trl_cb's own engine attention in place of a dense-mask one (`attention.replaces`, the rule the engine
    applies in `_upstream._choose_attention`)."""
    impl = _upstream.attention_implementation(model)
    impl = "paged|eager" if impl == "eager" else impl
    return attention.ATTENTION_NAME if attention.replaces(impl) else impl


def check_model(model: PreTrainedModel) -> bool:
    """Raise `UnsupportedModelError` unless the engine can serve `model` exactly; return whether it was probed.

    The config is checked always; the attention probe runs when the parameters are materialised on this process
    (not under ZeRO-3 / FSDP sharding or on the meta device). `False` means the caller should call again where the
    parameters are whole (the generator does, at its first round, before submitting anything).
    """
    problems = config_problems(model.config)
    impl = engine_attention_implementation(model)
    chosen = _upstream.attention_implementation(model)  # what transformers' CB accepts, before trl_cb's replacement
    if not (chosen in ("eager", "paged|eager", "sdpa", attention.ATTENTION_NAME) or "flash" in chosen):
        problems.append(
            f"attention implementation {chosen!r}: the engine runs only 'eager', 'sdpa' "
            "or flash attention (load the model with attn_implementation='sdpa')"
        )
    if problems:
        raise UnsupportedModelError(_model_type(model.config), problems)
    if _accepted.get(model) == impl:
        return True
    if not sharding.materialised(model):
        logger.info("Parameters are sharded or on the meta device: the attention probe runs at the first round.")
        return False
    problems = probe_problems(model)
    if problems:
        raise UnsupportedModelError(_model_type(model.config), problems)
    _accepted[model] = impl
    return True


@dataclass
class _AttentionCall:
    """What one attention module handed to the attention function during the probe forward."""

    module: str
    layer_idx: int | None
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    is_causal: bool
    has_sinks: bool
    kwargs: dict[str, Any] = field(default_factory=dict)


def probe_problems(model: PreTrainedModel, num_tokens: int = 6) -> list[str]:
    """Run the attention probe on `model` and return every deviation from what the engine does (empty: none).

    One no-grad forward of `num_tokens` tokens with a recording attention function; mode, attention implementation
    and RNG are restored afterwards.
    """
    cfg = text_config(model.config)
    impl = engine_attention_implementation(model)
    try:
        calls = _record_attention_calls(model, num_tokens)
    except Exception as err:  # noqa: BLE001 - whatever the model's forward raises is the verdict, reported with it
        return [f"a forward with the attention probe failed ({type(err).__name__}: {_first_sentence(err)})"]
    shapes = _upstream.engine_cache_geometry(cfg)
    latent = _geometry.expands_cached_keys(cfg)  # the layer expands what it cached: its attention sees more
    groups = _upstream.engine_layer_groups(cfg)
    sliding_layers = set(groups.get("sliding_attention", []))
    engine_window = _get(cfg, "sliding_window", None)
    problems: list[str] = []
    num_layers = cfg.num_hidden_layers
    by_layer: dict[int, list[_AttentionCall]] = {}
    for call in calls:
        if call.layer_idx is None:
            problems.append(f"{call.module} calls attention without a layer_idx; the engine caches by layer index")
            continue
        by_layer.setdefault(call.layer_idx, []).append(call)
    attention_free = set(_recurrent.attention_free_layers(cfg))  # recurrent / MLP-only: no keys to cache
    missing = [i for i in range(num_layers) if i not in by_layer and i not in attention_free]
    if not calls:
        problems.append(
            "no layer calls transformers' attention interface (the model computes attention itself, as BLOOM, "
            "MPT, GPT-J, CodeGen, Falcon do); the engine's paged cache would never be read"
        )
    elif missing:
        problems.append(
            f"layers {_ranges(missing)} of {num_layers} never call attention (linear-attention / state-space / "
            "convolution layers not typed as such in `layer_types`): the engine has no cache for their state"
        )
    attending = sorted(attention_free & set(by_layer))
    if attending:
        problems.append(
            f"layers {_ranges(attending)} call attention although `layer_types` says they do not: the engine "
            "allocates no keys for them"
        )
    problems.extend(_recurrent.serving_problems(model, cfg))
    for layer, layer_calls in sorted(by_layer.items()):
        if len(layer_calls) > 1:
            problems.append(f"layer {layer} calls attention {len(layer_calls)} times; the engine caches one per layer")
    deviations: dict[str, list[int]] = {}
    for layer, layer_calls in sorted(by_layer.items()):
        call = layer_calls[0]
        slot = None if latent else shapes[layer]
        for reason in _call_problems(call, slot, impl, layer in sliding_layers, engine_window):
            deviations.setdefault(reason, []).append(layer)
    problems.extend(f"{reason} (layers {_ranges(layers)})" for reason, layers in deviations.items())
    return problems


def _call_problems(
    call: _AttentionCall,
    slot: _geometry.SlotShape | None,
    impl: str,
    engine_sliding: bool,
    engine_window: int | None,
) -> list[str]:
    """How one layer's attention call deviates from what the engine does; `slot`: the layer's cache slot (None for
    a latent layer, whose attention sees the keys it expands from what it cached)."""
    problems = []
    key_heads, key_dim = call.key_shape[1], call.key_shape[-1]
    value_heads, value_dim = call.value_shape[1], call.value_shape[-1]
    cached = (slot.kv_heads, slot.key_width, slot.kv_heads, slot.value_width) if slot is not None else None
    if cached is not None and (key_heads, key_dim, value_heads, value_dim) != cached:
        problems.append(
            f"keys are {key_heads} heads x {key_dim} and values {value_heads} heads x {value_dim}, but the engine's "
            f"cache slots are {slot.kv_heads} heads x {slot.key_width} (keys) / {slot.value_width} (values)"
        )
    if not call.is_causal:
        problems.append("bidirectional attention (is_causal=False): the engine attends causally")
    model_window = call.kwargs.get("sliding_window")
    want = engine_window if engine_sliding else None
    if model_window != want:
        problems.append(
            f"the model attends with sliding_window={model_window} but the engine would use {want} (from "
            "`layer_types` / `sliding_window`)"
        )
    if call.kwargs.get("softcap") is not None and impl not in SOFTCAP_ATTENTION_IMPLEMENTATIONS:
        problems.append(
            f"attention logit soft-capping (softcap={call.kwargs['softcap']}) is dropped by the engine's {impl!r} "
            "attention"
        )
    if (call.has_sinks or call.kwargs.get("s_aux") is not None) and impl not in SINK_ATTENTION_IMPLEMENTATIONS:
        problems.append(f"learned attention sinks are ignored by the engine's {impl!r} attention (use 'eager')")
    return problems


def _record_attention_calls(model: PreTrainedModel, num_tokens: int) -> list[_AttentionCall]:
    cfg = text_config(model.config)
    vocab = int(_get(cfg, "vocab_size", 0) or 2)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    input_ids = (torch.arange(num_tokens, device=device) % vocab)[None]  # (1, T)
    original = _upstream.attention_implementation(model)
    was_training = model.training
    with _probe_lock:
        _register_probe()
        _probe_state.calls = []
        try:
            model.set_attn_implementation(_PROBE_NAME)
            model.eval()
            # The probe calls SDPA like the engine: never with cuDNN attention on CUDA (`engine_sdpa_backends`).
            rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
            with torch.no_grad(), rng, attention.engine_sdpa_backends(device):
                model(input_ids=input_ids, use_cache=False)
            return list(_probe_state.calls)
        finally:
            model.set_attn_implementation(original)
            model.train(was_training)
            _probe_state.calls = []


@functools.cache
def _register_probe() -> None:
    """Register the probe with transformers' attention interface, once per process: that registry is global and
    keyed by name, and this adds a trl_cb-only key (never replacing one) that only `_record_attention_calls` selects,
    for the one forward it runs."""
    AttentionInterface.register(_PROBE_NAME, _probe_attention)


def _probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, T, Dq)
    key: torch.Tensor,  # (B, KV, T, Dk)
    value: torch.Tensor,  # (B, KV, T, Dv)
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Record the call, then return a causal attention of the right shape so the forward can go on."""
    _probe_state.calls.append(
        _AttentionCall(
            module=type(module).__name__,
            layer_idx=getattr(module, "layer_idx", None),
            key_shape=tuple(key.shape),
            value_shape=tuple(value.shape),
            is_causal=bool(getattr(module, "is_causal", True)),
            has_sinks=getattr(module, "sinks", None) is not None,
            kwargs={k: v for k, v in kwargs.items() if k == "s_aux" or (v is not None and not torch.is_tensor(v))},
        )
    )
    groups = query.shape[1] // max(key.shape[1], 1)
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), is_causal=query.shape[2] > 1
    )  # (B, H, T, Dv)
    return out.transpose(1, 2).contiguous(), None


def _get(config: PretrainedConfig, name: str, default: Any = None) -> Any:
    """`getattr` that also survives per-layer attributes (Gemma-4 raises transformers'
    `AmbiguousGlobalPerLayerAttributeError`, a `RuntimeError`, on global access to them)."""
    try:
        return getattr(config, name, default)
    except RuntimeError:
        return default


def _first_sentence(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text.split(". ")[0]


def _model_type(config: PretrainedConfig) -> str:
    return str(getattr(config, "model_type", None) or type(config).__name__)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
