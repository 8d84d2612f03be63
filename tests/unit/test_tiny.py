"""The offline model presets: shapes as documented and identical weights for a seed."""

from __future__ import annotations

import torch

from trl_cb.offline.tiny import small_model


def test_small_model_shape_and_determinism(tokenizer):
    model = small_model(tokenizer, eos_logit_bias=6.0)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (8, 256, 1024)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads) == (4, 2, 64)
    assert 7e6 < sum(p.numel() for p in model.parameters()) < 9e6
    again = small_model(tokenizer, eos_logit_bias=6.0)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    other = small_model(tokenizer, eos_logit_bias=6.0, seed=1)
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
