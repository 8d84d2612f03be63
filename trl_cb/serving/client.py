"""The trainer's client for one or more rollout servers: split prompts across replicas, resubmit a dead one's share.

Guarantees: `generate` returns every requested completion in the caller's order (prompt i's samples at
`[i*G:(i+1)*G]`) or raises `RolloutServerError` naming every URL and why it failed; every HTTP call has a timeout,
so it never hangs. Transient faults are retried before they are failures: one `requests.Session` retries connection
errors and HTTP 502/503 `retries` times with exponential backoff; only then is a replica left for this call and its
prompts resubmitted to the others. A request the server refuses (4xx) raises `ValueError` (another replica would
refuse it too). Bodies are built and answers read with `serving/protocol.py`'s models (binary answers, the default,
with `serving/frames.py`: per-token values arrive as tensors, no Python object per token): an answer that breaks the
protocol (a truncated frame included) raises `RolloutServerError`, never an assertion. A completion with a token of
a `weight_version` this client never pushed (0 = the initial weights) is rejected. Calls may come from several threads
at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from ..errors import RolloutServerError
from ..rollouts.rollout_groups import TokenValues, as_lists
from .frames import FRAMES_MEDIA_TYPE, ArrayChoice, FrameError, decode_frame, read_frames
from .openai_protocol import CompletionAnswer
from .protocol import (
    MAX_PROMPTS,
    Choice,
    CompletionRequest,
    StreamLine,
)

logger = logging.getLogger(__name__)

#: Statuses retried before a replica counts as failed: a proxy's bad gateway, an overloaded or restarting server.
RETRIED_STATUSES = (502, 503)


def retrying_session(api_key: str | None, retries: int, backoff_s: float, pool_size: int = 32) -> requests.Session:
    """A session that sends the API key and retries connection errors and `RETRIED_STATUSES` (any method: a
    completion request is safe to resend, and a weight announcement is refused as a repeat rather than applied
    twice), sleeping `backoff_s * 2**(k-1)` before retry k > 1. Read timeouts are not retried: a hung server fails
    within one `timeout`."""
    retry = Retry(
        total=retries,
        connect=retries,
        read=0,
        status=retries,
        other=0,
        backoff_factor=backoff_s,
        status_forcelist=RETRIED_STATUSES,
        allowed_methods=None,
        raise_on_status=False,  # the last 502/503 is returned, and reported with its body
        respect_retry_after_header=False,
    )
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry, pool_connections=pool_size, pool_maxsize=pool_size)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    return session


@dataclass
class RemoteGenerationResult:
    """`GenerationResult`'s fields, plus the weight version each completion was sampled with. Per-token values are
    lists (JSON answers) or 1-D tensors viewing the answer's buffer (binary answers: int32 ids and
    versions, fp32 logprobs; read-only); `rollout_groups.as_lists` makes lists where a caller needs them."""

    completion_ids: list[TokenValues]
    logprobs: list[TokenValues]
    policy_logprobs: list[TokenValues]
    weight_versions: list[int]  # per completion: its oldest token's version
    token_weight_versions: list[TokenValues]  # per token: the version that sampled it
    num_generations: int
    timings: dict[str, float] = field(default_factory=dict)

    def as_lists(self) -> RemoteGenerationResult:
        """This result with every per-token field as Python lists (a new result; this one is unchanged)."""
        return dataclasses.replace(
            self,
            completion_ids=as_lists(self.completion_ids),
            logprobs=as_lists(self.logprobs),
            policy_logprobs=as_lists(self.policy_logprobs),
            token_weight_versions=as_lists(self.token_weight_versions),
        )


class RolloutClient:
    """Talks to rollout servers at `urls` (`http://host:port`); `timeout` bounds every request, in seconds;
    `retries` and `backoff_s` shape the retries of transient faults (see the module docstring); `encoding` is how
    answers carry per-token arrays (`binary`: frames of raw arrays, `frames.py`, read into tensors; `json`: OpenAI's
    objects, lists)."""

    def __init__(
        self,
        urls: list[str],
        api_key: str | None = None,
        timeout: float = 300.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        encoding: str = "binary",
    ) -> None:
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        if encoding not in ("binary", "json"):
            raise ValueError(f"encoding must be 'binary' or 'json', got {encoding!r}")
        self.encoding = encoding
        self.urls = [url.rstrip("/") for url in urls]
        self.timeout = timeout
        self.session = retrying_session(api_key, retries, backoff_s)
        #: Weight versions the trainer pushed; a completion from any other version is refused.
        self.known_versions: set[int] = {0}
        self._calls = itertools.count()  # rotates the first replica between calls (one-prompt calls spread too)

    def health(self) -> dict[str, bool]:
        alive = {}
        for url in self.urls:
            try:
                alive[url] = requests.get(url + "/health", timeout=min(self.timeout, 5.0)).status_code == 200
            except requests.RequestException:
                alive[url] = False
        return alive

    def generate(self, prompts: list[list[int]], num_generations: int = 1, **sampling: Any) -> RemoteGenerationResult:
        """Sample `num_generations` completions per prompt; `sampling`: max_tokens, temperature, top_p, top_k."""
        n = num_generations
        CompletionRequest(prompt=[[0]], n=n, **sampling)  # a bad setting is the caller's error: ValueError, here
        slots: list[Choice | ArrayChoice | None] = [None] * (len(prompts) * n)
        first = next(self._calls) % len(self.urls)
        live = self.urls[first:] + self.urls[:first]
        failures: dict[str, str] = {}
        pending = list(range(len(prompts)))
        while pending:
            if not live:
                reasons = "; ".join(f"{url}: {why}" for url, why in failures.items())
                raise RolloutServerError(f"no rollout server could serve the request ({reasons})")
            shares = {url: pending[i :: len(live)] for i, url in enumerate(live)}  # round-robin
            pending = []
            for url, share in shares.items():
                for start in range(0, len(share), MAX_PROMPTS):  # the server's per-request limit
                    part = share[start : start + MAX_PROMPTS]
                    try:
                        choices = self._complete(url, [list(prompts[i]) for i in part], n, sampling)
                    except RolloutServerError as exc:  # retries are spent: leave this replica for this call
                        logger.warning("rollout server %s failed, resubmitting its prompts: %s", url, exc)
                        failures[url] = str(exc)
                        live.remove(url)
                        pending.extend(share[start:])
                        break
                    for choice in choices:
                        slots[part[choice.prompt_index] * n + choice.index % n] = choice
        done = [c for c in slots if c is not None]
        if len(done) != len(slots):  # `_complete` checked each answer; a gap here is a client bug, said plainly
            raise RolloutServerError(f"{len(slots) - len(done)} of {len(slots)} completions missing")
        return _result(done, n)

    def stream_generate(
        self,
        prompts: list[list[int]],
        num_generations: int,
        on_group: Callable[[int, RemoteGenerationResult], None],
        preferred: int = 0,
        **sampling: Any,
    ) -> None:
        """Sample `num_generations` completions per prompt with one streaming request (`/v1/completions/stream`),
        calling `on_group(i, result)` as prompt i's group finishes (finishing order, each exactly once). Replica
        `preferred` (an index, modulo the replicas) is asked first; one that fails after its retries, also mid-stream,
        gets its undelivered groups resent to the next. `RolloutServerError` when none is left; `ValueError` for a
        request the server refuses (4xx)."""
        n = num_generations
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per streaming call, got {len(prompts)}")
        CompletionRequest(prompt=[[0]], n=n, **sampling)  # a bad setting is the caller's error: ValueError, here
        urls = list(self.urls)
        start = preferred % len(urls)
        left = list(range(len(prompts)))
        failures: dict[str, str] = {}
        for url in urls[start:] + urls[:start]:
            batch = list(left)
            try:
                for j, result in self._stream(url, [list(prompts[i]) for i in batch], n, sampling):
                    left.remove(batch[j])
                    on_group(batch[j], result)
                if left:
                    raise RolloutServerError(f"the stream ended with {len(left)} of {len(batch)} groups missing")
                return
            except RolloutServerError as exc:
                logger.warning("rollout server %s failed, resending its %d groups: %s", url, len(left), exc)
                failures[url] = str(exc)
        reasons = "; ".join(f"{url}: {why}" for url, why in failures.items())
        raise RolloutServerError(f"no rollout server could serve the request ({reasons})")

    def _stream(
        self, url: str, prompts: list[list[int]], n: int, sampling: dict[str, Any]
    ) -> Iterator[tuple[int, RemoteGenerationResult]]:
        """(prompt index in `prompts`, its group) per line (frame) of one streaming request, each checked."""
        body = CompletionRequest(prompt=prompts, n=n, return_token_ids=True, encoding=self.encoding, **sampling)
        seen: set[int] = set()
        try:
            with self.session.post(
                url + "/v1/completions/stream",
                json=body.model_dump(exclude_none=True),
                timeout=self.timeout,  # also bounds the wait for each next line
                stream=True,
            ) as response:
                if response.status_code >= 500:
                    raise RolloutServerError(f"HTTP {response.status_code}: {response.text[:300]}")
                if response.status_code != 200:
                    raise ValueError(f"{url} refused the request: HTTP {response.status_code} {response.text[:500]}")
                self._check_media_type(response)
                for line in self._stream_lines(response.iter_content(chunk_size=None)):  # each as it arrives
                    if line.error is not None:
                        if line.status is not None and 400 <= line.status < 500:
                            raise ValueError(f"{url} refused the request: HTTP {line.status} {line.error[:500]}")
                        raise RolloutServerError(f"HTTP {line.status}: {line.error[:300]}")
                    i, choices = line.prompt_index, line.choices
                    samples = sorted(c.index - i * n for c in choices) if i is not None else []
                    if i is None or not 0 <= i < len(prompts) or i in seen or samples != list(range(n)):
                        raise RolloutServerError(f"a stream line does not hold one new group of {n} samples")
                    if any(c.prompt_index != i for c in choices):
                        raise RolloutServerError("a stream line mixes prompts")
                    seen.add(i)
                    self._check_versions(line.versions)
                    yield i, _result(sorted(choices, key=lambda c: c.index), n)
        except requests.RequestException as exc:
            raise RolloutServerError(f"{type(exc).__name__}: {exc}") from exc

    def _stream_lines(self, pieces: Iterator[bytes]) -> Iterator[_Line]:
        """The stream's lines (binary: frames), parsed; `RolloutServerError` for one that breaks the protocol (a
        truncated frame included)."""
        try:
            if self.encoding == "binary":
                for frame in read_frames(pieces):
                    header, choices = decode_frame(frame)
                    versions = header.choices.versions() if header.choices is not None else set()
                    yield _Line(header.prompt_index, choices, versions, header.error, header.status)
                return
            for raw in _lines(pieces):
                if raw:
                    line = StreamLine.model_validate_json(raw)
                    choices, versions = _choices(line.choices)
                    yield _Line(line.prompt_index, choices, versions, line.error, line.status)
        except ValueError as exc:  # pydantic's ValidationError and `frames.FrameError` too
            raise RolloutServerError(f"a stream line breaks the protocol: {str(exc)[:300]}") from exc

    def _check_media_type(self, response: requests.Response) -> None:
        """A binary answer must say so: anything else (an old server's JSON, a proxy's page) is not read as frames."""
        if self.encoding == "binary":
            media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
            if media_type != FRAMES_MEDIA_TYPE:
                raise RolloutServerError(f"the answer breaks the protocol: {media_type!r} for binary frames")

    def _check_versions(self, versions: set[int]) -> None:
        unknown = versions - self.known_versions
        if unknown:
            raise RolloutServerError(f"completions sampled with weight versions {sorted(unknown)} never pushed")

    def _answer_choices(
        self, response: requests.Response, n: int
    ) -> tuple[list[Choice] | list[ArrayChoice], set[int]]:
        """A `/v1/completions` answer's choices and every weight version they carry (`ValueError` if malformed)."""
        if self.encoding == "binary":
            frames = list(read_frames(response.iter_content(chunk_size=None)))  # each byte copied once
            if len(frames) != 1:
                raise FrameError(f"{len(frames)} frames in an answer of one")
            header, choices = decode_frame(frames[0])
            if header.choices is None:
                raise FrameError("an answer frame without choices")
            return choices, header.choices.versions()
        answer = CompletionAnswer.model_validate_json(response.content)  # JSON: OpenAI's object, the RL fields beside
        return _choices([choice.to_choice(n) for choice in answer.choices])

    def _complete(
        self, url: str, prompts: list[list[int]], n: int, sampling: dict[str, Any]
    ) -> list[Choice] | list[ArrayChoice]:
        body = CompletionRequest(prompt=prompts, n=n, encoding=self.encoding, **sampling)
        if self.encoding == "json":  # OpenAI's answer: ask for the logprobs and the RL fields, skip the text
            body = body.model_copy(update={"logprobs": 0, "return_token_ids": True, "detokenize": False})
        try:
            with self.session.post(
                url + "/v1/completions", json=body.model_dump(exclude_none=True), timeout=self.timeout, stream=True
            ) as response:
                if response.status_code >= 500:
                    raise RolloutServerError(f"HTTP {response.status_code}: {response.text[:300]}")
                if response.status_code != 200:  # the request itself is wrong: another replica would refuse it too
                    raise ValueError(f"{url} refused the request: HTTP {response.status_code} {response.text[:500]}")
                self._check_media_type(response)
                try:
                    choices, versions = self._answer_choices(response, n)
                except ValueError as exc:  # pydantic's ValidationError and `frames.FrameError` too
                    raise RolloutServerError(f"the answer breaks the protocol: {str(exc)[:300]}") from exc
        except requests.RequestException as exc:
            raise RolloutServerError(f"{type(exc).__name__}: {exc}") from exc
        expected = {(i, k) for i in range(len(prompts)) for k in range(n)}
        got = {(c.prompt_index, c.index - c.prompt_index * n) for c in choices}
        if len(choices) != len(expected) or got != expected:
            raise RolloutServerError(
                f"returned {len(choices)} completions that do not cover the {len(prompts)} prompts x {n} samples asked"
            )
        self._check_versions(versions)
        return choices


