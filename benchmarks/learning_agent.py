"""The learning benchmark's agent task (`learning.py --task agent`): multi-turn (tool-calling) rollouts, async against
sync on a long-tailed agent task, and prefix reuse across turns.

    python benchmarks/learning.py --task agent                   # both parts, offline, CPU: ~5-8 min on 2 cores
    python benchmarks/learning.py --task agent --part prefix     # turn 2's prefill over a 1,000-token shared prefix
    python benchmarks/learning.py --task agent --part steps --seeds 0 1 2 --steps 16
    python benchmarks/learning.py --task agent --quick           # a smoke test (learns nothing)

`steps` — the agent task (`trl_cb.offline.agent`): a scripted calculator policy calls the tool, then after each answer
calls it again with probability p (`--p-again`, 0.7: rounds per sample are geometric, long-tailed); each call takes a
long-tailed time (`--tool-latency`, lognormal around 40 ms, capped at 0.4 s: an environment's latency). The reward
is 1 for a rollout that answers right after its first tool answer, so learning means lowering p, and the policy is
evaluated exactly from its weights after every step: the probability of a rewarded trajectory (one call, its answer,
the final answer: the product of its model tokens' probabilities) on held-out problems, no sampling noise.
Backends: `sync` (TRL's tool loop: tools run one sample after another, the next turn of all samples together),
`async` (in process: each sample's loop in the producer, tools on worker threads; the tools default, prefetch depth 0),
`overlap` (cb_async_overlap); on request `async_depth0` / `async_depth1` (explicit prefetch depths), and
`--async-config` for any other setting of the async backends. Reported per backend: mean step time (steps 2..N),
samples to the threshold (`--threshold`), and their ratios to sync in the same run; per run, the per-step diagnostics
(`step_logs`: staleness, drift, IS weights, entropy, gradient norm, lengths) and the weights' norms.

`prefix` — a small Qwen2 (8 layers x 256), a 1,000-token first turn, its 16-token completion and a tool answer: the
second turn's request (1 new token) with the first turn's KV blocks reused, against the same request after an epoch
bump (cold: recomputed), alternating, `--passes` times; process CPU seconds and wall seconds per request. Then the
decision after a weight update (relative noise `--update-scale` on every weight): the second turn sampled over the
old weights' blocks ("keep") or recomputed ("recompute", what trl_cb does), each token's logprob against teacher
forcing under the new weights: the per-token log IS ratio error "keep" would add.

Each run (and the prefix part) is written to the JSON and its PNG under `--out` as soon as it ends (`--resume FILE`
completes an interrupted invocation); a table on stdout, the JSON document as the last stdout line.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import plots  # noqa: E402

BACKENDS = {
    "sync": {},
    "async": {"cb_async_generation": True},
    "overlap": {"cb_async_generation": True, "cb_async_overlap": True},
    # explicit prefetch depths (whatever the config's default for tool tasks is)
    "async_depth0": {"cb_async_generation": True, "cb_async_prefetch_depth": 0},
    "async_depth1": {"cb_async_generation": True, "cb_async_prefetch_depth": 1},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="learning.py --task agent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=["steps", "prefix", "all"], default="all")
    p.add_argument("--backends", nargs="+", default=["sync", "async", "overlap"], choices=list(BACKENDS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--p-again", type=float, default=0.7, help="initial chance of another call after a tool answer")
    p.add_argument("--tool-latency", type=float, default=0.04, help="median seconds per tool call (lognormal)")
    p.add_argument("--learning-rate", type=float, default=0.003)
    p.add_argument("--threshold", type=float, default=0.8, help="evaluated reward for samples to threshold")
    p.add_argument("--async-config", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="GRPOConfig fields for the async backends, e.g. cb_importance_sampling_mode=token_m2 (values "
                   "parsed as JSON, else kept as text)")  # fmt: skip
    p.add_argument("--passes", type=int, default=5, help="prefix: measurements per case")
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--update-scale", type=float, nargs="+", default=[1e-3, 1e-2], help="prefix: relative noise")
    args = common.parse(p, argv, "learning_agent")
    if args.worker or args.replot:
        return args
    if args.quick:
        args.seeds, args.steps, args.passes, args.prefix_tokens, args.update_scale = [0], 3, 1, 200, [1e-2]
    return args


# ------------------------------------------------------------------------------------------------ steps part


class SlowCalculator:
    """The calculator with an environment's long-tailed latency (seeded; thread-safe draws)."""

    def __init__(self, median_s: float, seed: int) -> None:
        self.median_s, self.rng, self.lock = median_s, random.Random(seed), threading.Lock()

    def tool(self) -> Any:
        import functools

        from trl_cb.offline.agent import calculator

        @functools.wraps(calculator)  # the same name, signature and docstring: TRL's tool schema
        def slow_calculator(expression: str) -> str:
            with self.lock:
                delay = min(0.4, self.median_s * math.exp(self.rng.gauss(0.0, 1.0)))
            time.sleep(delay)
            return calculator(expression)

        return slow_calculator


