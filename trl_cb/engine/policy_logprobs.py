"""The sampled token's logprob under the policy the trainer models, computed from the sampler's own logits.

Why: the engine samples from the *processed* distribution (repetition penalty, min-length EOS suppression,
temperature, top-k/top-p/min-p/... truncation and renormalisation) and records that logprob. TRL's trainer models
the policy as `log_softmax(logits / temperature)` over the whole vocabulary and nothing else. Under any truncating or
penalising setting the two differ by far more than numerics (every kept token has a higher processed logprob), so an
importance weight built from the processed logprob is < 1 on every token and its sequence product vanishes:
training stops. The weight must compare like with like.

`PolicyLogprobRecorder` runs first in the engine's logits processors (it sees the raw fp32 logits of every row about
to be sampled and returns them unchanged) and, once the engine has sampled, gathers `log_softmax(raw / T)` at the
sampled tokens. The result is the trainer's quantity with the sampler's numerics (its kernels, dtype and batch
shapes): exactly what the importance weight is meant to measure. `_upstream_sampling.install_policy_logprob_recorder`
wires it into the engine; it is used only when some processor besides temperature reshapes the distribution
(otherwise the processed logprob already is this quantity).
"""

from __future__ import annotations

import torch

__all__ = ["PolicyLogprobRecorder"]


class PolicyLogprobRecorder:
    """Per engine step: `__call__` (a plain logits processor, first in the list) keeps `log_softmax(raw / T)` of the
    step's rows; `record(output_ids)` (after sampling) gathers them at the sampled ids into a buffer the host reads
    with `read(n)`. Row i of the step's logits is the row of the i-th sampled token, as in the engine's outputs.

    Invariant: `read(n)` returns the values of the last recorded step; steps are strictly sequential (the engine runs
    synchronously whenever a recorder is installed: no async batching, no compilation). Graph-safe: a replayed step
    writes the same buffer (`_values`, allocated at the first eager step), and `replayed` tells how many rows.
    """

    def __init__(self, temperature: float | None) -> None:
        self.temperature = float(temperature) if temperature else 1.0
        self._log_probs: torch.Tensor | None = None  # (rows, vocab) of the step being sampled
        self._values: torch.Tensor | None = None  # (max rows,) fp32, stable across steps
        self._recorded = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.keep(scores, self.temperature)
        return scores

    def keep(self, scores: torch.Tensor, temperature: float | torch.Tensor) -> None:
        """Keep `log_softmax(raw / T)` of the step's rows; `temperature` is one value or one per row, `(rows, 1)`
        (an engine whose requests carry their own temperature)."""
        self._log_probs = torch.log_softmax(scores.float() / temperature, dim=-1)  # (rows, vocab)

    def record(self, output_ids: torch.Tensor) -> None:
        """Gather the kept log-softmax at the sampled ids (`output_ids[0, :rows]`, the engine's output layout)."""
        log_probs = self._log_probs
        if log_probs is None:
            self._recorded = 0
            return
        rows = log_probs.size(0)
        if self._values is None or self._values.numel() < output_ids.size(1):
            self._values = torch.empty(output_ids.size(1), dtype=torch.float32, device=log_probs.device)
        tokens = output_ids[0, :rows].to(torch.long)  # (rows,)
        self._values[:rows].copy_(log_probs.gather(1, tokens[:, None]).squeeze(1))
        self._log_probs = None
        self._recorded = rows

    def replayed(self, rows: int) -> None:
        """A graph replayed a step of `rows` (padded) rows: it recorded them on the device (`decode_graphs.py`)."""
        self._recorded = rows

    def read(self, n: int) -> list[float] | None:
        """The last step's first `n` values, or `None` when that step recorded fewer (a step that failed)."""
        if self._values is None or n > self._recorded:
            return None
        return self._values[:n].tolist()
