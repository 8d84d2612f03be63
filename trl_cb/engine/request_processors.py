"""Logits processors trl_cb applies per request, because transformers' CB engine drops them or has none.

`generate()`'s repetition penalty and min-length processors read the whole `(batch, sequence)` input ids; the engine
hands processors only each row's last token, so it drops or never builds them. These compute the same thing from each
request's own history (prompt and completion so far), which `_upstream_sampling.PerRequestProcessor` reads from the
engine's request states before every forward; beside them, OpenAI's presence / frequency penalties and logit bias,
per-request seeds (`SeededRows`) and alternatives (`TopLogprobs`), both read by the sampler. Order (first, on the
raw logits): logit bias, repetition penalty, presence / frequency penalties, min length.

Contract: `prepare(histories)` runs on the engine thread right before the forward whose logits `__call__` processes;
row i of `scores` is `histories[i]`'s; rows past `len(histories)` are left alone. Each value is the request's own
(`RequestHistory.settings`, a rollout server's per-request kwargs) where it carries one, else the engine's. Everything
that reads per-step state on the host needs the synchronous, uncompiled path (`require_synchronous_engine`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "HistoryProcessor",
    "LogitBias",
    "MinLengthEosSuppression",
    "OccurrencePenalties",
    "RepetitionPenalty",
    "SeededRows",
    "TopLogprobs",
    "UNSEEDED",
    "RequestHistory",
    "RequestProcessorSettings",
    "REQUEST_KWARGS",
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
    request; that comes with a new state, hence a new key.) `settings`: the request's own values of
    `RequestProcessorSettings` fields (a rollout server's per-request kwargs); absent ones are the engine's.
    """

    request_id: str
    key: object
    prompt_len: int
    prefix: Sequence[int]
    generated: Sequence[int]
    settings: Mapping[str, Any] = field(default_factory=dict)

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

    def setting(self, name: str, default: Any) -> Any:
        """This request's value of setting `name`, else `default` (the engine's)."""
        return self.settings.get(name, default)


#: The `seed` of a request that draws from the engine's shared generator.
UNSEEDED = -1
#: How transformers names a forked request's children: `{parent id}{CHILD_MARK}{i}`, i = 0, 1, ... (pinned by
#: tests/unit/test_contracts.py); per-request seeds tell a prompt's samples apart by it.
CHILD_MARK = "__child#"


def sample_index(request_id: str) -> int:
    """Which of its prompt's forked samples `request_id` is: 0 for the parent, i + 1 for child i."""
    _, mark, child = request_id.rpartition(CHILD_MARK)
    return int(child) + 1 if mark and child.isdigit() else 0


@dataclass(frozen=True)
class RequestProcessorSettings:
    """What trl_cb applies per request itself (read from the generation config by `checks.generation_settings`); all
    off by default. `logit_bias`: sorted `(token id, bias)` pairs (hashable, as a request kwarg must be typed);
    `seed`: draws from a generator per request (`UNSEEDED`: the engine's shared one)."""

    repetition_penalty: float | None = None
    min_new_tokens: int = 0
    min_length: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int = UNSEEDED
    top_logprobs: int = 0

    @property
    def needs_history(self) -> bool:
        return bool(
            self.seed != UNSEEDED
            or self.top_logprobs > 0
            or self.repetition_penalty is not None
            or self.min_new_tokens > 0
            or self.min_length > 0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
        )


#: The settings a request may carry as its own (engine request kwargs, each typed as transformers checks them).
REQUEST_KWARGS: dict[str, type] = {
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "min_new_tokens": int,
    "logit_bias": tuple,
    "seed": int,
    "top_logprobs": int,
}


class HistoryProcessor(Protocol):
    def prepare(self, histories: Sequence[RequestHistory]) -> None: ...

    def __call__(self, scores: torch.Tensor) -> torch.Tensor: ...


class RepetitionPenalty:
    """`generate()`'s repetition penalty on every token id in the request's prompt and completion so far (a logit
    divided by the penalty where positive, multiplied where negative), with each request's own penalty.

    Per request it keeps the set of ids seen (updated with the tokens appended since the previous step), so a step
    costs O(new tokens + distinct ids), not O(sequence length). A request whose penalty is 1 costs nothing.
    """

    def __init__(self, penalty: float) -> None:
        if not penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {penalty}.")
        self.penalty = penalty
        self._seen: dict[str, tuple[object, int, set[int], list[int]]] = {}  # id -> (key, length, set, ids)
        self._index = _Entries()

    def prepare(self, histories: Sequence[RequestHistory]) -> None:
        seen: dict[str, tuple[object, int, set[int], list[int]]] = {}
        entries = _Entries()
        for row, h in enumerate(histories):
            penalty = float(h.setting("repetition_penalty", self.penalty))
            if penalty == 1.0:
                continue
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
            entries.add(row, ids, [penalty] * len(ids))
        self._seen = seen  # requests absent from this step are dropped (rebuilt if they come back)
        self._index = entries

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        rows, cols, penalty = self._index.on(scores)
        picked = scores[rows, cols]
        penalised = torch.where(picked < 0, picked * penalty, picked / penalty)
        return scores.index_put((rows, cols), penalised)


