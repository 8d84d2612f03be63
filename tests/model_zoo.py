"""Tiny random instances of the architecture families users bring, with their special features switched on.

Built from transformers' own config classes (no hub): 4 layers, hidden 64, 4 query / 2 KV heads of 16, a vocabulary
the size of the tiny tokenizer, sliding windows of 8 tokens (every prompt and completion crosses them), weights
drawn with std 0.2 (`initializer_range`) in fp32 so next-token distributions are far from uniform — with the usual
0.02 a tiny model is nearly uniform and a logprob test on it proves little.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

WINDOW = 8
INIT_STD = 0.2

#: The tiny shape every architecture shares (4 layers so that sliding/full layer mixes exist).
SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=INIT_STD,
    tie_word_embeddings=False,
)
_MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_MLA: dict[str, Any] = dict(
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    **_MOE,
)


@dataclass(frozen=True)
class Arch:
    """One family: its `model_type`, the config fields that switch its special features on, and what they are."""

    model_type: str
    features: str
    overrides: dict[str, Any] = field(default_factory=dict)
    windowed: bool = False  # some layers attend through a sliding window of WINDOW tokens
    attn_impl: str = "sdpa"

    @property
    def id(self) -> str:
        return self.model_type


#: Families the engine serves exactly (tests/unit/checks/test_compat_matrix.py).
SUPPORTED: list[Arch] = [
    Arch("llama", "tied embeddings", dict(tie_word_embeddings=True)),
    Arch(
        "qwen2",
        "sliding window on layers 2-3",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
        windowed=True,
    ),
    Arch("qwen3", "q/k-norm, tied embeddings", dict(tie_word_embeddings=True)),
    Arch("qwen3_moe", "MoE (4 experts, top-2), q/k-norm", dict(num_experts=4, decoder_sparse_step=1, **_MOE)),
    Arch("mistral", "sliding window on every layer", dict(sliding_window=WINDOW), windowed=True),
    Arch(
        "mixtral",
        "MoE + sliding window",
        dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
        windowed=True,
    ),
    Arch("gemma", "Gemma-1: scaled embeddings, tied", dict(tie_word_embeddings=True)),
    Arch(
        "gemma2",
        "attention + final logit soft-cap, alternating windows",
        dict(
            sliding_window=WINDOW, attn_logit_softcapping=2.0, final_logit_softcapping=10.0, query_pre_attn_scalar=16
        ),
        windowed=True,
        attn_impl="eager",
    ),
    Arch(
        "gemma3_text",
        "alternating windows (local RoPE base), q/k-norm",
        dict(sliding_window=WINDOW, sliding_window_pattern=2, layer_types=None),
        windowed=True,
    ),
    Arch(
        "phi3",
        "fused qkv, partial rotary, sliding window",
        dict(sliding_window=WINDOW, partial_rotary_factor=0.5),
        windowed=True,
    ),
    Arch("smollm3", "NoPE every 2nd layer, tied", dict(no_rope_layer_interval=2, tie_word_embeddings=True)),
    Arch("olmo2", "q/k-norm, post-norm blocks"),
    Arch("olmo3", "alternating windows, q/k-norm", dict(sliding_window=WINDOW), windowed=True),
    Arch(
        "granite",
        "embedding / residual / attention / logit multipliers",
        dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.5, logits_scaling=2.0),
    ),
    Arch(
        "gpt_oss",
        "attention sinks, MoE, alternating windows",
        dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
        windowed=True,
        attn_impl="eager",
    ),
    Arch("phi", "Phi-2: parallel blocks, partial rotary, biases", dict(partial_rotary_factor=0.5)),
    Arch("starcoder2", "sliding window, biases", dict(sliding_window=WINDOW), windowed=True),
    Arch(
        "exaone4",
        "alternating windows, q/k-norm",
        dict(sliding_window=WINDOW, sliding_window_pattern=2),
        windowed=True,
    ),
    Arch(
        "gemma3n_text",
        "KV sharing across layers, AltUp, per-layer inputs, windows",
        dict(
            num_kv_shared_layers=2,
            sliding_window=WINDOW,
            vocab_size_per_layer_input=64,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
        ),
        windowed=True,
    ),
]

#: Families the engine cannot serve, with a fragment of the reason `trl_cb.compat` must give.
REFUSED: list[tuple[Arch, str]] = [
    (Arch("deepseek_v3", "multi-head latent attention (MLA)", _MLA), "multi-head latent attention"),
    (Arch("deepseek_v2", "multi-head latent attention (MLA)", _MLA), "multi-head latent attention"),
    (
        Arch(
            "gemma4_text", "per-layer head sizes", dict(vocab_size_per_layer_input=64, hidden_size_per_layer_input=8)
        ),
        "per-layer head sizes",
    ),
    (Arch("qwen3_next", "linear attention hybrid", dict(num_experts=4, **_MOE)), "linear_attention"),
    (Arch("qwen3_5_text", "linear attention hybrid"), "linear_attention"),
    (
        Arch("granitemoehybrid", "mamba hybrid", dict(layer_types=["mamba", "attention", "mamba", "attention"])),
        "linear_attention",
    ),
    (Arch("falcon_h1", "parallel attention + mamba"), "hybrid"),
    (
        Arch("lfm2", "convolution hybrid", dict(layer_types=["conv", "full_attention", "conv", "full_attention"])),
        "conv",
    ),
    (Arch("nemotron_h", "mamba hybrid"), "linear_attention"),
    (Arch("llama4_text", "chunked attention"), "chunked"),
    (Arch("gemma3_text", "bidirectional attention", dict(use_bidirectional_attention=True)), "bidirectional"),
    (Arch("bloom", "ALiBi, attention outside the interface", attn_impl="eager"), "attention interface"),
    (
        Arch("mimo_v2_flash", "value heads narrower than key heads", dict(v_head_dim=8), attn_impl="eager"),
        "v_head_dim",
    ),
]


def tiny_config(arch: Arch, vocab_size: int, special_ids: dict[str, int] | None = None) -> PretrainedConfig:
    """The family's config with the tiny geometry, its feature overrides and the tokenizer's vocabulary."""
    defaults = AutoConfig.for_model(arch.model_type)
    kwargs = {k: v for k, v in SHAPE.items() if k in defaults.to_dict()}
    kwargs.update(arch.overrides)
    kwargs.update(vocab_size=vocab_size, **(special_ids or {}))
    config = AutoConfig.for_model(arch.model_type, **kwargs)
    return config


def tiny_arch_model(
    arch: Arch, vocab_size: int, special_ids: dict[str, int] | None = None, seed: int = 0
) -> PreTrainedModel:
    """A random fp32 instance of `arch` (std `INIT_STD`), eval mode, with the family's attention implementation."""
    config = tiny_config(arch, vocab_size, special_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=arch.attn_impl)
    for key, value in (special_ids or {}).items():
        setattr(model.generation_config, key, value)
    return model.float().eval()
