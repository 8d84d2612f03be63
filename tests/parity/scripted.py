"""A deterministic tool-calling policy: a tiny Qwen2 whose next token is a fixed function of the last token.

Why: multi-turn parity needs both paths to *generate* the same tool calls. Sampling from a random model gives each
path different completions; scripting `model.generate` (TRL's own tests) would leave the CB path untested. Here the
weights themselves encode the script, so CB and `generate()` both sample it, at temperature 1, with probability
1 - 1e-15 per token:

    <|assistant|> -> <tool_call> -> CALL -> </tool_call> -> <|end|>       (first turn: call multiply(3, 4))
    <|resume|>    -> Done!       -> <|end|>                               (after the tool result)

How: every layer's output projections are zero, so the final hidden state is the normalised embedding of the last
token; the script's source tokens get orthonormal embeddings and each target's LM-head row points along its
sources, giving the scripted token a logit margin of ~40 over every other token.

The chat template renders the generation prompt as `<|resume|>` after a tool message and `<|assistant|>` otherwise,
which is what lets a last-token policy tell the two turns apart; it is prefix-preserving, as TRL requires, and the
tokenizer carries a matching `response_template` so TRL parses the tool call.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from trl_cb.offline.tiny import tiny_tokenizer

CALL = '\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n'
MARKERS = ["<|user|>", "<|assistant|>", "<|tool|>", "<|resume|>", "<|end|>", "<tool_call>", "</tool_call>"]
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|assistant|>{{ m.content }}"
    "{%- for tc in m.tool_calls or [] -%}"
    "<tool_call>\n{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor -%}<|end|>"
    "{%- elif m.role == 'tool' -%}<|tool|>{{ m.content }}<|end|>"
    "{%- else -%}<|user|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if messages[-1].role == 'tool' -%}<|resume|>{%- else -%}<|assistant|>{%- endif -%}"
    "{%- endif -%}"
)
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["<|assistant|>", "<|resume|>"],
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": "</tool_call>\\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": "<\\|end\\|>\\s*", "content": "text"},
    },
}
SCRIPT = [
    ("<|assistant|>", "<tool_call>"),
    ("<tool_call>", CALL),
    (CALL, "</tool_call>"),
    ("</tool_call>", "<|end|>"),
    ("<|resume|>", "Done!"),
    ("Done!", "<|end|>"),
]


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the script's markers (plain added tokens: they must survive decoding), a chat
    template, a tool-call response template, and `<|end|>` as EOS."""
    tok = tiny_tokenizer()
    tok.add_tokens(MARKERS)
    tok.add_tokens([CALL, "Done!"])
    tok.chat_template = TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    tok.eos_token = "<|end|>"
    return tok


@torch.no_grad()
def scripted_model(tokenizer: PreTrainedTokenizerFast, margin: float = 40.0) -> Qwen2ForCausalLM:
    """A Qwen2 that follows `SCRIPT` (see module docstring)."""
    hidden = 64
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for pair in SCRIPT for tok in pair}
    sources = list(dict.fromkeys(src for src, _ in SCRIPT))
    basis = torch.eye(hidden)
    model.lm_head.weight.zero_()
    for i, src in enumerate(sources):
        model.model.embed_tokens.weight[ids[src]] = basis[i]
    for src, dst in SCRIPT:
        # RMSNorm turns the unit embedding into sqrt(hidden) * basis: logit margin = scale * sqrt(hidden).
        model.lm_head.weight[ids[dst]] += basis[sources.index(src)] * (margin / hidden**0.5)
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()
