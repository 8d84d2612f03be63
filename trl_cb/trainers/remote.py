"""Rollouts from `trl-cb serve` replicas (`cb_server_urls`): the trainer's side.

Sync mode invariant: every completion a step trains on was sampled by the weights the trainer holds at that step:
before the first round of each optimizer step the weights are pushed (one version per push) to every replica, which
serves them before the round starts. Async mode (`cb_async_generation`): the servers generate ahead while the trainer
trains (`serving/remote_rollouts.py`, shared by `ScatteredRemoteRollouts`), weights pushed after every optimizer step.
Either way the client refuses tokens of versions it never pushed, and the sampler-side logprobs feed the IS
correction as on the local path.

Multi-process (DDP, ZeRO-3, FSDP2): only the main process talks to the servers. Every rank takes part in gathering
the weights, one parameter at a time (`engine/weight_export.py`), the main process broadcasts each to the servers;
each round (sync) or step (async) the main process generates or takes every rank's groups and hands each rank its
own share. A failure on the main process is raised on every rank, so no rank waits in a collective for a partner
that left. docs/server.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ..checks.generation_settings import settings_servers_cannot_apply
from ..engine.weight_export import iter_weights, weight_specs
from ..errors import RolloutServerError
from ..rollouts.async_core import AsyncBounds, AsyncRolloutSource
from ..rollouts.model_access import plain_module
from ..rollouts.rollout_groups import TokenValues, as_lists
from . import trl_internals
from .rollout_state import RolloutStateMixin

if TYPE_CHECKING:  # the serving modules need the `serve` extra (requests): imported when servers are used
    from ..rollouts.async_metrics import AsyncMetrics
    from ..rollouts.rollout_groups import RolloutGroup
    from ..serving.remote_rollouts import RemoteRolloutController
    from ..serving.weight_sync import WeightSender

logger = logging.getLogger(__name__)

T = TypeVar("T")
Completions = tuple[list[list[int]], list[TokenValues]]  # (ids, per-token policy logprobs: lists or tensors)


class RemoteRolloutsMixin(RolloutStateMixin):
    """`_cb_remote_generate`: one round on the rollout servers, weights pushed first when the step changed. Its
    state: `rollout_state.remote`."""

    def _cb_remote_setup(self) -> None:
        args: Any = self.args
        unsent = settings_servers_cannot_apply(self.generation_config.to_dict())
        if unsent:  # refused rather than silently dropped
            raise ValueError(
                f"cb_server_urls cannot apply {unsent} (the server samples with temperature, top_p and top_k "
                "only); unset them or generate in-process."
            )

        def connect() -> None:
            from ..serving.client import RolloutClient
            from ..serving.weight_sync import WeightSender

            timeout = args.cb_generation_timeout or 300.0
            key = args.cb_server_api_key
            remote.client = RolloutClient(args.cb_server_urls, api_key=key, timeout=timeout)
            remote.senders = [WeightSender(url, key, timeout=timeout) for url in remote.client.urls]
            remote.server_dtypes = [sender.server_dtype() for sender in remote.senders]

        remote = self.rollout_state.remote
        self._cb_on_main(connect)
        remote.connected = True

    def _cb_on_main(self, work: Callable[[], T]) -> T:
        """`work()` on the main process, its result on every rank; its failure raised on every rank."""
        accelerator = self.accelerator
        if accelerator.num_processes == 1:
            return work()
        from accelerate.utils import broadcast_object_list

        outcome: list[Any] = [None, None]  # (error text, result)
        error: Exception | None = None
        if accelerator.is_main_process:
            try:
                outcome[1] = work()
            except Exception as exc:  # noqa: BLE001 - raised below, after the other ranks heard of it
                error, outcome[0] = exc, f"{type(exc).__name__}: {exc}"
        broadcast_object_list(outcome, from_process=0)
        if error is not None:
            raise error
        if outcome[0] is not None:
            raise RolloutServerError(f"the main process failed talking to the rollout servers: {outcome[0]}")
        return outcome[1]

    def _cb_remote_generate(self, prompt_ids: list[list[int]]) -> Completions:
        """This rank's completions of `prompt_ids`; a collective in multi-process training (every rank calls it)."""
        remote = self.rollout_state.remote
        if not remote.connected:
            self._cb_remote_setup()
        if remote.pushed_step != self.state.global_step:
            self._cb_push_weights()
        sampling = self._cb_remote_sampling()
        accelerator = self.accelerator
        with trl_internals.profiling_context(self, "trl_cb.remote_generate"):
            if accelerator.num_processes == 1:
                shares = [prompt_ids]
            else:
                from accelerate.utils import gather_object

                shares = gather_object([prompt_ids])  # one list per rank, in rank order

            def generate_all() -> list[Completions]:
                result = remote.client.generate([p for share in shares for p in share], 1, **sampling)
                out, start = [], 0
                for share in shares:  # back to each rank, in its own prompts' order
                    end = start + len(share)
                    out.append((result.completion_ids[start:end], result.policy_logprobs[start:end]))  # tensors
                    start = end
                return out

            completion_ids, logprobs = self._cb_on_main(generate_all)[accelerator.process_index]
        return as_lists(completion_ids), logprobs  # TRL decodes and pads the ids as lists

    def cb_sync_rollout_servers(self) -> int:
        """For a TRL `rollout_func` that samples from the servers itself (an OpenAI-client environment against
        `trl-cb serve`, docs/server.md "Training on trajectories from an OpenAI client"): connect, push this step's
        weights unless pushed already, and return the version the servers now serve (every token the environment
        gets should carry it: a later one was pushed by someone else, an earlier one is stale). A collective."""
        remote = self.rollout_state.remote
        if not remote.connected:
            self._cb_remote_setup()
        if remote.pushed_step != self.state.global_step:
            self._cb_push_weights()
        return remote.weight_version

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
        """Push the current weights to every replica as the next version (served once this returns) and return it:
        every rank gathers (a collective when sharded), the main process sends."""
        remote = self.rollout_state.remote
        version = remote.weight_version + 1
        module = plain_module(self.model_wrapped)
        specs, weights = weight_specs(module), iter_weights(module)

        def send() -> None:
            from ..serving.weight_sync import push_weights

            remote.client.known_versions.add(version)  # async: tokens of it may arrive before the push ends
            failed = push_weights(remote.senders, specs, weights, version, remote.server_dtypes)
            self._cb_drop_replicas(failed)

        with trl_internals.profiling_context(self, "trl_cb.push_weights"):
            if not self.accelerator.is_main_process:
                for _ in weights:  # take part in the gathers
                    pass
            self._cb_on_main(send)
        remote.weight_version = version
        remote.pushed_step = self.state.global_step
        return version

    def cb_remote_async_rollouts(
        self,
        prompt_stream: Iterator[tuple[Any, list[int]]],
        validate: Callable[[list[int]], None],
        groups_per_rank: int,
        bounds: AsyncBounds,
    ) -> ScatteredRemoteRollouts:
        """Async rollouts from the servers (`serving/remote_rollouts.py`) for the async bridge: the main process's
        controller requests every rank's groups; each rank trains on its own share. A collective."""
        if not self.rollout_state.remote.connected:
            self._cb_remote_setup()
        accelerator = self.accelerator
        controller = None
        if accelerator.is_main_process:
            from ..serving.remote_rollouts import RemoteRolloutController

            groups = groups_per_rank * accelerator.num_processes
            sampling = self._cb_remote_sampling()
            controller = RemoteRolloutController(
                self.rollout_state.remote.client,
                prompt_stream,
                self.num_generations,
                groups,
                sampling,
                validate,
                **bounds,
            )
        return ScatteredRemoteRollouts(
            controller,
            groups_per_rank,
            push_weights=self._cb_push_weights,
            on_main=self._cb_on_main,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
        )

    def _cb_drop_replicas(self, failed: dict[WeightSender, str]) -> None:
        """Stop using replicas a push did not reach: they serve older weights, so sampling there would be silently
        off-policy (sync) or beyond the recorded versions' meaning. The others take their share."""
        remote = self.rollout_state.remote
        for sender, why in failed.items():
            logger.warning("rollout server %s missed a weight push and is dropped: %s", sender.url, why)
            index = remote.senders.index(sender)
            del remote.senders[index], remote.server_dtypes[index]
            remote.client.urls = [url for url in remote.client.urls if url != sender.url]

    def _cb_remote_close(self) -> None:
        remote = self.rollout_state.remote
        senders, remote.senders, remote.server_dtypes, remote.client = remote.senders, [], [], None
        remote.connected = False
        for sender in senders:
            try:
                sender.close()
            except Exception:  # a dead server has nothing to close
                pass


