"""`prompt_logprobs`: each prompt token's logprob under the served policy, and its `k` most likely alternatives, as
vLLM's `prompt_logprobs=k` returns them.

Why: scoring given tokens (a reference model's logprobs for a KL term, a verifier's likelihood) is the other half of
what RL clients ask a rollout server for. The engine computes logits only where it samples, so the prompt is scored by
one teacher-forced forward of the served model (no cache): the same computation as the trainer's, at temperature 1
(the policy itself: no sampling setting applies to given tokens), in fp32 from the model's logits.

Invariants: `score_prompts` runs on the serving engine's loop (`EngineLoop.score`), between two weight updates, so a
prompt's values all come from one weight version, which the answer reports; an entry is `None` at position 0 (nothing
precedes it) and `{str(id): {"logprob", "rank", "decoded_token"}}` after: the prompt's token, then the `k` most likely
(vLLM's shape; rank 1 is the most likely token; the prompt's token once if it is among them). Memory: one prompt at a
time, log-softmax over `_POSITIONS` positions at once.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MAX_PROMPT_LOGPROBS", "PromptScores", "prompt_logprob_entries", "refuse_unscorable", "score_prompts"]

#: Positions whose fp32 log-softmax is computed at once (bounds the extra memory to _POSITIONS x vocabulary floats).
_POSITIONS = 1024

#: Most alternatives per prompt position (vLLM's `max_logprobs` default).
MAX_PROMPT_LOGPROBS = 20

#: Per prompt: (each token's logprob, its rank, the top-k `(id, logprob)` there, best first), each of length
#: `len(prompt) - 1` (position 0 has none).
PromptScores = list[tuple[list[float], list[int], list[list[tuple[int, float]]]]]


def refuse_unscorable(model: torch.nn.Module) -> str | None:
    """Why `model` cannot be scored beside its running engine, or None: a `paged|...` attention implementation
    (transformers' eager switched for the engine) needs the engine's cache in every forward."""
    implementation = str(getattr(model.config, "_attn_implementation", "") or "")
    if implementation.startswith("paged"):
        return (
            f"prompt_logprobs needs a forward outside the engine, which the served attention ({implementation!r}) "
            "cannot run: serve the model with sdpa or flash attention"
        )
    return None


@torch.no_grad()
def score_prompts(model: torch.nn.Module, prompts: list[list[int]], top: int = 0) -> PromptScores:
    """Each prompt's token logprobs and ranks under `model` (teacher forcing, temperature 1, fp32 log-softmax), and
    the `top` most likely tokens at each position with their logprobs."""
    scores: PromptScores = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
        logits = model(input_ids=ids).logits[0, :-1]  # position t predicts token t + 1
        targets = ids[0, 1:]
        logprobs, ranks, alternatives = [], [], []
        for start in range(0, targets.numel(), _POSITIONS):
            rows = torch.log_softmax(logits[start : start + _POSITIONS].float(), dim=-1)
            chosen = rows.gather(1, targets[start : start + _POSITIONS, None])
            logprobs += chosen[:, 0].tolist()
            ranks += ((rows > chosen).sum(dim=1) + 1).tolist()
            values, ids = rows.topk(top, dim=-1) if top else (rows[:, :0], rows[:, :0].long())
            alternatives += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        scores.append((logprobs, ranks, alternatives))
    return scores


def prompt_logprob_entries(
    prompt: list[int], scores: tuple[list[float], list[int], list[list[tuple[int, float]]]], tokenizer: Any
) -> list:
    """vLLM's `prompt_logprobs` of one prompt: `None`, then per token `{str(id): {logprob, rank, decoded_token}}` for
    the token itself and each alternative (ranks 1..k; `decoded_token`: the token's text, `None` without a
    tokenizer)."""

    def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
        text = tokenizer.decode([token]) if tokenizer is not None else None
        return {"logprob": logprob, "rank": rank, "decoded_token": text}

    entries: list[dict[str, Any] | None] = [None]
    for token, logprob, rank, top in zip(prompt[1:], *scores, strict=True):
        position = {str(token): entry(token, logprob, rank)}
        for k, (alternative, value) in enumerate(top, start=1):
            position.setdefault(str(alternative), entry(alternative, value, k))
        entries.append(position)
    return entries
