"""Evaluation of the current policy for `benchmarks/learning.py`, and its training clock.

Why: the reward of the batch a step trains on measures the policy that *sampled* it; in async mode that policy is one
or two updates old, so a training-reward curve lags by construction. AReaL, PipelineRL and verl report instead the
reward of the current weights on held-out prompts against wall-clock. `PolicyEval` does that the same way for every
backend: plain `model.generate()` on the trainer's own (local) model, the training sampling settings, fresh samples,
a seed per evaluation point that every backend shares (the evaluation noise is common to all curves).

Guarantees:
- The evaluation never changes training: `torch.no_grad()`, the model's train/eval mode restored, and the RNG
  forked (`torch.random.fork_rng`), so a run's training samples are the same with or without evaluation.
- Safe with async backends. The in-process engine runs the shared module only inside the trainer's `take`; at
  `on_step_end` it is held (`trl_cb/rollouts/engine_hold.py`): paused, the module back on its training tensors and
  mode. A rollout server would keep generating while the trainer evaluates (a head start the excluded seconds would
  hide), so it is paused over HTTP (`/pause`, `/resume`) for the duration.
- `Curve`'s wall-clock and CPU time exclude every second spent evaluating (a running total, subtracted); the total is
  reported per run.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import common  # a sibling module: the importer (learning.py, the tests) has put benchmarks/ on sys.path
from transformers import TrainerCallback

#: Completion-length percentiles recorded per training step and per evaluation.
PERCENTILES = (10, 50, 90)


def length_percentiles(lengths: list[int]) -> dict[str, float]:
    """Nearest-rank p10/p50/p90 of completion lengths (tokens), as every benchmark ranks them (`common.percentile`)."""
    return {f"p{q}": common.percentile(lengths, q) for q in PERCENTILES}


class LengthRecorder:
    """Wraps a TRL reward function to record each training batch's completion lengths (TRL passes
    `completion_ids`); the reward is unchanged and keeps its name (TRL logs `rewards/<name>/mean`)."""

    def __init__(self, reward: Callable[..., list[float]]) -> None:
        self.reward = reward
        self.batches: list[list[int]] = []
        self.__name__ = reward.__name__

    def __call__(self, *args: Any, completion_ids: list[list[int]] | None = None, **kwargs: Any) -> list[float]:
        if completion_ids is not None:
            self.batches.append([len(c) for c in completion_ids])
        return self.reward(*args, completion_ids=completion_ids, **kwargs)


@contextlib.contextmanager
def paused_servers(urls: list[str], timeout: float = 30.0) -> Iterator[None]:
    """Pause rollout servers' engines (`POST /pause`) for the block, then resume them."""

    def post(url: str, route: str) -> None:
        request = urllib.request.Request(url.rstrip("/") + route, data=b"{}", method="POST")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()

    for url in urls:
        post(url, "/pause")
    try:
        yield
    finally:
        for url in urls:
            post(url, "/resume")