class OccurrencePenalties:
    """OpenAI's (and vLLM's) presence and frequency penalties: each token id the request's completion has used so far
    has `presence + frequency x its count` subtracted from its logit (prompt tokens do not count), per request.
    Counts are kept per request and updated with the tokens appended since the previous step."""

    def __init__(self, presence: float = 0.0, frequency: float = 0.0) -> None:
        self.presence, self.frequency = presence, frequency
        self._counts: dict[str, tuple[object, int, dict[int, int]]] = {}  # id -> (key, length, counts)
        self._index = _Entries()

    def prepare(self, histories: Sequence[RequestHistory]) -> None:
        kept: dict[str, tuple[object, int, dict[int, int]]] = {}
        entries = _Entries()
        for row, h in enumerate(histories):
            presence = float(h.setting("presence_penalty", self.presence))
            frequency = float(h.setting("frequency_penalty", self.frequency))
            if presence == 0.0 and frequency == 0.0:
                continue
            entry = self._counts.get(h.request_id)
            if entry is None or entry[0] is not h.key or entry[1] > h.length:
                counts: dict[int, int] = {}
                start = h.prompt_len
            else:
                _, start, counts = entry
            for token in h.tokens(max(start, h.prompt_len)):
                counts[token] = counts.get(token, 0) + 1
            kept[h.request_id] = (h.key, h.length, counts)
            entries.add(row, list(counts), [presence + frequency * c for c in counts.values()])
        self._counts = kept
        self._index = entries

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        rows, cols, amount = self._index.on(scores)
        return scores.index_put((rows, cols), scores[rows, cols] - amount)


class LogitBias:
    """OpenAI's `logit_bias`: the request's bias added to each listed token's logit (vLLM's semantics)."""

    def __init__(self, bias: Sequence[tuple[int, float]] = ()) -> None:
        self.bias = tuple(bias)
        self._index = _Entries()

    def prepare(self, histories: Sequence[RequestHistory]) -> None:
        entries = _Entries()
        for row, h in enumerate(histories):
            pairs = h.setting("logit_bias", self.bias)
            if pairs:
                entries.add(row, [int(t) for t, _ in pairs], [float(b) for _, b in pairs])
        self._index = entries

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        rows, cols, bias = self._index.on(scores)
        return scores.index_put((rows, cols), bias, accumulate=True)


class SeededRows:
    """Per-request seeds (OpenAI's `seed`): each seeded request draws its sampling noise from its own generator,
    seeded from its seed, its prompt and its sample index among the prompt's forked samples (so another prompt, or
    another sample, gets other noise), advanced once per sampled token. It changes no logit: `__call__` leaves the
    step's `{row: generator}` in `generators`, which the engine's sampler (`sampler.exponential_race`) draws those
    rows' noise from. The same prompt and seed then replay whatever shares the batch (up to the batch's effect on the
    logits); a preempted request's generator restarts from its seed."""

    def __init__(self, seed: int = UNSEEDED) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}  # by request id, on the logits' device
        self._rows: list[tuple[int, str, int | None]] = []  # (row, request id, seed of a generator to create)
        self.generators: dict[int, torch.Generator] = {}

    def prepare(self, histories: Sequence[RequestHistory]) -> None:
        self._rows = []
        for row, h in enumerate(histories):
            seed = int(h.setting("seed", self.seed))
            if seed == UNSEEDED:
                continue
            new = h.request_id not in self._generators
            prompt = tuple(h.tokens(0)[: h.prompt_len]) if new else ()
            sample = sample_index(h.request_id) if new else 0  # read once per request, not per step
            self._rows.append((row, h.request_id, hash((seed, sample, prompt)) % 2**64 if new else None))
        seen = {rid for _, rid, _ in self._rows}
        self._generators = {rid: g for rid, g in self._generators.items() if rid in seen}

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        for _, rid, seed in self._rows:
            if seed is not None:
                self._generators[rid] = torch.Generator(device=scores.device).manual_seed(seed)
        self.generators = {row: self._generators[rid] for row, rid, _ in self._rows}
        return scores


#: Steps after which `TopLogprobs` forgets lists nobody took (a finished request's are taken within a step or two).
_FORGET_AFTER_STEPS = 4096