def _lines(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """The lines of a byte stream, each as soon as its newline arrives, in time linear in the stream's length
    (`requests`' `iter_lines` re-joins and re-splits a pending line at every 512-byte read: quadratic in a line's
    length, seconds per step for lines of a few hundred kB)."""
    pending: list[bytes] = []
    for piece in pieces:
        start = 0
        while (end := piece.find(b"\n", start)) >= 0:
            pending.append(piece[start:end])
            yield b"".join(pending)
            pending, start = [], end + 1
        if start < len(piece):
            pending.append(piece[start:])
    if pending:
        yield b"".join(pending)


def _choices(answer: list[Choice] | None) -> tuple[list[Choice], set[int]]:
    """An answer's choices and every weight version they carry."""
    choices = answer or []
    return choices, {v for c in choices for v in [c.weight_version, *c.token_weight_versions]}


@dataclass
class _Line:
    """One stream line (or frame), parsed: a group's choices and the versions they carry, or an error."""

    prompt_index: int | None
    choices: list[Choice] | list[ArrayChoice]
    versions: set[int]
    error: str | None
    status: int | None


def _result(choices: list[Choice] | list[ArrayChoice], n: int) -> RemoteGenerationResult:
    return RemoteGenerationResult(
        completion_ids=[c.token_ids for c in choices],
        logprobs=[c.logprobs for c in choices],
        policy_logprobs=[c.policy_logprobs for c in choices],
        weight_versions=[c.weight_version for c in choices],
        token_weight_versions=[c.token_weight_versions for c in choices],
        num_generations=n,
    )
