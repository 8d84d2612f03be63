"""An offline tool-calling policy: the tiny tokenizer with a tool-calling chat template and response template, and a
tiny Qwen2 whose weights script a calculator call, for the agent example and the multi-turn benchmark.

Why: a random tiny model almost never writes a valid tool call, so an offline run of a tool task would never reach a
second turn. Here the next token is a fixed function of the last one (every layer's output projection is zero: the
final hidden state is the normalised embedding of the last token; the script's sources get orthonormal embeddings and
each target's LM-head row points along its sources, a logit margin of `margin` over every other token), except after
a tool's answer, where the policy calls the calculator again with probability `p_again` and otherwise answers.
Rounds per sample are then geometric (long-tailed, mean 1 + p_again / (1 - p_again)):

    <|assistant|> -> <tool_call> -> CALL -> </tool_call> -> <|end|>     (first turn: calculator("48 / 2"))
    <|resume|>    -> <tool_call> (p_again) | ANSWER (1 - p_again) ...    (after each tool answer)

The chat template renders the generation prompt as `<|resume|>` after a tool message and `<|assistant|>` otherwise
(prefix-preserving, as TRL requires for multi-turn); the response template lets TRL parse the call.
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .tiny import tiny_tokenizer

__all__ = ["ANSWER", "CALL", "agent_tokenizer", "calculator", "chat_tokenizer", "scripted_agent", "scripted_model"]

CALL = '\n{"name": "calculator", "arguments": {"expression": "48 / 2"}}\n'
ANSWER = "#### 24"
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


def calculator(expression: str) -> str:
    """
    Evaluates an arithmetic expression.

    Args:
        expression: Numbers, + - * / and parentheses, e.g. "48 / 2".

    Returns:
        The value, as text.
    """
    if not expression or len(expression) > 64 or "**" in expression or set(expression) - set("0123456789.+-*/() "):
        raise ValueError(f"not an arithmetic expression: {expression[:64]!r}")
    value = eval(compile(expression, "<calculator>", "eval"), {"__builtins__": {}}, {})  # digits and operators only
    return str(int(value) if float(value).is_integer() else round(value, 6))


def agent_tokenizer() -> PreTrainedTokenizerFast:
    """`chat_tokenizer` with the calculator script's call and answer as single tokens."""
    return chat_tokenizer([CALL, ANSWER])


def scripted_agent(
    tokenizer: PreTrainedTokenizerFast, p_again: float = 0.0, margin: float = 40.0, hidden_size: int = 64
) -> Qwen2ForCausalLM:
    """The scripted calculator policy (module docstring); `p_again` in [0, 1): chance of another call after each
    tool answer."""
    if not 0.0 <= p_again < 1.0:
        raise ValueError(f"p_again must be in [0, 1), got {p_again}")
    again = math.log(p_again / (1 - p_again)) if p_again > 0 else -margin  # logit of a new call against the answer
    script = [
        ("<|assistant|>", "<tool_call>", margin),
        ("<tool_call>", CALL, margin),
        (CALL, "</tool_call>", margin),
        ("</tool_call>", "<|end|>", margin),
        ("<|resume|>", ANSWER, margin),
        ("<|resume|>", "<tool_call>", margin + again),
        (ANSWER, "<|end|>", margin),
    ]
    return scripted_model(tokenizer, script, hidden_size)


@torch.no_grad()
def scripted_model(
    tokenizer: PreTrainedTokenizerFast,
    script: list[tuple[str, str, float]],
    hidden_size: int = 64,
    max_positions: int = 2048,
) -> Qwen2ForCausalLM:
    """A one-layer Qwen2 whose next-token logits after token `source` are `logit` for each `(source, target, logit)`
    of `script` (summed where a source has several targets) and about 0 for every other token (module docstring)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for src, dst, _ in script for tok in (src, dst)}
    sources = list(dict.fromkeys(src for src, _, _ in script))
    basis = torch.eye(hidden_size)
    model.lm_head.weight.zero_()
    for i, src in enumerate(sources):
        model.model.embed_tokens.weight[ids[src]] = basis[i]
    for src, dst, logit in script:
        # RMSNorm turns the unit embedding into sqrt(hidden) * basis: logit = scale * sqrt(hidden).
        model.lm_head.weight[ids[dst]] += basis[sources.index(src)] * (logit / hidden_size**0.5)
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def chat_tokenizer(extra_tokens: list[str]) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the markers (plain added tokens: they survive decoding) and `extra_tokens`, the
    tool-calling chat template, the response template, and `<|end|>` as EOS."""
    tok = tiny_tokenizer()
    tok.add_tokens(MARKERS)
    tok.add_tokens(extra_tokens)
    tok.chat_template = TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    tok.eos_token = "<|end|>"
    return tok
