"""TRL's tool loop one sample at a time, for async multi-turn rollouts (`rollouts/multi_turn.py`), and the replay of
finished groups into TRL's scoring.

Why per sample: TRL 1.16's `GRPOTrainer._tool_call_loop` runs every sample's tools, then the next turn of all of them,
so a batch waits for its slowest tool and longest turn. Here each sample's `ToolConversation` runs the same steps on a
worker thread while others generate. TRL's semantics, kept (tests/parity/test_tools.py compares): turns parsed with
`parse_response`; calls in order, sync tools then async ones on TRL's event loop; an exception, unknown tool or
unsupported call type (or a call past `cb_async_tool_timeout`) answers `{"error": ...}`, counted as a failure; results
appended as `_get_tool_suffix_ids` renders them, dropped (the sample ends) if they would pass `max_completion_length`
or the model's positions; at most `max_tool_calling_iterations` rounds; environments pooled, reset per sample with its
row, their first observation joined to the prompt.

Replay: TRL's scoring of the taken groups draws environments from its pool and resets them; it is handed the groups'
own instances, whose `reset` answers the recorded observation, so TRL builds the rolled-out prompts and `get_reward`
reads the state the rollout left.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

from ..rollouts.multi_turn import Conversation
from ..rollouts.rollout_groups import RolloutGroup
from . import trl_internals

__all__ = ["ToolConversation", "ToolTurns", "first_turns", "replay_environments", "tool_loop_results"]

#: A prompt with no `prompt` column (an environment owns the data): TRL's default.
_EMPTY_PROMPT = [{"role": "user", "content": ""}]


class ToolTurns:
    """One trainer's tools, environments and rendering, for opening `ToolConversation`s (`open`, the producer's
    `OpenConversation`). Thread-safe: conversations open on several worker threads at once."""

    def __init__(self, trainer: Any, timeout: float | None) -> None:
        self.trainer = trainer
        self.timeout = timeout
        self.tokenizer = trainer.processing_class
        self.factories: dict[Any, Any] | None = trainer.environment_factories
        self.max_completion_length = int(trainer.max_completion_length)
        self.max_model_len = int(trainer.model.config.max_position_embeddings)
        self.free_environments: dict[Any, list[Any]] = {}
        self.lock = threading.Lock()
        self.call_pool: concurrent.futures.ThreadPoolExecutor | None = None
        if timeout is not None:  # a call that may overrun runs on its own thread, waited for at most `timeout`
            self.call_pool = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="trl_cb-tool-call")

    def environment_name(self, row: dict[str, Any]) -> Any:
        return row.get("environment") if trl_internals.multi_environment(self.trainer) else None

    def prompt_of(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return row.get("prompt", _EMPTY_PROMPT) if self.factories is not None else row["prompt"]

    def render(self, prompt: list[dict[str, Any]], environment: Any = None) -> list[int]:
        """The prompt's ids as TRL renders it for generation: the chat template with the tools this sample may call
        (`ValueError` for a dataset without conversational prompts: tools need a chat)."""
        if not isinstance(prompt, list):
            raise ValueError("async tool calling needs conversational prompts (lists of messages)")
        tools = trl_internals.tools_for(self.trainer, environment)
        return trl_internals.render_prompt(self.trainer, prompt, tools)

    def open(self, row: dict[str, Any], index: int, prompt_ids: list[int]) -> ToolConversation:
        """Sample `index` of `row`'s group: its environment (drawn from the pool and reset with the row, as TRL does)
        and its prompt (the environment's observation joined to the last message, as TRL does)."""
        name, environment, observation = self.environment_name(row), None, None
        prompt = self.prompt_of(row)
        if self.factories is not None:
            environment = self.environment_for(name)
            kwargs = {k: v for k, v in row.items() if k != "environment"} if name is not None else row
            observation = environment.reset(**kwargs)
            if observation is not None:
                prompt = _with_observation(prompt, observation)
                prompt_ids = self.render(prompt, name)
        return ToolConversation(self, row, name, environment, observation, prompt, prompt_ids)

    def release(self, conversations: list[ToolConversation]) -> None:
        """Give the scored conversations' environments back to the pool."""
        with self.lock:
            for conversation in conversations:
                if conversation.environment is not None:
                    self.free_environments.setdefault(conversation.environment_name, []).append(
                        conversation.environment
                    )

    def close(self) -> None:
        if self.call_pool is not None:
            self.call_pool.shutdown(wait=False, cancel_futures=True)

    def environment_for(self, name: Any) -> Any:
        with self.lock:
            free = self.free_environments.get(name)
            if free:
                return free.pop()
        return self.factories[name]()  # constructed once, reset per sample (TRL's pool)

    def call(self, function: Any, arguments: dict[str, Any]) -> Any:
        """One sync tool call (on its own thread with a timeout, when one is set)."""
        if self.call_pool is None:
            return function(**arguments)
        try:
            return self.call_pool.submit(function, **arguments).result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"tool call timed out after {self.timeout} s") from None

    def gather(self, coroutines: list[Any]) -> list[Any]:
        """Async tool calls, together, on the trainer's event loop (TRL's), results or exceptions in order."""

        async def together() -> list[Any]:
            calls = [asyncio.wait_for(c, self.timeout) if self.timeout is not None else c for c in coroutines]
            return await asyncio.gather(*calls, return_exceptions=True)

        loop = trl_internals.async_loop(self.trainer)
        results = asyncio.run_coroutine_threadsafe(together(), loop).result()
        return [TimeoutError(f"tool call timed out after {self.timeout} s") if isinstance(r, asyncio.TimeoutError)
                else r for r in results]  # fmt: skip


