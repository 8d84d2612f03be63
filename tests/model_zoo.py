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
    num_key_value_heads=4,  # as in every released MLA model: the expanded keys have all the query heads
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
    Arch(
        "gemma4_text",
        "per-layer head sizes (global 1 KV head x 32, sliding 2 x 16), keys as values, KV sharing (layers 2-3),"
        " per-layer inputs, windows",
        dict(
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=8,
        ),
        windowed=True,
    ),
    Arch("deepseek_v3", "multi-head latent attention (the latent cached: 16 + 8 wide), MoE", _MLA),
    Arch("deepseek_v2", "multi-head latent attention (the latent cached: 16 + 8 wide), MoE", _MLA),
]

#: Recurrent-layer sizes of the hybrid families, at the tiny shape (their defaults are full-size: a tiny Falcon-H1
#: with 128 Mamba heads of state 256 takes seconds per forward), with chunk sizes below the prompts so prefills scan
#: several chunks, and positions for the 1,500-token prompts of tests/unit/engine/test_hybrid_engine.py.
_LINEAR: dict[str, Any] = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    max_position_embeddings=2048,
)  # fmt: skip
_MAMBA: dict[str, Any] = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=32)

#: Hybrid families: attention layers beside recurrent ones (Gated DeltaNet, Mamba-2, short convolutions), served with
#: per-sequence state slots (trl_cb/engine/recurrent_state.py; tests/unit/engine/test_hybrid_engine.py).
HYBRID: list[Arch] = [
    Arch("qwen3_5_text", "Gated DeltaNet x3 + full attention (Qwen3.5 / 3.6 layout)", _LINEAR),
    Arch("qwen3_next", "Gated DeltaNet x3 + gated attention, MoE", dict(num_experts=4, **_MOE, **_LINEAR)),
    Arch(
        "lfm2",
        "short convolutions + attention",
        dict(layer_types=["conv", "full_attention", "conv", "full_attention"], max_position_embeddings=2048),
    ),
    Arch(
        "granitemoehybrid",
        "Mamba-2 + attention, MoE",
        dict(layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4, **_MAMBA),
    ),
    Arch("falcon_h1", "attention and Mamba-2 in parallel in every layer", dict(mamba_d_ssm=128, **_MAMBA)),
    Arch(
        "qwen3_5_moe_text",
        "Gated DeltaNet x3 + attention, MoE (Qwen3.6 layout)",
        dict(num_experts=4, shared_expert_intermediate_size=32, **_MOE, **_LINEAR),
    ),
    Arch(
        "jamba",
        "Mamba-1 + attention, MoE every 2nd layer",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_dt_rank=8,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            use_mamba_kernels=False,
        ),  # fmt: skip
    ),
    Arch("olmo_hybrid", "Gated DeltaNet + attention", _LINEAR),
    Arch("lfm3", "short convolutions + attention"),
]
#: NemotronH's tiny instance (refused: its decode step is not its forward's; tests/unit/engine/test_hybrid_engine.py).
_NEMOTRON_H: dict[str, Any] = dict(
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=32, n_routed_experts=4,
    moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
)  # fmt: skip

#: Families the engine cannot serve, with a fragment of the reason `trl_cb.compat` must give.
REFUSED: list[tuple[Arch, str]] = [
    (Arch("minicpm3", "multi-head latent attention, not measured", _MLA), "multi-head latent attention"),
    (Arch("nemotron_h", "Mamba-2 + attention + MoE / MLP-only layers", _NEMOTRON_H), "single-token"),
    (Arch("bamba", "Mamba-2 + attention", dict(attn_layer_indices=[1, 3], **_MAMBA)), "single-token"),
    (Arch("zaya", "convolutional attention (CCA) with a recurrent value state"), "not yet measured exact"),
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
    if "vocab_size_per_layer_input" in defaults.to_dict() and "vocab_size_per_layer_input" not in arch.overrides:
        kwargs["vocab_size_per_layer_input"] = vocab_size  # Gemma 4 looks every token up in its per-layer table
    config = AutoConfig.for_model(arch.model_type, **kwargs)
    return config


def tiny_arch_model(
    arch: Arch,
    vocab_size: int,
    special_ids: dict[str, int] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A random instance of `arch` (std `INIT_STD`; fp32 unless `dtype`), eval mode, with the family's attention
    implementation. In float64 MoE experts run eagerly (the grouped-matmul kernel takes no float64)."""
    config = tiny_config(arch, vocab_size, special_ids)
    kwargs = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=arch.attn_impl, **kwargs)
    for key, value in (special_ids or {}).items():
        setattr(model.generation_config, key, value)
    return model.to(dtype).eval()
