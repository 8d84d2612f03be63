"""Logits processors trl_cb applies per request, because transformers' CB engine drops them.

`generate()`'s repetition penalty and min-length processors read the whole `(batch, sequence)` input ids; the engine
hands processors only each row's last token, so it drops or never builds them. These compute the same thing from each
request's own history (prompt and completion so far), which `_upstream_sampling.PerRequestProcessor` reads from the
engine's request states before every forward. Semantics are `generate()`'s, per request, applied first, in its order.

Contract: `prepare(histories)` runs on the engine thread right before the forward whose logits `__call__` processes;
row i of `scores` is `histories[i]`'s; rows past `len(histories)` are left alone. Everything that reads per-step
state on the host needs the engine's synchronous, uncompiled path (`require_synchronous_engine`, with its reason).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "HistoryProcessor",
    "MinLengthEosSuppression",
    "RepetitionPenalty",
    "RequestHistory",
    "RequestProcessorSettings",
    "build_request_processors",
    "require_synchronous_engine",
    "HISTORY_NEEDS_SYNC",
    "POLICY_LOGPROBS_NEED_SYNC",
]

#: Engine settings under which the processors cannot run: each makes the engine prepare a step before the previous
#: step's token is known, or freezes the per-step tensors (accelerator graphs, compilation).
ASYNCHRONOUS_ENGINE_SETTINGS = (
    "use_cuda_graph",
    "use_async_batching",
    "varlen_compile_config",
    "decode_compile_config",
    "default_compile_level",
)
#: What an engine running the processors is built with where the user left these unset (transformers' `None`: auto).
SYNCHRONOUS_ENGINE = {"use_cuda_graph": False, "use_async_batching": False}


@dataclass
class RequestHistory:
    """One request's tokens so far, as the engine holds them: `prefix + generated` is its prompt then completion.

    `key` identifies the engine's request state: while it is the same object, tokens are only ever appended, which
    lets processors update incrementally. (The engine may move generated tokens into `prefix` when it re-queues a
    request; that comes with a new state, hence a new key.)
    """

    request_id: str
    key: object
    prompt_len: int
    prefix: Sequence[int]
    generated: Sequence[int]

    @property
    def length(self) -> int:
        return len(self.prefix) + len(self.generated)

    @property
    def num_generated(self) -> int:
        return self.length - self.prompt_len

    def tokens(self, start: int = 0) -> list[int]:
        """Tokens from position `start` to the end (prompt and completion positions counted together)."""
        split = len(self.prefix)
        if start >= split:
            return list(self.generated[start - split :])
        return list(self.prefix[start:]) + list(self.generated)


@dataclass(frozen=True)
class RequestProcessorSettings:
    """What trl_cb applies per request itself (read from the generation config by `checks.generation_settings`); all
    off by default."""

    repetition_penalty: float | None = None
    min_new_tokens: int = 0
    min_length: int = 0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty is not None or self.min_new_tokens > 0 or self.min_length > 0


class HistoryProcessor(Protocol):
    def prepare(self, histories: Sequence[RequestHistory]) -> None: ...

    def __call__(self, scores: torch.Tensor) -> torch.Tensor: ...


class RepetitionPenalty:
    """`generate()`'s repetition penalty on every token id in the request's prompt and completion so far.

    Per request it keeps the set of ids seen (updated with the tokens appended since the previous step), so a step
    costs O(new tokens + distinct ids), not O(sequence length).
    """

    def __init__(self, penalty: float) -> None:
        if not penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {penalty}.")
        self.penalty = penalty
        self._seen: dict[str, tuple[object, int, set[int], list[int]]] = {}  # id -> (key, length, set, ids)
        self._rows = torch.empty(0, dtype=torch.long)
        self._cols = torch.empty(0, dtype=torch.long)

    def prepare(self, histories: Sequence[RequestHistory]) -> None:
        seen: dict[str, tuple[object, int, set[int], list[int]]] = {}
        counts, cols = [], []
        for h in histories:
            entry = self._seen.get(h.request_id)
            if entry is None or entry[0] is not h.key or entry[1] > h.length:
                ids_set: set[int] = set()
                ids: list[int] = []
                start = 0
            else:
                _, start, ids_set, ids = entry
            for token in h.tokens(start):
                if token not in ids_set:
                    ids_set.add(token)
                    ids.append(token)
            seen[h.request_id] = (h.key, h.length, ids_set, ids)
            counts.append(len(ids))
            cols.extend(ids)
        self._seen = seen  # requests absent from this step are dropped (rebuilt if they come back)
        self._rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
        self._cols = torch.tensor(cols, dtype=torch.long)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        rows, cols = self._rows.to(scores.device), self._cols.to(scores.device)
        inside = cols < scores.size(-1)  # ids beyond the output vocabulary cannot be sampled: nothing to penalise
        rows, cols = rows[inside], cols[inside]
        picked = scores[rows, cols]
        penalised = torch.where(picked < 0, picked * self.penalty, picked / self.penalty)
        return scores.index_put((rows, cols), penalised)


class MinLengthEosSuppression:
    """EOS at `-inf` while a request is shorter than asked (`min_new_tokens`, else `min_length` incl. the prompt)."""

    def __init__(self, eos_token_ids: Sequence[int], min_new_tokens: int = 0, min_length: int = 0) -> None:
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.min_new_tokens = min_new_tokens
        self.min_length = min_length
        self._rows = torch.empty(0, dtype=torch.long)

    def prepare(self, histories: Sequence[RequestHistory]) -> None:
        short = [
            i for i, h in enumerate(histories) if h.num_generated < self.min_new_tokens or h.length < self.min_length
        ]
        self._rows = torch.tensor(short, dtype=torch.long)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if self._rows.numel() == 0 or self.eos.numel() == 0:
            return scores
        rows, eos = self._rows.to(scores.device), self.eos.to(scores.device)
        eos = eos[eos < scores.size(-1)]
        index = (rows[:, None].expand(-1, eos.numel()), eos[None, :].expand(rows.numel(), -1))  # (R, E) each
        return scores.index_put(index, torch.tensor(-math.inf, dtype=scores.dtype, device=scores.device))


def build_request_processors(
    settings: RequestProcessorSettings, eos_token_ids: Sequence[int]
) -> list[HistoryProcessor]:
    """The processors `settings` asks for, in `generate()`'s order (repetition penalty, then min length)."""
    processors: list[HistoryProcessor] = []
    if settings.repetition_penalty is not None:
        processors.append(RepetitionPenalty(settings.repetition_penalty))
    if (settings.min_new_tokens > 0 or settings.min_length > 0) and eos_token_ids:
        processors.append(MinLengthEosSuppression(eos_token_ids, settings.min_new_tokens, settings.min_length))
    return processors


#: Why the per-request processors need a synchronous engine (the default reason `require_synchronous_engine` gives).
HISTORY_NEEDS_SYNC = "repetition_penalty / min_new_tokens / min_length are applied from each request's history"
#: Why the policy-logprob recorder (`engine/policy_logprobs.py`) needs one.
POLICY_LOGPROBS_NEED_SYNC = (
    "the sampling settings truncate or penalise the distribution, so each token's trainer-comparable logprob is "
    "recorded on the host"
)


def require_synchronous_engine(settings: Mapping[str, Any], why: str = HISTORY_NEEDS_SYNC) -> None:
    """`ValueError` naming every setting in `settings` (engine kwargs, or a resolved engine config's values) that
    would make the engine asynchronous or compiled, which what reads each step on the host (`why`) cannot run under."""
    conflicting = {
        key: settings[key] for key in ASYNCHRONOUS_ENGINE_SETTINGS if settings.get(key) not in (None, False)
    }
    if conflicting:
        raise ValueError(
            f"{why} at every step, which needs the engine's synchronous, uncompiled path; unset (or set to False) "
            f"{', '.join(f'{k}={v!r}' for k, v in sorted(conflicting.items()))} in the continuous batching config, or "
            "drop those generation settings."
        )