class ToolConversation(Conversation):
    """One sample's tool loop (see the module docstring); `completions` is TRL's per-sample message list."""

    def __init__(
        self,
        turns: ToolTurns,
        row: dict[str, Any],
        environment_name: Any,
        environment: Any,
        observation: Any,
        prompt: list[dict[str, Any]],
        prompt_ids: list[int],
    ) -> None:
        self.turns, self.row = turns, row
        self.environment_name, self.environment, self.observation = environment_name, environment, observation
        self.prompt, self.prompt_ids = prompt, list(prompt_ids)
        self.completions: list[dict[str, Any]] = []
        self.tool_calls = self.tool_failures = self.rounds = 0
        self.first_turn: list[int] | None = None
        self.tools = trl_internals.tools_for(turns.trainer, environment_name)
        self.sync_tools, self.async_tools = trl_internals.tool_functions(turns.trainer, environment)

    def after_turn(self, context: list[int], turn_ids: list[int]) -> list[int] | None:
        first = self.first_turn is None
        if first:
            self.first_turn = list(turn_ids)
        message = self.parsed(context, turn_ids) if (turn_ids or first) else {}
        if message:
            self.completions.append(message)
        tool_calls = message.get("tool_calls")
        if not tool_calls or self.rounds >= trl_internals.max_tool_rounds(self.turns.trainer):
            return None
        tool_messages = self.run_calls(tool_calls)
        self.completions += tool_messages
        suffix = trl_internals.tool_suffix_ids(self.turns.trainer, tool_messages)
        total = len(context) + len(turn_ids) + len(suffix)
        if total - len(self.prompt_ids) > self.turns.max_completion_length or total >= self.turns.max_model_len:
            del self.completions[-len(tool_messages) :]  # TRL drops the results that do not fit; the sample ends
            return None
        self.rounds += 1
        return list(suffix)

    def parsed(self, context: list[int], turn_ids: list[int]) -> dict[str, Any]:
        return trl_internals.parse_turn(self.turns.tokenizer, turn_ids, context, self.tools)

    def run_calls(self, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every call of one turn, as TRL runs them (sync ones in order, then the async ones together)."""
        results, pending = [], []
        for call in tool_calls:
            self.tool_calls += 1
            if call.get("type") != "function":
                self.tool_failures += 1
                results.append((call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call['type']}"}))
                continue
            name, arguments = call["function"]["name"], call["function"].get("arguments", {})
            try:
                if name in self.sync_tools:
                    results.append((name, self.turns.call(self.sync_tools[name], arguments)))
                elif name in self.async_tools:
                    pending.append((name, self.async_tools[name](**arguments)))
                else:
                    raise ValueError(f"Tool {name} not found.")
            except Exception as exc:
                self.tool_failures += 1
                results.append((name, {"error": str(exc)}))
        if pending:
            for (name, _), result in zip(pending, self.turns.gather([c for _, c in pending]), strict=True):
                failed = isinstance(result, BaseException)
                self.tool_failures += failed
                results.append((name, {"error": str(result)} if failed else result))
        return [
            {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
            for name, result in results
        ]


def _with_observation(prompt: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """The prompt with an environment's first observation joined to its last message's content (TRL's rule)."""
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


@contextlib.contextmanager
def replay_environments(trainer: Any, groups: list[RolloutGroup], num_generations: int) -> Iterator[None]:
    """Inside the block, TRL's scoring of `groups` draws their own environment instances (in batch order) and their
    `reset` answers the observation recorded at rollout time; afterwards TRL's pool and the instances are as before."""
    conversations = [c for group in groups for c in group.conversations or []]
    environments = [c for c in conversations if c.environment is not None]
    if not environments:
        yield
        return
    for conversation in environments:  # an instance attribute shadows the class's `reset`, type unchanged
        conversation.environment.reset = lambda *a, _seen=conversation.observation, **k: copy.deepcopy(_seen)
    try:
        with trl_internals.environment_pool(trainer, [(c.environment_name, c.environment) for c in environments]):
            yield
    finally:
        for conversation in environments:
            del conversation.environment.reset


def tool_loop_results(groups: list[RolloutGroup]) -> tuple[Any, ...]:
    """What TRL's `_tool_call_loop` returns, from the taken groups' finished conversations: `(tool_mask, completions,
    completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images)`."""
    conversations = [c for group in groups for c in group.conversations]
    tool_mask = [list(mask) for group in groups for mask in group.tool_masks]
    completion_ids = [list(ids) for group in groups for ids in group.completion_ids]
    logprobs = [list(lp) for group in groups for lp in group.policy_logprobs]
    completions = [list(c.completions) for c in conversations]
    calls = sum(c.tool_calls for c in conversations)
    failures = sum(c.tool_failures for c in conversations)
    return tool_mask, completions, completion_ids, logprobs, calls, failures, [[] for _ in conversations]


def first_turns(groups: list[RolloutGroup], prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """What TRL's first generation call gets in a multi-turn scoring: each sample's first turn and its logprobs
    (`RuntimeError` unless TRL rendered exactly the prompts the samples were generated from)."""
    conversations = [c for group in groups for c in group.conversations]
    if [list(p) for p in prompt_ids] != [c.prompt_ids for c in conversations]:
        raise RuntimeError("Async rollouts are out of step with the prompts TRL tokenized (an environment's reset?).")
    firsts = [list(c.first_turn or []) for c in conversations]
    rows = [row for group in groups for row in group.policy_logprobs]
    return firsts, [list(row[: len(first)]) for row, first in zip(rows, firsts, strict=True)]