class PolicyEval:
    """Mean reward of `samples` fresh completions per held-out prompt, sampled from the current weights.

    Args:
        prompts: Token ids of the held-out prompts (as TRL tokenizes them: chat template, generation prompt).
        columns: Extra dataset columns the reward needs, one value per prompt (e.g. GSM8K `answer`).
        conversational: Completions are handed to the reward as chat messages (TRL does so for chat prompts).
        sampling: TRL's sampling fields: temperature, top_p, top_k, min_p, repetition_penalty,
            max_completion_length.
        seed: Base seed; evaluation point `step` samples with `seed + step` (the same for every backend).
        pause: Context manager factory around each evaluation (rollout servers: paused).
    """

    def __init__(
        self,
        prompts: list[list[int]],
        columns: dict[str, list[Any]],
        reward: Callable[..., list[float]],
        tokenizer: Any,
        conversational: bool,
        sampling: dict[str, Any],
        samples: int,
        seed: int,
        pause: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        from transformers import GenerationConfig

        self.prompts, self.columns, self.reward = prompts, columns, reward
        self.tokenizer, self.conversational, self.samples, self.seed, self.pause = (
            tokenizer, conversational, samples, seed, pause,
        )  # fmt: skip
        self.eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.pad = pad
        self.config = GenerationConfig(
            max_new_tokens=sampling["max_completion_length"], do_sample=True, pad_token_id=pad,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=self.eos, temperature=sampling["temperature"],
            top_p=sampling["top_p"], top_k=sampling["top_k"], min_p=sampling["min_p"],
            repetition_penalty=sampling["repetition_penalty"], use_cache=True, disable_compile=True,
        )  # fmt: skip

    def __call__(self, model: Any, step: int) -> dict[str, Any]:
        """Evaluate `model` (the trainer's unwrapped module) at optimizer step `step`."""
        import torch

        devices = [model.device] if model.device.type == "cuda" else []
        training = model.training
        with self.pause(), torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(self.seed + step)
            model.eval()
            try:
                completions = self._sample(model)  # (P * S) completion token lists, EOS included
            finally:
                model.train(training)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        shown: list[Any] = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        repeat = [i for i in range(len(self.prompts)) for _ in range(self.samples)]
        kwargs = {name: [values[i] for i in repeat] for name, values in self.columns.items()}
        rewards = self.reward(prompts=[None] * len(repeat), completions=shown, completion_ids=completions, **kwargs)
        lengths = [len(c) for c in completions]
        return {
            "step": step,
            "reward": sum(rewards) / len(rewards),
            "length_mean": sum(lengths) / len(lengths),
            **{f"length_{k}": v for k, v in length_percentiles(lengths).items()},
        }

    def _sample(self, model: Any) -> list[list[int]]:
        import torch

        width = max(len(p) for p in self.prompts)
        ids = torch.full((len(self.prompts), width), self.pad, dtype=torch.long)  # (P, W), left-padded
        mask = torch.zeros_like(ids)
        for i, p in enumerate(self.prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids = ids.repeat_interleave(self.samples, dim=0).to(model.device)  # (P * S, W)
        mask = mask.repeat_interleave(self.samples, dim=0).to(model.device)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=self.config)
        completions = []
        for row in out[:, width:].tolist():  # (P * S, <= max_new_tokens)
            end = row.index(self.eos) + 1 if self.eos in row else len(row)
            completions.append(row[:end])
        return completions


class Curve(TrainerCallback):
    """Training wall-clock and process CPU time (all threads) at every optimizer step from the start of `train()`,
    with the evaluation's seconds subtracted; evaluates at step 0 (before training), every `every` steps and at the
    last step.

    CPU time is recorded because a shared machine stretches wall-clock: with one torch thread (`OMP_NUM_THREADS=1`)
    the CPU seconds are close to what a quiet machine's wall-clock would be.
    """

    def __init__(self, evaluate: Callable[[int], dict[str, Any]] | None, every: int) -> None:
        self.evaluate, self.every = evaluate, every
        self.start = self.cpu_start = 0.0
        self.eval_s = self.eval_cpu_s = 0.0  # running totals, excluded from the clocks
        self.step_end: list[float] = []
        self.cpu_end: list[float] = []
        self.evals: list[dict[str, Any]] = []

    def on_train_begin(self, *a: Any, **k: Any) -> None:
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self._evaluate(0)

    def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> None:
        self.step_end.append(time.perf_counter() - self.start - self.eval_s)
        self.cpu_end.append(time.process_time() - self.cpu_start - self.eval_cpu_s)
        step = state.global_step
        if step % self.every == 0 or step == state.max_steps:
            self._evaluate(step)

    def _evaluate(self, step: int) -> None:
        if self.evaluate is None:
            return
        t0, c0 = time.perf_counter(), time.process_time()
        result = self.evaluate(step)
        seconds = time.perf_counter() - t0
        self.eval_s += seconds
        self.eval_cpu_s += time.process_time() - c0
        result["seconds"] = seconds
        result["wall_clock_s"] = self.step_end[-1] if step else 0.0  # training seconds before this point
        self.evals.append(result)
