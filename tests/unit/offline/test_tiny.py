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


def test_offline_model_name_is_one_name_with_the_old_spelling_accepted():
    from trl_cb.offline.data import GSM8KScriptArguments
    from trl_cb.offline.names import TINY_MODEL, is_tiny_model_name

    assert TINY_MODEL == "trl-cb/tiny" == GSM8KScriptArguments().model_name_or_path
    assert is_tiny_model_name("trl-cb/tiny") and is_tiny_model_name("tiny") and not is_tiny_model_name("Qwen/x")
