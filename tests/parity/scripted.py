"""A deterministic tool-calling policy: a tiny Qwen2 whose next token is a fixed function of the last token.

Why: multi-turn parity needs both paths to *generate* the same tool calls. Sampling from a random model gives each
path different completions; scripting `model.generate` (TRL's own tests) would leave the CB path untested. Here the
weights themselves encode the script, so CB and `generate()` both sample it, at temperature 1, with probability
1 - 1e-15 per token:

    <|assistant|> -> <tool_call> -> CALL -> </tool_call> -> <|end|>       (first turn: call multiply(3, 4))
    <|resume|>    -> Done!       -> <|end|>                               (after the tool result)

How (`trl_cb.offline.agent.scripted_model`): every layer's output projections are zero, so the final hidden state is
the normalised embedding of the last token; the script's source tokens get orthonormal embeddings and each target's
LM-head row points along its sources, giving the scripted token a logit margin of ~40 over every other token.

The chat template renders the generation prompt as `<|resume|>` after a tool message and `<|assistant|>` otherwise,
which is what lets a last-token policy tell the two turns apart; it is prefix-preserving, as TRL requires, and the
tokenizer carries a matching `response_template` so TRL parses the tool call.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from trl_cb.offline import agent

CALL = '\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n'
SCRIPT = [
    ("<|assistant|>", "<tool_call>"),
    ("<tool_call>", CALL),
    (CALL, "</tool_call>"),
    ("</tool_call>", "<|end|>"),
    ("<|resume|>", "Done!"),
    ("Done!", "<|end|>"),
]


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the chat markers and the script's call and answer as single tokens, the tool-calling
    chat template and response template (`trl_cb.offline.agent`), and `<|end|>` as EOS."""
    return agent.chat_tokenizer([CALL, "Done!"])


def scripted_model(tokenizer: PreTrainedTokenizerFast, margin: float = 40.0) -> Qwen2ForCausalLM:
    """A Qwen2 that follows `SCRIPT` (see module docstring)."""
    return agent.scripted_model(tokenizer, [(src, dst, margin) for src, dst in SCRIPT], max_positions=1024)