class ScatteredRemoteRollouts(AsyncRolloutSource):
    """The async rollouts every rank holds when rollouts come from servers.

    The main process's `RemoteRolloutController` (`controller`; `None` on the other ranks) takes all ranks' groups at
    once, oldest first, and rank r trains on slice r. Weight pushes run on every rank (`push_weights`, a collective:
    all ranks gather, the main process sends), so the controller is only told the version pushed. The stream position
    (`consumed_groups`) is the main process's, shared with every rank for checkpoints. `on_main(work)` runs `work` on
    the main process and hands its result (or its failure) to every rank.
    """

    def __init__(
        self,
        controller: RemoteRolloutController | None,
        groups_per_step: int,
        push_weights: Callable[[], int],
        on_main: Callable[[Callable[[], Any]], Any],
        num_processes: int,
        process_index: int,
    ) -> None:
        super().__init__(groups_per_step)
        self.controller = controller
        self.push_weights, self.on_main = push_weights, on_main
        self.num_processes, self.process_index = num_processes, process_index

    def start(self) -> None:
        """Push the weights first (the servers never sample unsent weights), then start requesting."""
        self.policy_version = self.push_weights()
        if self.controller is not None:
            self.controller.weights_pushed(self.policy_version)
            self.controller.start()

    def begin_weight_update(self) -> None:
        """Nothing to hold: the servers generate on their own copy while the trainer steps."""

    def end_weight_update(self) -> None:
        self.policy_version = self.push_weights()
        if self.controller is not None:
            self.controller.weights_pushed(self.policy_version)

    def take(self, num_groups: int) -> tuple[list[RolloutGroup], AsyncMetrics]:
        """This rank's `num_groups` groups; a collective (every rank calls it each step)."""
        ranks = self.num_processes

        def take_all() -> tuple[list[list[RolloutGroup]], AsyncMetrics, int]:
            groups, metrics = self.controller.take(num_groups * ranks)
            shares = [groups[r * num_groups : (r + 1) * num_groups] for r in range(ranks)]
            return shares, metrics, self.controller.consumed_groups

        shares, metrics, self.consumed_groups = self.on_main(take_all)
        return shares[self.process_index], metrics

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
