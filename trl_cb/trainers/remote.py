"""Rollouts from `trl-cb serve` replicas (`rollout_server_urls`): the trainer's side, one process.

Sync mode invariant: every completion a step trains on was sampled by the weights the trainer holds at that step.
Before the first round of each optimizer step the main process pushes its weights (`WeightSender`, one version per
push) to every replica and waits until each serves them. Async mode (`async_generation`): the servers generate ahead
while the trainer trains (`serving/remote_rollouts.py`), weights pushed after every optimizer step, staleness bounded
per token version. Either way the client refuses tokens of versions it never pushed, and the server runs the same
engine, so the sampler-side logprobs feed the IS correction exactly as on the local path. docs/server.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..rollouts.model_access import plain_module
from . import trl_internals

if TYPE_CHECKING:  # the serving modules need the `serve` extra (requests): imported when servers are used
    from ..serving.client import RolloutClient
    from ..serving.remote_rollouts import RemoteRolloutController
    from ..serving.weight_sync import WeightSender


class RemoteRolloutsMixin:
    """`_cb_remote_generate`: one round on the rollout servers, weights pushed first when the step changed."""

    _cb_client: RolloutClient | None = None
    _cb_senders: list[WeightSender] | None = None
    _cb_pushed_step: int | None = None
    _cb_weight_version: int = 0

    def _cb_remote_setup(self) -> None:
        args: Any = self.args
        if self.accelerator.num_processes > 1:
            raise NotImplementedError(
                "rollout_server_urls supports single-process training for now (got "
                f"{self.accelerator.num_processes} processes); multi-process trainers are not built yet."
            )
        config = self.generation_config
        unsent = {  # settings the HTTP API does not carry yet: refused rather than silently dropped
            "repetition_penalty": config.repetition_penalty not in (None, 1.0),
            "min_p": config.min_p is not None,
            "min_new_tokens": bool(config.min_new_tokens),
        }
        if any(unsent.values()):
            raise ValueError(
                f"rollout_server_urls cannot apply {[name for name, on in unsent.items() if on]} yet (the server "
                "samples with temperature, top_p and top_k only); unset them or generate in-process."
            )
        from ..serving.client import RolloutClient
        from ..serving.weight_sync import WeightSender

        timeout = args.cb_generation_timeout or 300.0
        self._cb_client = RolloutClient(args.rollout_server_urls, api_key=args.rollout_server_api_key, timeout=timeout)
        self._cb_senders = [
            WeightSender(url, args.rollout_server_api_key, timeout=timeout) for url in self._cb_client.urls
        ]

    def _cb_remote_generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        if self._cb_client is None:
            self._cb_remote_setup()
        if self._cb_pushed_step != self.state.global_step:
            self._cb_push_weights()
        with trl_internals.profiling_context(self, "trl_cb.remote_generate"):
            result = self._cb_client.generate(prompt_ids, 1, **self._cb_remote_sampling())
        self._cb_last_logprobs = result.policy_logprobs
        return result.completion_ids, result.policy_logprobs

    def _cb_remote_sampling(self) -> dict[str, Any]:
        """The `/v1/completions` sampling fields of the trainer's generation config."""
        config = self.generation_config
        return {
            "max_tokens": config.max_new_tokens,
            "temperature": config.temperature if config.temperature is not None else 1.0,
            "top_p": config.top_p if config.top_p is not None else 1.0,
            "top_k": config.top_k or 0,
        }

    def _cb_push_weights(self) -> int:
        """Push the current weights to every replica as a new version (served once this returns); return it."""
        self._cb_weight_version += 1
        module = plain_module(self.model_wrapped)
        self._cb_client.known_versions.add(self._cb_weight_version)  # tokens of it may arrive before the push ends
        with trl_internals.profiling_context(self, "trl_cb.push_weights"):
            for sender in self._cb_senders:
                sender.push(module, self._cb_weight_version)
        self._cb_pushed_step = self.state.global_step
        return self._cb_weight_version

    def _cb_remote_async_controller(
        self, prompt_stream: Iterator[tuple[Any, list[int]]], validate: Callable[[list[int]], None]
    ) -> RemoteRolloutController:
        """Async rollouts from the servers (`serving/remote_rollouts.py`), with the local controller's bounds."""
        if self._cb_client is None:
            self._cb_remote_setup()
        from ..serving.remote_rollouts import RemoteRolloutController

        args: Any = self.args
        rows_per_step = args.generation_batch_size // self.accelerator.num_processes
        return RemoteRolloutController(
            self._cb_client,
            prompt_stream,
            num_generations=self.num_generations,
            groups_per_step=rows_per_step // self.num_generations,
            sampling=self._cb_remote_sampling(),
            push_weights=self._cb_push_weights,
            prefetch_depth=args.prefetch_depth,
            max_staleness=self._cb_max_staleness(),
            keep_stale=args.async_keep_stale,
            timeout=args.cb_generation_timeout,
            validate=validate,
        )

    def _cb_remote_close(self) -> None:
        senders, self._cb_senders, self._cb_client = self._cb_senders or [], None, None
        for sender in senders:
            try:
                sender.close()
            except Exception:  # a dead server has nothing to close
                pass