#: Per-step metrics kept in each run's record (`step_logs`): what explains a collapse (staleness, the sampler-to-policy
#: drift and the IS weights, entropy, gradient norm, lengths, tool calls, reward).
DIAGNOSTICS = (
    "async/staleness_mean", "async/staleness_max", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max", "sampling/importance_sampling_corrected/token_fraction", "entropy",
    "grad_norm", "completions/mean_length", "completions/max_length", "tools/call_frequency", "reward",
    "frac_reward_zero_std", "step_time",
)  # fmt: skip


def answered_after_one_call(completions: list[list[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """1 for a rollout whose only tool round was the first."""
    return [float(sum(m.get("role") == "tool" for m in c) == 1) for c in completions]


def eval_trajectories(tokenizer: Any, count: int = 8) -> list[tuple[Any, Any]]:
    """Held-out rewarded trajectories, as the policy would sample them: a problem, one calculator call, the tool's
    answer, the final answer; each as token ids and the mask of the model's tokens (the tool turn is the
    environment's)."""
    import torch

    from trl_cb.offline.agent import ANSWER, CALL
    from trl_cb.offline.data import tokenize_prompt

    token = tokenizer.convert_tokens_to_ids
    call = [token(t) for t in ("<tool_call>", CALL, "</tool_call>", "<|end|>")]
    answer = [token(ANSWER), token("<|end|>")]
    out = []
    for i in range(count):
        user = [{"role": "user", "content": f"Ava has {40 + 2 * i} shells and gives half away. How many are left?"}]
        prompt = tokenize_prompt(tokenizer, user)  # as TRL builds a conversational prompt
        tool = tokenizer.encode(f"<|tool|>{20 + i}<|end|><|resume|>", add_special_tokens=False)
        ids = prompt + call + tool + answer
        mask = [0] * len(prompt) + [1] * len(call) + [0] * len(tool) + [1] * len(answer)
        out.append((torch.tensor([ids]), torch.tensor(mask, dtype=torch.bool)))
    return out


def evaluated_reward(model: Any, trajectories: list[tuple[Any, Any]]) -> float:
    """The probability, under the current weights, that the policy produces a rewarded trajectory (one call, then
    the answer), exactly: the product of its model tokens' probabilities, averaged over held-out problems."""
    import torch

    values = []
    with torch.no_grad():
        for ids, mask in trajectories:
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            values.append(logprobs[mask[1:]].sum().exp().item())
    return statistics.fmean(values)


def async_overrides(specs: list[str]) -> dict[str, Any]:
    """`--async-config`'s FIELD=VALUE pairs as config keyword arguments."""
    import json

    out = {}
    for spec in specs:
        name, _, text = spec.partition("=")
        try:
            out[name] = json.loads(text)
        except json.JSONDecodeError:
            out[name] = text
    return out


def weight_norms(model: Any) -> dict[str, float]:
    """Frobenius norms of the layer's output projections (zero in the scripted policy: whatever they write into the
    unit-norm residual stream is what moves every scripted transition's margin at once) and of the LM head."""
    layer = model.model.layers[0]
    return {
        "o_proj": layer.self_attn.o_proj.weight.norm().item(),
        "down_proj": layer.mlp.down_proj.weight.norm().item(),
        "lm_head": model.lm_head.weight.norm().item(),
    }


def train_run(backend: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from trl_cb import GRPOConfig, GRPOTrainer
    from trl_cb.offline.agent import agent_tokenizer, scripted_agent
    from trl_cb.offline.data import synthetic_gsm8k

    tokenizer = agent_tokenizer()
    model = scripted_agent(tokenizer, p_again=args.p_again, margin=12.0)
    trajectories = eval_trajectories(tokenizer)
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in synthetic_gsm8k(64, seed=seed)]
    batch = args.prompts_per_step * args.num_generations
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "agent-run"), per_device_train_batch_size=batch,
        num_generations=args.num_generations, max_completion_length=160, max_tool_calling_iterations=8,
        max_steps=args.steps, logging_steps=1, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        beta=0.0, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, seed=seed,
        use_transformers_continuous_batching=True, **BACKENDS[backend],
        **(async_overrides(args.async_config) if backend != "sync" else {}),
    )  # fmt: skip
    curve = [evaluated_reward(model, trajectories)]
    weights = [weight_norms(model)]

    class Evaluate(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            curve.append(evaluated_reward(model, trajectories))
            weights.append(weight_norms(model))

    torch.manual_seed(seed)
    trainer = GRPOTrainer(
        model=model, reward_funcs=answered_after_one_call, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer, tools=[SlowCalculator(args.tool_latency, seed).tool()], callbacks=[Evaluate()],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [e for e in trainer.state.log_history if "loss" in e]
    steps = [e["step_time"] for e in logs]
    return {
        "backend": backend,
        "seed": seed,
        "wall_s": wall,
        "step_time_s": statistics.fmean(steps[1:] or steps),
        "evaluated_reward": curve,
        "samples_to_threshold": samples_to(curve, args.threshold, batch),
        "tool_calls_per_sample": statistics.fmean(e["tools/call_frequency"] for e in logs),
        "batch_reward": [e["reward"] for e in logs],
        "step_logs": [{k: e[k] for k in DIAGNOSTICS if k in e} for e in logs],
        "weight_norms": weights,
    }


def samples_to(curve: list[float], threshold: float, batch: int) -> float | None:
    """Samples trained on when the evaluated reward first reaches `threshold` (linear between evaluations)."""
    for step in range(1, len(curve)):
        if curve[step] >= threshold:
            before, after = curve[step - 1], curve[step]
            frac = (threshold - before) / (after - before) if after > before else 1.0
            return (step - 1 + frac) * batch
    return None


# ----------------------------------------------------------------------------------------------- prefix part


def prefix_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    from trl_cb import ContinuousBatchingGenerator
    from trl_cb.engine import _upstream_prefix
    from trl_cb.engine.sizing import Workload
    from trl_cb.offline.data import gsm8k_test
    from trl_cb.offline.tiny import small_model, tiny_tokenizer
    from trl_cb.rollouts.inflight_update import paused_for_weight_update
    from trl_cb.rollouts.rollout_groups import InFlightGroups

    tokenizer = tiny_tokenizer()
    model = small_model(tokenizer)
    text = " ".join(r["prompt"] for r in gsm8k_test(200, conversational=False))
    prefix = tokenizer(text)["input_ids"][: args.prefix_tokens]
    config = GenerationConfig(
        do_sample=True, max_new_tokens=16, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    generator = ContinuousBatchingGenerator(model, config)
    length = args.prefix_tokens + 64
    # room for more than the requests in flight: finished turns' blocks stay cached (under memory pressure the engine
    # evicts them, and a turn then prefills cold)
    manager = generator.engine_for(model, Workload(8, length, 16, 2 * length), share_prefixes=True)
    groups = InFlightGroups()
    suffix = tokenizer.encode(" The calculator says 24.")
    try:
        first, _ = finish_turn(groups, manager, prefix, 16, 0)
        second = prefix + first + suffix
        cases: dict[str, list[tuple[float, float]]] = {"reused": [], "cold": []}
        for _ in range(args.passes):
            for case in ("cold", "reused"):
                if case == "cold":  # a new epoch: no cached block matches, the whole prompt is prefilled
                    _upstream_prefix.bump_weight_epoch()
                cpu, wall = time.process_time(), time.perf_counter()
                finish_turn(groups, manager, second, 1, 0)
                cases[case].append((time.process_time() - cpu, time.perf_counter() - wall))
                if case == "cold":  # the "reused" pass needs the first turn's blocks in the current epoch
                    finish_turn(groups, manager, prefix + first, 1, 0)
        ratios = [r[0] / c[0] for r, c in zip(cases["reused"], cases["cold"], strict=True)]
        decisions = []
        for scale in args.update_scale:
            finish_turn(groups, manager, prefix + first, 1, 0)  # the first turn's blocks, current weights
            noise = torch.Generator().manual_seed(3)
            with paused_for_weight_update(manager, groups, 1):
                for param in model.parameters():
                    param.add_(param.abs().mean() * scale * torch.randn(param.shape, generator=noise))
            reference = copy.deepcopy(model)  # the new weights, for teacher forcing off the engine
            gaps = {}
            for decision in ("keep", "recompute"):
                if decision == "recompute":
                    _upstream_prefix.bump_weight_epoch()
                ids, logprobs = finish_turn(groups, manager, second, 16, 1)
                exact = teacher_forced(reference, second, ids)
                gaps[decision] = (exact - logprobs).abs()
            decisions.append({
                "update_scale": scale,
                **{f"{d}_mean_abs_log_ratio": g.mean().item() for d, g in gaps.items()},
                **{f"{d}_max_abs_log_ratio": g.max().item() for d, g in gaps.items()},
            })  # fmt: skip
    finally:
        generator.close()
    return {
        "prefix_tokens": len(prefix),
        "second_turn_tokens": len(second),
        "cpu_s": {k: [c for c, _ in v] for k, v in cases.items()},
        "wall_s": {k: [w for _, w in v] for k, v in cases.items()},
        "cpu_ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "after_update": decisions,
    }


def finish_turn(groups: Any, manager: Any, prompt: list[int], max_new: int, version: int) -> tuple[list[int], Any]:
    """One request on the running engine, to its end: (ids, processed logprobs)."""
    import torch

    from trl_cb.rollouts.rollout_groups import RolloutGroup

    group = RolloutGroup(row=object(), prompt_ids=list(prompt), submitted_version=version)
    groups.submit(manager, group, 1, max_new)
    while not groups.ready:
        groups.wait(manager, 0.05)
        groups.collect(manager)
    done = groups.ready.popleft()
    return list(done.completion_ids[0]), torch.tensor(done.logprobs[0])


def teacher_forced(model: Any, prompt: list[int], ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if common.other_mode(args, None, plots.render_agent):
        return {}

    def summarize_points(points: list[dict[str, Any]]) -> dict[str, Any]:
        """Only the per-backend summary: the runs (keys `("steps", backend, seed)`) and the prefix part (`("prefix",)`)
        are the document's `points` already, so they are not copied beside them."""
        runs = [p for p in points if p["key"][0] == "steps"]
        done = [b for b in args.backends if any(r["backend"] == b for r in runs)]
        return {"summary": summarize(runs, done) if runs else []}

    results = common.ResultFile("learning_agent", args, summarize_points, plots.render_agent)
    print(f"results are written to {results.path} as they are measured", flush=True)
    if args.part in ("prefix", "all") and not results.has(("prefix",)):
        prefix = prefix_part(args)
        results.add(("prefix",), prefix)
        print(f"prefix reuse: turn 2 ({prefix['second_turn_tokens']} tokens, {prefix['prefix_tokens']} shared) costs "
              f"{prefix['cpu_ratio']['median']:.3f}x a cold prefill's CPU time (min {prefix['cpu_ratio']['min']:.3f}, "
              f"max {prefix['cpu_ratio']['max']:.3f})")  # fmt: skip
        for d in prefix["after_update"]:
            print(f"  update x{d['update_scale']}: keep -> mean|log ratio| {d['keep_mean_abs_log_ratio']:.2e} "
                  f"(max {d['keep_max_abs_log_ratio']:.2e}); recompute -> {d['recompute_mean_abs_log_ratio']:.2e} "
                  f"(max {d['recompute_max_abs_log_ratio']:.2e})")  # fmt: skip
    if args.part in ("steps", "all"):
        for seed in args.seeds:
            for backend in args.backends:
                if not results.has(("steps", backend, seed)):
                    results.add(("steps", backend, seed), train_run(backend, seed, args))
        summary = results.payload()["summary"]
        columns = [("backend", "backend"), ("step_time_s", "step s"), ("step_ratio", "x sync"),
                   ("samples_to_threshold", "samples to threshold"), ("samples_ratio", "x sync"),
                   ("tool_calls_per_sample", "calls/sample")]  # fmt: skip
        print(common.format_table(summary, columns))
    return results.finish()


def summarize(runs: list[dict[str, Any]], backends: list[str]) -> list[dict[str, Any]]:
    out = []
    for backend in backends:
        mine = [r for r in runs if r["backend"] == backend]
        reached = [r["samples_to_threshold"] for r in mine if r["samples_to_threshold"] is not None]
        out.append({
            "backend": backend,
            "step_time_s": statistics.fmean(r["step_time_s"] for r in mine),
            "step_times_s": [r["step_time_s"] for r in mine],
            "samples_to_threshold": statistics.fmean(reached) if len(reached) == len(mine) else None,
            "tool_calls_per_sample": statistics.fmean(r["tool_calls_per_sample"] for r in mine),
        })  # fmt: skip
    sync = next((s for s in out if s["backend"] == "sync"), out[0])
    for s in out:
        s["step_ratio"] = s["step_time_s"] / sync["step_time_s"]
        both = s["samples_to_threshold"] is not None and sync["samples_to_threshold"]
        s["samples_ratio"] = s["samples_to_threshold"] / sync["samples_to_threshold"] if both else None
    return out