class TopLogprobs:
    """OpenAI's `top_logprobs`: for each request asking for k, the k most likely tokens of the distribution each of
    its tokens was sampled from, and their logprobs (the sampled token's `logprobs` quantity), best first. It changes
    no logit: the sampler hands it each step's final scores (`record`); the lists wait by request id until `pop`
    (the caller takes a finished request's, or drops a cancelled one's)."""

    def __init__(self, top: int = 0) -> None:
        self.top = top
        self._asked: list[tuple[int, str, int]] = []  # (row, request id, k) of the step being prepared
        self._step: list[tuple[int, str, int]] = []
        self._taken: dict[str, list[tuple[list[int], list[float]]]] = {}
        self._last: dict[str, int] = {}  # request id -> the step that last added to its list
        self._steps = 0

    def prepare(self, histories: Sequence[RequestHistory]) -> None:
        self._steps += 1
        if self._steps % _FORGET_AFTER_STEPS == 0:  # a cancelled request's lists, never taken: bounded memory
            stale = [rid for rid, step in self._last.items() if step < self._steps - _FORGET_AFTER_STEPS]
            for rid in stale:
                self._taken.pop(rid, None)
                self._last.pop(rid, None)
        self._asked = [
            (row, h.request_id, k)
            for row, h in enumerate(histories)
            if (k := int(h.setting("top_logprobs", self.top))) > 0
        ]

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        self._step = self._asked
        return scores

    def record(self, scores: torch.Tensor) -> None:
        """The step's final (processed) `scores` (rows, vocab): each asking row's k best (ids, logprobs)."""
        if not self._step:
            return
        rows = torch.tensor([row for row, _, _ in self._step], device=scores.device)
        values, ids = torch.log_softmax(scores[rows].float(), dim=-1).topk(max(k for _, _, k in self._step), dim=-1)
        for (_, rid, k), row_ids, row_values in zip(self._step, ids.tolist(), values.tolist(), strict=True):
            self._taken.setdefault(rid, []).append((row_ids[:k], row_values[:k]))
            self._last[rid] = self._steps
        self._step = []

    def pop(self, request_id: str) -> list[tuple[list[int], list[float]]] | None:
        """A request's alternatives, per token (None if it asked for none), forgotten here."""
        self._last.pop(request_id, None)
        return self._taken.pop(request_id, None)


class _Entries:
    """One step's sparse `(row, token id, value)` entries of a processor: collected in `prepare`, applied in
    `__call__` (as tensors, built on the first use)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.values: list[float] = []
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def add(self, row: int, cols: Sequence[int], values: Sequence[float]) -> None:
        self.rows.extend([row] * len(cols))
        self.cols.extend(cols)
        self.values.extend(values)

    def on(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, ids, values) on `scores`' device and dtype, without ids outside the output vocabulary (never
        sampled) or rows past the scores."""
        if self._tensors is None:
            self._tensors = (
                torch.tensor(self.rows, dtype=torch.long),
                torch.tensor(self.cols, dtype=torch.long),
                torch.tensor(self.values, dtype=torch.float32),
            )
        rows, cols, values = (t.to(scores.device) for t in self._tensors)
        inside = (cols < scores.size(-1)) & (rows < scores.size(0))
        return rows[inside], cols[inside], values.to(scores.dtype)[inside]


class MinLengthEosSuppression:
    """EOS at `-inf` while a request is shorter than asked (`min_new_tokens`, the request's own where it carries one,
    else `min_length` incl. the prompt)."""

    def __init__(self, eos_token_ids: Sequence[int], min_new_tokens: int = 0, min_length: int = 0) -> None:
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.min_new_tokens = min_new_tokens
        self.min_length = min_length
        self._rows = torch.empty(0, dtype=torch.long)

    def prepare(self, histories: Sequence[RequestHistory]) -> None:
        short = [
            i
            for i, h in enumerate(histories)
            if h.num_generated < int(h.setting("min_new_tokens", self.min_new_tokens)) or h.length < self.min_length
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
    """The processors `settings` asks for, in the module's order (`generate()`'s for the two it has: repetition
    penalty, then min length). A processor is built when its engine value is set; each request may then carry its own
    value (a rollout server's engine is built with placeholders, and every request carries all of them)."""
    processors: list[HistoryProcessor] = []
    if settings.logit_bias:
        processors.append(LogitBias(settings.logit_bias))
    if settings.repetition_penalty is not None:
        processors.append(RepetitionPenalty(settings.repetition_penalty))
    if settings.presence_penalty or settings.frequency_penalty:
        processors.append(OccurrencePenalties(settings.presence_penalty, settings.frequency_penalty))
    if (settings.min_new_tokens > 0 or settings.min_length > 0) and eos_token_ids:
        processors.append(MinLengthEosSuppression(eos_token_ids, settings.min_new_tokens, settings.min_length))
    if settings.seed != UNSEEDED:
        processors.append(SeededRows(settings.seed))
    if settings.top_logprobs > 0:
        processors.append(TopLogprobs(settings.top_logprobs))
    return processors


#: Why the per-request processors need a synchronous engine (the default reason `require_synchronous_engine` gives).
HISTORY_NEEDS_SYNC = (
    "repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_new_tokens / min_length, seed and "
    "top_logprobs are applied from each request's state"
)
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
