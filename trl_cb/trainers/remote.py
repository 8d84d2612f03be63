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
from ..checks.served_sampling import SERVED_SAMPLING, served_names
from ..engine.weight_export import iter_weights, weight_specs
from ..errors import RolloutServerError
from ..rollouts.async_core import AsyncBounds, AsyncRolloutSource
from ..rollouts.model_access import plain_module
from ..rollouts.rollout_groups import TokenValues, as_lists
from . import trl_internals

if TYPE_CHECKING:  # the serving modules need the `serve` extra (requests): imported when servers are used
    import torch

    from ..rollouts.async_metrics import AsyncMetrics
    from ..rollouts.rollout_groups import RolloutGroup
    from ..serving.client import RolloutClient
    from ..serving.remote_rollouts import RemoteRolloutController
    from ..serving.weight_sync import WeightSender

logger = logging.getLogger(__name__)

T = TypeVar("T")
Completions = tuple[list[list[int]], list[TokenValues]]  # (ids, per-token policy logprobs: lists or tensors)


class RemoteRollouts:
    """The trainer's side of the rollout servers (a part of `TrainerRollouts`): `generate` runs one round on them,
    weights pushed first when the step changed. The one writer of its state: `connected`, and on the main process
    `client` and `senders` (with each sender's server weight dtype in `server_dtypes`), `pushed_step` (`global_step`
    of the last push: sync mode pushes once per optimizer step) and `weight_version` (the last version pushed, 0:
    none yet)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.connected = False
        self.client: RolloutClient | None = None
        self.senders: list[WeightSender] = []
        self.server_dtypes: list[torch.dtype | None] = []
        self.pushed_step: int | None = None
        self.weight_version = 0

    def _connect(self) -> None:
        args: Any = self.trainer.args
        unsent = settings_servers_cannot_apply(self.trainer.generation_config.to_dict())
        if unsent:  # refused rather than silently dropped
            raise ValueError(
                f"cb_server_urls cannot apply {unsent} (the server samples with {served_names()} only); unset them "
                "or generate in-process."
            )

        def connect() -> None:
            from ..serving.client import RolloutClient
            from ..serving.weight_sync import WeightSender

            timeout = args.cb_generation_timeout or 300.0
            key = args.cb_server_api_key
            self.client = RolloutClient(args.cb_server_urls, api_key=key, timeout=timeout)
            self.senders = [WeightSender(url, key, timeout=timeout) for url in self.client.urls]
            self.server_dtypes = [sender.server_dtype() for sender in self.senders]

        self.on_main(connect)
        self.connected = True

    def on_main(self, work: Callable[[], T]) -> T:
        """`work()` on the main process, its result on every rank; its failure raised on every rank."""
        accelerator = self.trainer.accelerator
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

    def generate(self, prompt_ids: list[list[int]]) -> Completions:
        """This rank's completions of `prompt_ids`; a collective in multi-process training (every rank calls it)."""
        self.sync()
        sampling = self.sampling()
        accelerator = self.trainer.accelerator
        with trl_internals.profiling_context(self.trainer, "trl_cb.remote_generate"):
            if accelerator.num_processes == 1:
                shares = [prompt_ids]
            else:
                from accelerate.utils import gather_object

                shares = gather_object([prompt_ids])  # one list per rank, in rank order

            def generate_all() -> list[Completions]:
                result = self.client.generate([p for share in shares for p in share], 1, **sampling)
                out, start = [], 0
                for share in shares:  # back to each rank, in its own prompts' order
                    end = start + len(share)
                    out.append((result.completion_ids[start:end], result.policy_logprobs[start:end]))  # tensors
                    start = end
                return out

            completion_ids, logprobs = self.on_main(generate_all)[accelerator.process_index]
        return as_lists(completion_ids), logprobs  # TRL decodes and pads the ids as lists

    def sync(self) -> int:
        """Connect, push this step's weights unless pushed already, and return the version the servers now serve.
        A collective."""
        if not self.connected:
            self._connect()
        if self.pushed_step != self.trainer.state.global_step:
            self.push_weights()
        return self.weight_version

    def sampling(self) -> dict[str, Any]:
        """The `/v1/completions` sampling fields of the trainer's generation config (every served setting, `off`
        when the config leaves it unset)."""
        config = self.trainer.generation_config
        served = {s.name: s.wire_value(getattr(config, s.name, None)) for s in SERVED_SAMPLING}
        return {"max_tokens": config.max_new_tokens, **served}

    def push_weights(self) -> int:
        """Push the current weights to every replica as the next version (served once this returns) and return it:
        every rank gathers (a collective when sharded), the main process sends."""
        trainer = self.trainer
        version = self.weight_version + 1
        module = plain_module(trainer.model_wrapped)
        specs, weights = weight_specs(module), iter_weights(module)

        def send() -> None:
            from ..serving.weight_sync import push_weights

            self.client.known_versions.add(version)  # async: tokens of it may arrive before the push ends
            failed = push_weights(self.senders, specs, weights, version, self.server_dtypes)
            self._drop_replicas(failed)

        with trl_internals.profiling_context(trainer, "trl_cb.push_weights"):
            if not trainer.accelerator.is_main_process:
                for _ in weights:  # take part in the gathers
                    pass
            self.on_main(send)
        self.weight_version = version
        self.pushed_step = trainer.state.global_step
        return version

    def async_rollouts(
        self,
        prompt_stream: Iterator[tuple[Any, list[int]]],
        validate: Callable[[list[int]], None],
        groups_per_rank: int,
        bounds: AsyncBounds,
    ) -> ScatteredRemoteRollouts:
        """Async rollouts from the servers (`serving/remote_rollouts.py`) for the async bridge: the main process's
        controller requests every rank's groups; each rank trains on its own share. A collective."""
        if not self.connected:
            self._connect()
        accelerator = self.trainer.accelerator
        controller = None
        if accelerator.is_main_process:
            from ..serving.remote_rollouts import RemoteRolloutController

            groups = groups_per_rank * accelerator.num_processes
            controller = RemoteRolloutController(
                self.client,
                prompt_stream,
                self.trainer.num_generations,
                groups,
                self.sampling(),
                validate,
                **bounds,
            )
        return ScatteredRemoteRollouts(
            controller,
            groups_per_rank,
            push_weights=self.push_weights,
            on_main=self.on_main,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
        )

    def _drop_replicas(self, failed: dict[WeightSender, str]) -> None:
        """Stop using replicas a push did not reach: they serve older weights, so sampling there would be silently
        off-policy (sync) or beyond the recorded versions' meaning. The others take their share."""
        for sender, why in failed.items():
            logger.warning("rollout server %s missed a weight push and is dropped: %s", sender.url, why)
            index = self.senders.index(sender)
            del self.senders[index], self.server_dtypes[index]
            self.client.urls = [url for url in self.client.urls if url != sender.url]

    def close(self) -> None:
        senders, self.senders, self.server_dtypes, self.client = self.senders, [], [], None
        self.connected = False
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
