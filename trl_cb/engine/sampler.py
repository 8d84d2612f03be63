"""The engine's sampler: one token per row by an exponential race over the processed probabilities, exact in
distribution, as vLLM samples.

Why: transformers' CB sampler calls `torch.multinomial(probs, 1)`, which on CPU validates the probabilities (three
passes) and then draws one `Exponential(1)` per vocabulary entry through a serial per-element kernel, ~6x slower than
uniform draws: most of a 512-row step's sampling (docs/benchmark-log.md, "Engine step sweep"). Here the exponentials
are `-log` of one vectorised uniform draw; the race and its argmax are whole-tensor ops.

Exactness: for independent `E_i ~ Exponential(1)`, `argmax_i p_i / E_i` is `i` with probability `p_i / sum(p)` (the
race's first arrival; Gumbel-max on `log p`); rows need not be normalised and a zero-probability token never wins.
`U ~ Uniform[0, 1)` in float32: `U = 0` gives `E = inf` (that token loses), the smallest `E` is 2^-24 (no division by
zero); the float32 grid limits exactness below ~1e-7 of a row's largest probability, as in vLLM's float32 sampler.
Draws come from `generator`, else torch's default generator (seeded by `torch.manual_seed`, as `torch.multinomial`),
so a seeded engine replays. tests/unit/engine/test_sampler.py: chi-square tests, with a biased sampler as control.
"""

from __future__ import annotations

import torch

__all__ = ["exponential_race", "sample_with_logprobs"]


def exponential_race(
    probs: torch.Tensor, generator: torch.Generator | None = None, rows: dict[int, torch.Generator] | None = None
) -> torch.Tensor:
    """One token per row of `probs` (rows, vocab), non-negative, not necessarily normalised: (rows,) int64. `rows`:
    rows whose draws come from their own generator (a seeded request's) instead."""
    race = torch.empty_like(probs, dtype=torch.float32).uniform_(generator=generator)  # (rows, vocab) U in [0, 1)
    for row, own in (rows or {}).items():
        if row < race.size(0):
            race[row].uniform_(generator=own)
    race.log_().neg_()  # E = -log U ~ Exponential(1), in (0, inf]
    torch.div(probs, race, out=race)  # p / E
    return race.argmax(dim=-1)


def sample_with_logprobs(
    scores: torch.Tensor, generator: torch.Generator | None = None, rows: dict[int, torch.Generator] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of the processed `scores` (rows, vocab) from `softmax(scores)` and return
    `(tokens, logprobs)`: (rows,) int64 and (rows,) float32, the log-probability of each token under the same
    probabilities (as the engine's own sampler computes it); `rows` as `exponential_race`'s."""
    probs = torch.softmax(scores.float(), dim=-1)  # (rows, vocab)
    tokens = exponential_race(probs, generator, rows)
    logprobs = probs.gather(1, tokens[:, None]).squeeze(1).log()  # (rows,)
    return tokens, logprobs
