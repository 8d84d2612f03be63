"""The engine's sampler: one token per row by an exponential race over the processed probabilities, exact in
distribution, as vLLM samples.

Why: transformers' CB sampler calls `torch.multinomial(probs, 1)`, which on CPU draws one `Exponential(1)` per
vocabulary entry through a serial per-element kernel (~30-60 ns each on this project's CPUs) after three validation
passes over the probabilities: at 512 rows x 512 tokens that alone was a quarter of an engine step (docs/benchmarks.md,
"Engine step sweep"). Here the exponentials come from one vectorised uniform draw and a `log`: the race and the
argmax are whole-tensor ops, so a step's sampling cost is a few element-wise passes over `(rows, vocab)`.

Exactness: for independent `E_i ~ Exponential(1)`, `argmax_i p_i / E_i` is token `i` with probability `p_i / sum(p)`
(the race's first arrival: `E_i / p_i ~ Exponential(p_i)`; equivalently Gumbel-max on `log p`). Rows need not be
normalised; a zero-probability token never wins. `E = -log(U)` with `U ~ Uniform[0, 1)` in float32: `U = 0` gives
`E = inf` (that token loses the race), the smallest `E` is 2^-24 (so no division by zero); the float32 grid of `U`
limits exactness for tokens below ~1e-7 of the row's largest probability, as in vLLM's float32 sampler.
Reproducibility: draws come from `generator`, else torch's default generator (the one `torch.manual_seed` seeds, as
`torch.multinomial` uses), so a seeded engine replays the same samples.
tests/unit/engine/test_sampler.py checks the distribution with a chi-square test (and that a biased sampler fails).
"""

from __future__ import annotations

import torch

__all__ = ["exponential_race", "sample_with_logprobs"]


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` (rows, vocab), non-negative, not necessarily normalised: (rows,) int64."""
    race = torch.empty_like(probs, dtype=torch.float32).uniform_(generator=generator)  # (rows, vocab) U in [0, 1)
    race.log_().neg_()  # E = -log U ~ Exponential(1), in (0, inf]
    torch.div(probs, race, out=race)  # p / E
    return race.argmax(dim=-1)


def sample_with_logprobs(
    scores: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of the processed `scores` (rows, vocab) from `softmax(scores)` and return
    `(tokens, logprobs)`: (rows,) int64 and (rows,) float32, the log-probability of each token under the same
    probabilities (as the engine's own sampler computes it)."""
    probs = torch.softmax(scores.float(), dim=-1)  # (rows, vocab)
    tokens = exponential_race(probs, generator)
    logprobs = probs.gather(1, tokens[:, None]).squeeze(1).log()  # (rows,)
    return tokens, logprobs
