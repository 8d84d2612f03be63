"""The trainer's client for one or more rollout servers: split prompts across replicas, resubmit a dead one's share.

Guarantees: `generate` returns every requested completion in the caller's order (prompt i's samples at
`[i*G:(i+1)*G]`) or raises `RolloutServerError` naming every URL and why it failed; every HTTP call has a timeout,
so it never hangs. A completion with a token of a `weight_version` this client never pushed (0 = the initial weights)
is rejected. Calls may come from several threads at once (async rollouts keep one request per group in flight).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import requests

from ..errors import RolloutServerError

logger = logging.getLogger(__name__)


@dataclass
class RemoteGenerationResult:
    """`GenerationResult`'s fields, plus the weight version each completion was sampled with."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    policy_logprobs: list[list[float]]
    weight_versions: list[int]  # per completion: its oldest token's version
    token_weight_versions: list[list[int]]  # per token: the version that sampled it
    num_generations: int
    timings: dict[str, float] = field(default_factory=dict)


class RolloutClient:
    """Talks to rollout servers at `urls` (`http://host:port`); `timeout` bounds every request, in seconds."""

    def __init__(self, urls: list[str], api_key: str | None = None, timeout: float = 300.0) -> None:
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        self.urls = [url.rstrip("/") for url in urls]
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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
        slots: list[dict | None] = [None] * (len(prompts) * n)
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
                if not share:
                    continue
                try:
                    choices = self._complete(url, [list(prompts[i]) for i in share], n, sampling)
                except RolloutServerError as exc:
                    logger.warning("rollout server %s failed, resubmitting its %d prompts: %s", url, len(share), exc)
                    failures[url] = str(exc)
                    live.remove(url)
                    pending.extend(share)
                    continue
                for choice in choices:
                    slots[share[choice["prompt_index"]] * n + choice["index"] % n] = choice
        done = [c for c in slots if c is not None]
        assert len(done) == len(slots), "a server returned fewer completions than requested"
        return RemoteGenerationResult(
            completion_ids=[c["token_ids"] for c in done],
            logprobs=[c["logprobs"] for c in done],
            policy_logprobs=[c["policy_logprobs"] for c in done],
            weight_versions=[c["weight_version"] for c in done],
            token_weight_versions=[c["token_weight_versions"] for c in done],
            num_generations=n,
        )

    def _complete(self, url: str, prompts: list[list[int]], n: int, sampling: dict[str, Any]) -> list[dict]:
        body = {"prompt": prompts, "n": n, "return_token_ids": True, **sampling}
        try:
            response = requests.post(url + "/v1/completions", json=body, headers=self.headers, timeout=self.timeout)
        except requests.RequestException as exc:
            raise RolloutServerError(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise RolloutServerError(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code != 200:  # the request itself is wrong: another replica would refuse it too
            raise ValueError(f"{url} refused the request: HTTP {response.status_code} {response.text[:500]}")
        choices = response.json()["choices"]
        if len(choices) != len(prompts) * n:
            raise RolloutServerError(f"returned {len(choices)} completions, expected {len(prompts) * n}")
        versions = {v for c in choices for v in [c["weight_version"], *c["token_weight_versions"]]}
        unknown = versions - self.known_versions
        if unknown:
            raise RolloutServerError(f"completions sampled with weight versions {sorted(unknown)} never pushed")
        return choices
