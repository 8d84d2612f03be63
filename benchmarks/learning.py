"""Learning benchmark: does RL through trl_cb learn, and how fast against wall-clock? GRPO and RLOO; the reward of the
*current policy* on held-out prompts against training wall-clock and samples, for plain `generate()`, trl_cb sync and
async (in process or on a rollout server), several seeds each, and several configurations of the async backends.

    pip install -e . && python benchmarks/learning.py     # offline default: tiny Qwen2, CPU, 30 runs of ~20 s each
    python benchmarks/learning.py --quick                 # ~4 min, each backend once: a smoke test (learns nothing)
    python benchmarks/learning.py --trainers grpo --seeds 0 1 2 3 4 --steps 60
    # staleness sweep: async at depth 0..7 (staleness <= 1, 2, 4, 8), against sync and generate():
    python benchmarks/learning.py --backends generate trl_cb trl_cb_async --staleness-sweep 1 2 4 8
    # IS modes and bounds on the async backend (a variant per combination):
    python benchmarks/learning.py --trainers grpo --backends trl_cb trl_cb_async --prefetch-depth 3 \\
        --is-mode sequence_mask sequence_truncate token_truncate --is-clip-max 2 3
    python benchmarks/learning.py --variants depth=0 depth=3,keep_stale=1,max_staleness=4   # explicit variants
    python benchmarks/learning.py --task longtail         # long-tailed completion lengths (EOS-biased, <= 96 tokens)
    python benchmarks/learning.py --task agent            # multi-turn tool calls, async vs sync, prefix reuse
    python benchmarks/learning.py --replot runs/benchmarks/learning-YYYYmmdd-HHMMSS.json  # redraw the PNG
    # a real model, GSM8K accuracy as the reward (needs the hub and, to be practical, a GPU):
    python benchmarks/learning.py --model Qwen/Qwen2.5-0.5B-Instruct --reward gsm8k --device cuda \\
        --data-file gsm8k/train.jsonl --max-completion-length 256 --num-generations 8 --prompts-per-step 16 \\
        --learning-rate 1e-6 --steps 200 --threshold 0.5

Task (default): prompts are GSM8K test problems (shipped with trl_cb, chat-formatted); the reward is the share of one
character (`--char`, default "a") in the completion's text, dividing by at least `--min-chars` characters so that
stopping early never pays (`offline.data.char_share_reward`, also the offline recipes' reward). The tiny random model
(no EOS bias: completions run to the 24-token cap) starts near 0.04 and reaches 0.5-0.7 in 40 steps of 2 prompts x 8
samples at a constant learning rate of 5e-3 on every backend, so the benchmark finishes offline, while the curve
still depends on everything that matters for RL correctness: sampling, logprobs, IS correction, partial rollouts,
staleness. (With the throughput benchmarks' EOS bias of 4.0, or at lr 1e-2, one large update can teach the random
model to stop at once; all-empty groups carry no gradient and such a run never recovers, whatever the backend.)
`--task longtail`: the same reward on the tiny model with an EOS logit bias (`TASKS`), so completion lengths stay
spread (near-geometric, p90/p10 >= 3) while the reward rises: the case where async partial rollouts matter.

What is measured (docs/benchmark-log.md, "Learning: method"):
- **Evaluation reward** (the headline): at step 0 (before training), every `--eval-every` optimizer steps and at the
  end, the trainer's current weights sample `--eval-samples` fresh completions for each of `--eval-prompts` held-out
  prompts (disjoint from the training prompts, same source) with plain `model.generate()` and the training sampling
  settings; the seed of an evaluation point is the same on every backend (`learning_eval.py`). Time and samples to
  the threshold, seed-band shares and the plot's main panels use it.
- **Training wall-clock**: since `train()` began (engine start-up included), evaluation seconds excluded (reported).
- The **training-batch reward** (what TRL logs), plotted against the policy version that sampled the batch (step -
  its mean staleness), every `async/*` and `sampling/*` log key, and completion-length p10/p50/p90 per step.

Backends, each (trainer, backend, seed[, variant]) in its own subprocess with the same seed, data and hyper-parameters:
- `generate`:     TRL's trainer, `use_transformers_continuous_batching=False` (left-padded `model.generate`).
- `trl_cb`:       trl_cb's trainer with the flag on (persistent engine, IS-corrected loss).
- `trl_cb_async`: the same with `cb_async_generation=True` (engine fed ahead of the trainer, bounded staleness).
- `trl_cb_overlap_async`: the same with `cb_async_overlap=True`: the engine also generates during the trainer's forward
                  and backward, on a view of the same weights, pausing for optimizer steps (and for evaluations).
- `trl_cb_server`: trl_cb's trainer on a local `trl-cb serve` replica the worker starts (`cb_server_urls`; sync:
                  weights pushed before each step's generation). The cores are split: the server gets
                  `--server-threads` (default 1), the trainer the rest (at least 1).
- `trl_cb_server_async`: the same with `cb_async_generation=True`: the server generates while the trainer trains.
The async backends run once per variant (`learning_variants.py`: `--prefetch-depth`, `--max-staleness`,
`--keep-stale`, `--is-mode`, `--is-clip-min`, `--is-clip-max` as a grid, `--staleness-sweep`, or `--variants`); each
is a curve labelled with its settings. The sync backends run once. Without a depth flag every async backend runs at
its config's default depth: 1, and 0 for `trl_cb_overlap_async`.

On a shared machine, run with `OMP_NUM_THREADS=1`: two torch threads per process spin against other load and
stretch wall-clock unevenly. The JSON also records process CPU seconds per step, which a loaded machine disturbs less.
Every run is written to the JSON (and PNG) under `--out` as soon as it ends (`--resume FILE` completes an interrupted
invocation); tables on stdout at the end, and the JSON document as the last stdout line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import learning_variants as variants  # noqa: E402
import plots  # noqa: E402

from trl_cb.offline.data import GSM8K_TEST_SIZE  # noqa: E402

BACKENDS = ("generate", "trl_cb", "trl_cb_async", "trl_cb_overlap_async", "trl_cb_server", "trl_cb_server_async")
#: Rollouts from a local `trl-cb serve` replica the worker starts (`--server-threads`; the trainer gets the rest).
SERVER_BACKENDS = ("trl_cb_server", "trl_cb_server_async")
ASYNC_BACKENDS = ("trl_cb_async", "trl_cb_overlap_async", "trl_cb_server_async")
#: The sync reference every curve is compared with (ratios, seed band), and the second one (band only).
REFERENCE, BASELINE = "trl_cb", "generate"
TRAINERS = ("grpo", "rloo")
REWARDS = ("char", "gsm8k")
#: Task presets: the values of the flags left unset. `longtail`: the tiny model with an EOS bias (lengths
#: near-geometric, p10/p50/p90 3/29/85 tokens untrained) and room for the tail; only the output projection learns
#: (`steady_eos`), at a higher learning rate to make up for it.
TASKS: dict[str, dict[str, Any]] = {
    "default": {"eos_logit_bias": None, "max_completion_length": 24, "learning_rate": 5e-3},
    "longtail": {"eos_logit_bias": 4.0, "max_completion_length": 96, "learning_rate": 2e-2, "steady_eos": True},
}


def curve_name(backend: str, variant: str | None) -> str:
    """A curve's name: the backend, and for async backends the variant's spec (`trl_cb_async depth=1`)."""
    return backend if variant is None else f"{backend} {variant}"


# ------------------------------------------------------------------------------------------------------ worker


def _model_and_tokenizer(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The run's model: `common.load_model` (the same build as the throughput benchmarks': the tiny preset from seed
    0 with the task's EOS bias, or a hub id / path), then `steady_eos` where the task asks for it."""
    model, tokenizer = common.load_model(
        spec["model"], spec["device"], spec["dtype"], eos_logit_bias=spec["eos_logit_bias"]
    )
    if spec["model"] == "tiny" and TASKS[spec.get("task", "default")].get("steady_eos"):
        steady_eos(model, tokenizer.eos_token_id)
    return model, tokenizer


def steady_eos(model: Any, eos_id: int) -> None:
    """Train only the output projection, EOS row excluded, so completion lengths stay spread while the reward rises.

    Why: `bias_eos` gives EOS a long output row (19x the others' norm on the tiny model), so any change of the final
    hidden state's direction swings the EOS logit: with every weight trained, one update sends all lengths to 1 token
    or to the cap (measured at lr 5e-3, and at 3e-4 p90 fell from 96 to 9 tokens in three steps). With the trunk
    frozen and the EOS row's gradient zeroed, the share of the character is learnt in the other output rows, and EOS
    only loses the mass those rows gain. Applied in the worker to every backend alike (a server gets the same weights
    from the trainer's pushes)."""
    model.model.requires_grad_(False)

    def keep_eos_row(grad: Any) -> Any:
        grad = grad.clone()
        grad[eos_id] = 0
        return grad

    model.lm_head.weight.register_hook(keep_eos_row)


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """One (trainer, backend, seed, variant) training run; returns its per-step and evaluation curves."""
    import torch
    import trl
    from learning_eval import paused_servers

    import trl_cb

    kind, backend = spec["trainer"], spec["backend"]
    package = trl_cb if backend.startswith("trl_cb") else trl
    config_cls = package.GRPOConfig if kind == "grpo" else package.RLOOConfig
    trainer_cls = package.GRPOTrainer if kind == "grpo" else package.RLOOTrainer
    extra: dict[str, Any] = {}
    if backend != "generate":
        extra["use_transformers_continuous_batching"] = True
    if backend in ASYNC_BACKENDS:
        extra.update(cb_async_generation=True, **variants.config_overrides(spec["variant"]))
    if backend == "trl_cb_overlap_async":
        extra["cb_async_overlap"] = True
    model, tokenizer = _model_and_tokenizer(spec)
    pause: Any = contextlib.nullcontext
    with contextlib.ExitStack() as stack:
        if backend in SERVER_BACKENDS:
            device = spec.get("server_device") or spec["device"]
            served = common.served_model(model, tokenizer, spec["server_threads"], device, spec["dtype"])
            url = stack.enter_context(served)
            extra["cb_server_urls"] = [url]
            torch.set_num_threads(max(1, (os.cpu_count() or 1) - spec["server_threads"]))
            if backend in ASYNC_BACKENDS:  # it would generate ahead while the trainer evaluates

                def pause() -> Any:
                    return paused_servers([url])

        return _train(spec, config_cls, trainer_cls, model, tokenizer, extra, pause)


def _overlap_engine_paused(trainer: Any) -> contextlib.AbstractContextManager[None]:
    """The overlap engine held between two steps (`OverlapEngineBackend.paused`); none before the first rollouts."""
    controller = trainer.rollouts.async_rollouts.source
    return controller.backend.paused() if controller is not None else contextlib.nullcontext()


def _datasets(spec: dict[str, Any], chat: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, held-out evaluation records): disjoint slices of the same source and order."""
    from trl_cb.offline.data import gsm8k_test, load_gsm8k_jsonl

    n, m = spec["num_prompts"], spec["eval_prompts"]
    if spec["data_file"]:
        records = load_gsm8k_jsonl(spec["data_file"], limit=n + m, conversational=chat)
    else:
        records = gsm8k_test(min(n + m, GSM8K_TEST_SIZE), seed=spec["data_seed"], conversational=chat)
    if len(records) < n + m:
        raise ValueError(f"{len(records)} prompts for --num-prompts {n} + --eval-prompts {m}")
    return records[:n], records[n : n + m]


def _train(
    spec: dict[str, Any],
    config_cls: Any,
    trainer_cls: Any,
    model: Any,
    tokenizer: Any,
    extra: dict[str, Any],
    pause: Any,
) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from learning_eval import Curve, LengthRecorder, PolicyEval, length_percentiles
    from transformers import PrinterCallback

    from trl_cb.offline.data import char_share_reward, gsm8k_reward, tokenize_prompt

    kind, backend, cpu = spec["trainer"], spec["backend"], spec["device"] == "cpu"
    args = config_cls(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["prompts_per_step"] * spec["num_generations"],
        num_generations=spec["num_generations"], max_completion_length=spec["max_completion_length"],
        max_steps=spec["steps"], learning_rate=spec["learning_rate"], lr_scheduler_type="constant", beta=0.0,
        temperature=spec["temperature"], top_p=spec["top_p"], top_k=spec["top_k"], min_p=spec["min_p"],
        repetition_penalty=spec["repetition_penalty"], bf16=not cpu and spec["dtype"] == "bfloat16", use_cpu=cpu,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=spec["seed"],
        data_seed=spec["seed"], **extra,
    )  # fmt: skip
    chat = tokenizer.chat_template is not None  # chat-formatted prompts unless the model has no template
    train_records, eval_records = _datasets(spec, chat)
    score = gsm8k_reward if spec["reward"] == "gsm8k" else char_share_reward(spec["char"], spec["min_chars"])
    reward = LengthRecorder(score)

    evaluate = PolicyEval(
        prompts=[tokenize_prompt(tokenizer, r["prompt"]) for r in eval_records],
        columns={k: [r[k] for r in eval_records] for k in eval_records[0] if k != "prompt"},
        reward=score, tokenizer=tokenizer, conversational=chat, samples=spec["eval_samples"], seed=spec["eval_seed"],
        sampling={k: spec[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                       "max_completion_length")},
        pause=pause,
    )  # fmt: skip
    holder: dict[str, Any] = {}
    curve = Curve(lambda step: evaluate(holder["unwrap"](), step), spec["eval_every"])
    trainer = trainer_cls(
        model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(train_records),
        processing_class=tokenizer, callbacks=[curve],
    )  # fmt: skip
    holder["unwrap"] = lambda: trainer.accelerator.unwrap_model(trainer.model)  # the local model, for every backend
    if backend == "trl_cb_overlap_async":  # the engine runs between steps too: evaluation time is not generation time
        evaluate.pause = lambda: _overlap_engine_paused(trainer)
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts would bury the progress bar
    # The trainer's wait for rollouts each step: the generation call (sync backends) or the wait for finished groups
    # (async). The rest of a step is scoring, the IS / old-logprob forward, backward and the optimizer step.
    if backend in ASYNC_BACKENDS:
        waits = common.record_call_times(trainer.rollouts.async_rollouts, "take")
    else:
        waits = common.record_call_times(trainer, "_generate_single_turn")
    trainer.train()
    logs = [e for e in trainer.state.log_history if "reward" in e and "step" in e]
    steps = len(curve.step_end)
    if len(logs) != steps or len(reward.batches) != steps:
        raise RuntimeError(f"{len(logs)} reward logs, {len(reward.batches)} scored batches for {steps} steps")
    per_step = spec["prompts_per_step"] * spec["num_generations"]

    def series(name: str) -> list[float | None] | None:
        values = [e.get(name) for e in logs]
        return None if all(v is None for v in values) else [None if v is None else float(v) for v in values]

    def group(prefix: str) -> dict[str, list[float | None]]:
        names = sorted({k for e in logs for k in e if k.startswith(prefix)})
        return {name[len(prefix) :]: series(name) or [] for name in names}

    is_async = backend in ASYNC_BACKENDS
    staleness = group("async/").get("staleness_mean") if is_async else None
    lengths = [length_percentiles(b) for b in reward.batches]
    return {
        "trainer": kind,
        "backend": backend,
        "variant": spec["variant_label"],
        "curve": curve_name(backend, spec["variant_label"]),
        "seed": spec["seed"],
        "reward": [float(e["reward"]) for e in logs],
        "reward_std": series("reward_std"),
        "wall_clock_s": curve.step_end,
        "cpu_time_s": curve.cpu_end,
        "torch_threads": torch.get_num_threads(),
        "samples": [per_step * (i + 1) for i in range(steps)],
        # the policy version that sampled each step's batch: updates applied before it, minus its mean staleness
        "batch_policy_version": [i - ((staleness[i] or 0.0) if staleness else 0.0) for i in range(steps)],
        "rollout_wait_s": waits,
        "completion_length": series("completions/mean_length"),
        "completion_length_pct": {k: [x[k] for x in lengths] for k in lengths[0]},
        "is_ratio_mean": series("sampling/importance_sampling_ratio/mean"),
        "eval": {k: [e[k] for e in curve.evals] for k in curve.evals[0]},
        "eval_seconds_total": curve.eval_s,
        "eval_cpu_seconds_total": curve.eval_cpu_s,
        "settings": _trainer_settings(trainer) if backend != "generate" else None,
        "async": group("async/") if is_async else None,  # every async/* key, per step
        "sampling": group("sampling/"),  # every sampling/* key, per step
    }


def _trainer_settings(trainer: Any) -> dict[str, Any]:
    """The async and IS settings the trainer ran with (the prefetch depth and staleness bound as resolved when unset:
    with tools the trainer's default depth differs from the config's)."""
    a = trainer.args
    out = {name: getattr(a, name, None) for name in (
        "cb_async_prefetch_depth", "cb_async_max_staleness", "cb_async_keep_stale", "cb_importance_sampling_mode",
        "cb_importance_sampling_clip_min", "cb_importance_sampling_clip_max",
    )}  # fmt: skip
    if getattr(a, "cb_async_generation", False) and hasattr(trainer, "rollouts"):
        out["cb_async_prefetch_depth"] = trainer.rollouts.async_rollouts.prefetch_depth()
        out["max_staleness_resolved"] = trainer.rollouts.async_rollouts.max_staleness()
    return out


# ------------------------------------------------------------------------------------------------- aggregation


def _trailing_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def first_crossing(values: list[float], threshold: float, window: int) -> int | None:
    """Index of the first point whose trailing mean over `window` points reaches `threshold` (None if never)."""
    return next((i for i, v in enumerate(_trailing_mean(values, window)) if v >= threshold), None)


def interpolated_crossing(xs: list[float], values: list[float], threshold: float) -> float | None:
    """Where `values` (sampled at `xs`) first reaches `threshold`, linearly interpolated between the last point below
    it and the first at or above it (None if never; `xs[0]` if the first point already reaches it).

    Evaluation points are K optimizer steps apart, so the first point at the threshold overstates the samples and
    seconds a curve needed by up to one interval (64 samples at the defaults); two curves that cross a few samples
    apart can land an interval apart. Interpolating treats every curve alike and removes that quantisation."""
    i = first_crossing(values, threshold, 1)
    if i is None or i == 0:
        return None if i is None else xs[0]
    frac = (threshold - values[i - 1]) / (values[i] - values[i - 1])
    return xs[i - 1] + frac * (xs[i] - xs[i - 1])


def _band(rows: list[list[float]]) -> dict[str, list[float]]:
    columns = list(zip(*rows))
    return {
        "mean": [statistics.fmean(c) for c in columns],
        "min": [min(c) for c in columns],
        "max": [max(c) for c in columns],
    }


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _values(runs: list[dict[str, Any]], group: str, name: str) -> list[float]:
    return [x for r in runs for x in ((r.get(group) or {}).get(name) or []) if x is not None]


def summarize_curve(runs: list[dict[str, Any]], threshold: float, window: int) -> dict[str, Any]:
    """Seed statistics of one (trainer, curve): evaluation and training-batch reward bands, time and samples to the
    threshold (on the evaluation reward), async and length statistics. Ratios and band shares: `compare`."""
    steps = min(len(r["reward"]) for r in runs)
    points = min(len(r["eval"]["step"]) for r in runs)
    ev = {
        "step": runs[0]["eval"]["step"][:points],
        "reward": _band([r["eval"]["reward"][:points] for r in runs]),
        "wall_clock_s": _band([r["eval"]["wall_clock_s"][:points] for r in runs]),
    }
    per_step = runs[0]["samples"][0]
    ev["samples"] = [per_step * s for s in ev["step"]]
    # CPU seconds (evaluation excluded) at each evaluation point; 0 before training
    cpu_at = [[r["cpu_time_s"][s - 1] if s else 0.0 for s in ev["step"]] for r in runs]
    mean_reward = ev["reward"]["mean"]
    crossing = first_crossing(mean_reward, threshold, 1)
    per_seed = [first_crossing(r["eval"]["reward"][:points], threshold, 1) for r in runs]
    step_times = [b - a for r in runs for a, b in zip([0.0, *r["wall_clock_s"]], r["wall_clock_s"])]
    waits = [w for r in runs for w in r["rollout_wait_s"]]
    last = [r["eval"]["reward"][points - 1] for r in runs]
    train_last = [statistics.fmean(r["reward"][steps - window : steps]) for r in runs]
    train_crossing = first_crossing(_band([r["reward"][:steps] for r in runs])["mean"], threshold, window)
    spread = [
        p90 / max(p10, 1.0) for r in runs for p10, p90 in zip(r["completion_length_pct"]["p10"],
                                                              r["completion_length_pct"]["p90"])
    ]  # fmt: skip
    out: dict[str, Any] = {
        "trainer": runs[0]["trainer"],
        "backend": runs[0]["backend"],
        "variant": runs[0]["variant"],
        "curve": runs[0]["curve"],
        "seeds": [r["seed"] for r in runs],
        "steps": steps,
        "eval": ev,
        "final_eval_reward": _stats(last),
        "steps_to_threshold": None if crossing is None else ev["step"][crossing],
        "samples_to_threshold": None if crossing is None else ev["samples"][crossing],
        "time_to_threshold_s": None if crossing is None else ev["wall_clock_s"]["mean"][crossing],
        "cpu_time_to_threshold_s": None if crossing is None else statistics.fmean(c[crossing] for c in cpu_at),
        "time_to_threshold_per_seed_s": [
            None if i is None else r["eval"]["wall_clock_s"][i] for r, i in zip(runs, per_seed)
        ],
        "seeds_reaching_threshold": sum(i is not None for i in per_seed),
        # the same three, interpolated between evaluation points (what the targets use: `interpolated_crossing`)
        "samples_to_threshold_interp": interpolated_crossing(ev["samples"], mean_reward, threshold),
        "time_to_threshold_s_interp": interpolated_crossing(ev["wall_clock_s"]["mean"], mean_reward, threshold),
        "cpu_time_to_threshold_s_interp": interpolated_crossing(
            [statistics.fmean(c[j] for c in cpu_at) for j in range(points)], mean_reward, threshold
        ),
        "eval_seconds": statistics.fmean(r["eval_seconds_total"] for r in runs),
        # the training-batch reward (what TRL logs): a policy 0..staleness updates old sampled each batch
        "reward": _band([r["reward"][:steps] for r in runs]),
        "batch_policy_version": _band([r["batch_policy_version"][:steps] for r in runs])["mean"],
        "final_train_reward": _stats(train_last),
        "train_steps_to_threshold": None if train_crossing is None else train_crossing + 1,
        "wall_clock_s": _band([r["wall_clock_s"][:steps] for r in runs]),
        "cpu_time_s": _band([r["cpu_time_s"][:steps] for r in runs]),
        "samples": runs[0]["samples"][:steps],
        "step_time_s": statistics.fmean(step_times),
        "cpu_time_per_step_s": statistics.fmean(r["cpu_time_s"][steps - 1] / steps for r in runs),
        "rollout_wait_s": statistics.fmean(waits) if waits else None,
        "total_wall_clock_s": statistics.fmean(r["wall_clock_s"][steps - 1] for r in runs),
        "mean_completion_length": statistics.fmean(x for r in runs for x in (r["completion_length"] or [0.0])),
        "completion_length_p90_over_p10_min": min(spread),
        # mean |trainer logprob - sampler logprob| per sampled token (TRL's `sampling/sampling_logp_difference/mean`):
        # how far the policy moved between sampling and training; what staleness costs in samples follows it
        "sampler_drift_nats": statistics.fmean(_values(runs, "sampling", "sampling_logp_difference/mean") or [0.0]),
        "async": None,
    }
    if runs[0]["async"] is not None:
        stale_max = _values(runs, "async", "staleness_max")
        out["async"] = {
            "dropped_groups_total": [int((r["async"].get("dropped_total") or [0])[-1] or 0) for r in runs],
            # steps whose batch held at least one group sampled (partly) by an older policy, per seed
            "steps_with_stale_groups": [sum(1 for x in r["async"].get("staleness_max") or [] if x) for r in runs],
            "staleness_mean": statistics.fmean(_values(runs, "async", "staleness_mean") or [0.0]),
            "staleness_max": max(stale_max, default=0.0),
            # how often each max staleness occurred over the steps of all seeds: the achieved distribution
            "staleness_max_counts": {str(int(k)): stale_max.count(k) for k in sorted(set(stale_max))},
            "wait_time_s": statistics.fmean(_values(runs, "async", "wait_time_s") or [0.0]),
            "engine_occupancy": statistics.fmean(_values(runs, "async", "engine_occupancy") or [0.0]),
        }
    return out


def _in_band(curve: list[float], band: dict[str, list[float]], slack: float) -> float:
    """Share of points where `curve` lies inside the [min - slack, max + slack] band."""
    n = min(len(curve), len(band["min"]))
    inside = sum(band["min"][i] - slack <= curve[i] <= band["max"][i] + slack for i in range(n))
    return inside / max(n, 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare(summary: list[dict[str, Any]]) -> None:
    """Add, per curve, the ratios to the sync reference (`trl_cb`) and the evaluation-band shares: inside the
    reference's and `generate()`'s seed band (min-max over seeds) at what share of the evaluation points."""
    for s in summary:
        ref = next((x for x in summary if x["trainer"] == s["trainer"] and x["curve"] == REFERENCE), None)
        base = next((x for x in summary if x["trainer"] == s["trainer"] and x["curve"] == BASELINE), None)
        for key in ("samples_to_threshold", "time_to_threshold_s", "cpu_time_to_threshold_s"):
            for k in (key, f"{key}_interp"):
                s[f"{k}_vs_{REFERENCE}"] = _ratio(s.get(k), ref.get(k)) if ref else None
        s["time_to_threshold_s_vs_generate"] = (
            _ratio(s["time_to_threshold_s_interp"], base["time_to_threshold_s_interp"]) if base else None
        )
        for name, other in ((REFERENCE, ref), (BASELINE, base)):
            band = (
                None
                if other is None or other is s
                else _in_band(s["eval"]["reward"]["mean"], other["eval"]["reward"], 0.0)
            )
            s[f"eval_band_share_vs_{name}"] = band


def targets(summary: list[dict[str, Any]], band_share: float) -> list[dict[str, Any]]:
    """Issue 31's targets per trainer and curve, on the evaluation reward: each with its value and a verdict.

    Async curves against trl_cb sync: inside its seed band at >= `band_share` of the eval points; samples to the
    threshold <= 1.1x (<= 1.5x for `keep_stale` variants, whose staleness is 4-8 by design); wall-clock to the
    threshold <= 0.9x for server async and in-process overlap (generation beside training, issues 31 and 26) and
    <= 0.95x for in-process async. Samples and seconds to the threshold are interpolated between evaluation points
    (`interpolated_crossing`); the first evaluation point at the threshold is kept in the summary beside them."""
    out = []
    for s in summary:
        checks: list[tuple[str, float | None, str, float]] = []
        name = s["curve"]
        if s["curve"] == REFERENCE:
            checks.append((f"{name}: eval reward inside generate()'s seed band (share of eval points)",
                           s["eval_band_share_vs_generate"], ">=", band_share))  # fmt: skip
            checks.append((f"{name}: time to threshold / generate() (no target)",
                           s["time_to_threshold_s_vs_generate"], "", 0.0))  # fmt: skip
        elif s["backend"] in ASYNC_BACKENDS:
            overlapped = s["backend"] in ("trl_cb_server_async", "trl_cb_overlap_async")  # generation beside training
            keep_stale = bool((s.get("variant") or "") and "keep_stale=1" in s["variant"])
            checks.append((f"{name}: eval reward inside trl_cb sync's seed band (share of eval points)",
                           s[f"eval_band_share_vs_{REFERENCE}"], ">=", band_share))  # fmt: skip
            checks.append((f"{name}: samples to threshold / trl_cb sync",
                           s[f"samples_to_threshold_interp_vs_{REFERENCE}"],
                           "<=", 1.5 if keep_stale else 1.1))  # fmt: skip
            checks.append((f"{name}: time to threshold / trl_cb sync",
                           s[f"time_to_threshold_s_interp_vs_{REFERENCE}"],
                           "<=", 0.9 if overlapped else 0.95))  # fmt: skip
            checks.append((f"{name}: same in process CPU seconds / trl_cb sync (no target)",
                           s[f"cpu_time_to_threshold_s_interp_vs_{REFERENCE}"], "", 0.0))  # fmt: skip
        elif s["curve"] == "trl_cb_server":
            checks.append((f"{name}: time to threshold / trl_cb sync (no target)",
                           s[f"time_to_threshold_s_interp_vs_{REFERENCE}"], "", 0.0))  # fmt: skip
        for target, value, op, bound in checks:
            met = None if value is None or not op else (value >= bound if op == ">=" else value <= bound)
            out.append({"trainer": s["trainer"], "target": target, "value": value,
                        "bound": f"{op} {bound}" if op else None, "met": met})  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS), help=f"subset of {TRAINERS}")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"subset of {BACKENDS}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (sampling, data order)")
    p.add_argument("--task", default="default", choices=[*TASKS, "agent"],
                   help="default: no EOS bias, <= 24 tokens; longtail: EOS bias 4.0, <= 96 tokens, only the output "
                   "projection learns (lengths stay spread). Sets --eos-logit-bias, --max-completion-length and "
                   "--learning-rate when those are not given. agent: multi-turn tool calls and prefix reuse, "
                   "learning_agent.py (its own options: --task agent --help)")  # fmt: skip
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=None, help="default: the --task's (24 or 96)")
    p.add_argument("--learning-rate", type=float, default=None, help="constant schedule (default: the --task's, "
                   "5e-3 or 2e-2 for longtail)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (TRL's top_p)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (TRL's top_k; 0: off)")
    p.add_argument("--min-p", type=float, default=None, help="min-p sampling (TRL's min_p)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="TRL's repetition_penalty")
    p.add_argument("--reward", default="char", choices=REWARDS, help="char: share of --char; gsm8k: accuracy")
    p.add_argument("--char", default="a", help="the character whose share is the reward (--reward char)")
    p.add_argument("--min-chars", type=int, default=20, help="--reward char: divide by at least this many chars")
    p.add_argument("--threshold", type=float, default=0.4, help="evaluation reward for time/samples to threshold")
    p.add_argument("--window", type=int, default=3, help="training-batch reward: trailing mean (steps) for its "
                   "crossing and final value")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=4, help="evaluate the current weights every K optimizer steps "
                   "(and at step 0 and the last step)")  # fmt: skip
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts (disjoint from the training ones)")
    p.add_argument("--eval-samples", type=int, default=4, help="fresh samples per held-out prompt and evaluation")
    p.add_argument("--eval-seed", type=int, default=1234, help="evaluation point `step` samples with seed + step")
    p.add_argument("--model", default="tiny", help="tiny (offline random Qwen2) | hub id | local path")
    p.add_argument("--eos-logit-bias", type=float, default=None, help="tiny model: EOS logit boost (default: the "
                   "--task's: none, or 4.0 for longtail)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=512, help="GSM8K problems in the training set")
    p.add_argument("--data-file", default=None, help="GSM8K JSONL to train on (e.g. the train split); default: the "
                   "GSM8K test split shipped with trl_cb")  # fmt: skip
    g = p.add_argument_group("async variants (learning_variants.py): each is a curve of every async backend")
    g.add_argument("--prefetch-depth", type=int, nargs="+", default=None, help="prefetch_depth values (default 1)")
    g.add_argument(
        "--max-staleness",
        type=int,
        nargs="+",
        default=None,
        help="max_staleness values (default: the config's, (prefetch_depth + 1) * k: drops nothing)",
    )
    g.add_argument("--keep-stale", action="store_true", help="cb_async_keep_stale=True in every variant")
    g.add_argument(
        "--staleness-sweep",
        type=int,
        nargs="+",
        default=None,
        metavar="S",
        help="per S: depth=S-1,max_staleness=S,keep_stale=1 (replaces --prefetch-depth/--max-staleness)",
    )
    g.add_argument("--is-mode", nargs="+", default=None, help="cb_importance_sampling_mode values (default: the "
                   "config's per trainer)")  # fmt: skip
    g.add_argument("--is-clip-min", nargs="+", default=None, help="cb_importance_sampling_clip_min values ('none')")
    g.add_argument("--is-clip-max", nargs="+", default=None, help="cb_importance_sampling_clip_max values ('none')")
    g.add_argument("--variants", nargs="+", default=None, metavar="SPEC",
                   help="explicit variants, e.g. depth=3,keep_stale=1,max_staleness=4 (keys: "
                   f"{', '.join(variants.FIELDS)}); excludes the grid flags")  # fmt: skip
    p.add_argument("--server-threads", type=int, default=1, help="server backends: the local server's threads")
    p.add_argument("--server-device", default=None, help="server backends: the server's device (default: --device)")
    p.add_argument("--band-share", type=float, default=0.8, help="share of eval points that must lie inside a band")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one training run may take")
    common.add_options(p, "learning")
    args = p.parse_args(argv)
    if args.worker or args.replot:
        return args
    for name, value in TASKS[args.task].items():
        if name != "steady_eos" and getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.steps, args.seeds, args.prompts_per_step, args.num_generations = 3, args.seeds[:2], 2, 2
        args.max_completion_length, args.window = 8, 1
        args.eval_every, args.eval_prompts, args.eval_samples = 2, 2, 2
    for flag, allowed, given in (("--trainers", TRAINERS, args.trainers), ("--backends", BACKENDS, args.backends)):
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            p.error(f"unknown {flag} value(s) {unknown}; choose from {list(allowed)}")
    for flag in ("steps", "prompts_per_step", "num_generations", "max_completion_length", "window", "num_prompts",
                 "eval_every", "eval_prompts", "eval_samples"):  # fmt: skip
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.data_file is not None and not Path(args.data_file).is_file():
        p.error(f"--data-file not found: {args.data_file}")
    if args.data_file is None and args.num_prompts + args.eval_prompts > GSM8K_TEST_SIZE:
        p.error(f"--num-prompts + --eval-prompts must be <= {GSM8K_TEST_SIZE} (the GSM8K test split), got "
                f"{args.num_prompts + args.eval_prompts}")  # fmt: skip
    if args.window > args.steps:
        p.error(f"--window ({args.window}) must be <= --steps ({args.steps})")
    if len(args.char) != 1:
        p.error(f"--char must be one character, got {args.char!r}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must be distinct, got {args.seeds}")
    args.variant_settings = _variants(p, args)
    if args.dtype is None and args.model == "tiny":
        args.dtype = "float32"
    common.finish_options(p, args)
    return args


def _variants(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The async variants of the command line (`learning_variants.py`); `p.error` on a bad spec or combination."""
    grid_flags = {
        "--prefetch-depth": args.prefetch_depth,
        "--max-staleness": args.max_staleness,
        "--keep-stale": args.keep_stale or None,
        "--staleness-sweep": args.staleness_sweep,
        "--is-mode": args.is_mode,
        "--is-clip-min": args.is_clip_min,
        "--is-clip-max": args.is_clip_max,
    }
    given = [flag for flag, value in grid_flags.items() if value is not None]  # fmt: skip
    if args.variants is not None and given:
        p.error(f"--variants excludes the grid flags (given: {', '.join(given)}); put those settings in the specs")
    if args.staleness_sweep and (args.prefetch_depth or args.max_staleness):
        p.error("--staleness-sweep sets prefetch depth and max staleness; drop --prefetch-depth/--max-staleness")
    if args.staleness_sweep and min(args.staleness_sweep) < 1:
        p.error(f"--staleness-sweep values must be >= 1 (S needs prefetch depth S-1), got {args.staleness_sweep}")
    try:
        if args.variants is not None:
            found = variants.dedupe([variants.parse_spec(s) for s in args.variants])
        else:
            clips = [None if v is None else [variants.none_or(float, x) for x in v]
                     for v in (args.is_clip_min, args.is_clip_max)]  # fmt: skip
            found = variants.grid(
                args.prefetch_depth, args.max_staleness, args.keep_stale, args.is_mode, *clips, args.staleness_sweep
            )
    except ValueError as err:
        p.error(str(err))
    if not any(b in ASYNC_BACKENDS for b in args.backends):
        return found
    rejected = variants.check_variants(args.trainers, found)
    for v in found:
        if all((t, variants.label(v)) in rejected for t in args.trainers):
            p.error(f"variant {variants.label(v)!r}: {rejected[args.trainers[0], variants.label(v)]}")
    args.rejected = {f"{t} {label}": err for (t, label), err in rejected.items()}
    return found


def _print_tables(summary: list[dict[str, Any]], checks: list[dict[str, Any]], threshold: float) -> None:
    rows = []
    for s in summary:
        a = s["async"] or {}
        rows.append({
            "trainer": s["trainer"], "curve": s["curve"], "final": s["final_eval_reward"]["mean"],
            "band": f"{s['final_eval_reward']['min']:.2f}-{s['final_eval_reward']['max']:.2f}",
            "stt": s["samples_to_threshold"], "stti": s.get("samples_to_threshold_interp"),
            "stt_x": s.get(f"samples_to_threshold_interp_vs_{REFERENCE}"),
            "ttt": s.get("time_to_threshold_s_interp"), "ttt_x": s.get(f"time_to_threshold_s_interp_vs_{REFERENCE}"),
            "reached": f"{s['seeds_reaching_threshold']}/{len(s['seeds'])}",
            "in_ref": s[f"eval_band_share_vs_{REFERENCE}"], "in_gen": s["eval_band_share_vs_generate"],
            "eval_s": s["eval_seconds"], "step": s["step_time_s"], "train_final": s["final_train_reward"]["mean"],
            "spread": s["completion_length_p90_over_p10_min"], "stale": a.get("staleness_mean"),
            "drift": s.get("sampler_drift_nats"),
            "stale_max": a.get("staleness_max"), "dropped": sum(a["dropped_groups_total"]) if a else None,
        })  # fmt: skip
    print(common.format_table(rows, [
        ("trainer", "trainer"), ("curve", "backend / variant"), ("final", "final eval reward"), ("band", "seed band"),
        ("stt", f"first eval point >= {threshold} (samples)"), ("stti", f"samples to {threshold} (interpolated)"),
        ("stt_x", "x trl_cb"), ("ttt", f"train s to {threshold} (interpolated)"),
        ("ttt_x", "x trl_cb"), ("reached", "seeds reached"), ("in_ref", "in trl_cb band"),
        ("in_gen", "in generate band"), ("eval_s", "eval s/run"), ("step", "s/step"),
        ("train_final", "final batch reward"), ("spread", "min p90/p10 len"), ("stale", "mean staleness"),
        ("stale_max", "max staleness"), ("drift", "drift nats/token"), ("dropped", "dropped groups"),
    ]))  # fmt: skip
    print()
    print(common.format_table(
        [{"trainer": c["trainer"], "target": c["target"], "value": c["value"], "bound": c["bound"],
          "met": {True: "yes", False: "NO", None: "-"}[c["met"]]} for c in checks],
        [("trainer", "trainer"), ("target", "target"), ("value", "measured"), ("bound", "target"), ("met", "met")],
    ))  # fmt: skip


def summaries(runs: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """Per-curve summaries of the runs so far, their comparison to sync, and the targets."""
    curves = list(dict.fromkeys((r["trainer"], r["curve"]) for r in runs))
    summary = [
        summarize_curve([r for r in runs if (r["trainer"], r["curve"]) == key], config["threshold"], config["window"])
        for key in curves
    ]
    compare(summary)
    return {"summary": summary, "targets": targets(summary, config["band_share"])}


def _todo(args: argparse.Namespace) -> list[tuple[str, int, str, dict[str, Any] | None]]:
    """(trainer, seed, backend, variant) runs; backends alternate within each seed, so a slow phase of a shared
    machine hits all of them alike. Sync backends once, async ones per variant the trainer's config accepts."""
    rejected = getattr(args, "rejected", {})
    out = []
    for kind in args.trainers:
        for seed in args.seeds:
            for backend in args.backends:
                if backend not in ASYNC_BACKENDS:
                    out.append((kind, seed, backend, None))
                    continue
                default_grid = args.prefetch_depth is None and args.variants is None and not args.staleness_sweep
                for v in args.variant_settings:
                    if f"{kind} {variants.label(v)}" not in rejected:
                        out.append((kind, seed, backend, variants.backend_default(backend, v) if default_grid else v))
    return out


def task_and_rest(argv: list[str] | None) -> tuple[str | None, list[str]]:
    """`--task`'s value and the other arguments, read as `parse_args` reads them (`--task agent`, `--task=agent`, an
    abbreviation), so that the agent task's arguments go to `learning_agent.py` however `--task` was written."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--task", default=None)
    try:
        known, rest = pre.parse_known_args(argv)
    except argparse.ArgumentError:  # `--task` without a value: `parse_args` reports it
        return None, argv
    return known.task, rest


def main(argv: list[str] | None = None) -> dict[str, Any]:
    task, rest = task_and_rest(argv)
    if task == "agent":  # the multi-turn agent task: a script of its own options
        import learning_agent

        return learning_agent.main(rest)
    args = parse_args(argv)
    if common.other_mode(args, run_point, plots.render_learning):
        return {}
    from tqdm import tqdm

    default_run = args.model == "tiny" and args.device == "cpu" and not args.quick
    runs_todo = _todo(args)
    print(
        f"trl_cb learning benchmark: trainers={args.trainers} backends={args.backends} seeds={args.seeds} "
        f"task={args.task} steps={args.steps} batch={args.prompts_per_step}x{args.num_generations} "
        f"max_completion_length={args.max_completion_length} reward={args.reward}"
        + (f"({args.char!r})" if args.reward == "char" else "")
        + f" eval: every {args.eval_every} steps, {args.eval_prompts}x{args.eval_samples} samples; "
        f"async variants: {[variants.label(v) for v in args.variant_settings]}; {len(runs_todo)} runs"
        + (" — about 20 s per run on 2 quiet CPU cores (more when busy)." if default_run else ""),
        flush=True,
    )
    for name, err in getattr(args, "rejected", {}).items():
        print(f"skipped {name}: the config rejects it ({err})")
    # the summaries read the config the result file records (`summarize` runs only once the file is built)
    results = common.ResultFile("learning", args, lambda runs: summaries(runs, results.config), plots.render_learning)
    print(f"runs are written to {results.path} as they finish (--resume it after an interruption)", flush=True)
    bar = tqdm(runs_todo, desc="training runs", unit="run")
    with common.Workers(Path(__file__)) as workers:
        for kind, seed, backend, variant in bar:
            label = None if variant is None else variants.label(variant)
            bar.set_postfix_str(f"{kind} {curve_name(backend, label)} seed {seed}")
            key = (kind, seed, backend, label)
            if results.has(key):
                continue
            spec = {
                "trainer": kind, "backend": backend, "seed": seed, "task": args.task, "steps": args.steps,
                "variant": variant, "variant_label": label, "prompts_per_step": args.prompts_per_step,
                "num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
                "learning_rate": args.learning_rate, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
                "device": args.device, "dtype": args.dtype, "model": args.model, "eos_logit_bias": args.eos_logit_bias,
                "num_prompts": args.num_prompts, "data_seed": 0, "data_file": args.data_file,
                "reward": args.reward, "char": args.char, "min_chars": args.min_chars, "eval_every": args.eval_every,
                "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples, "eval_seed": args.eval_seed,
                "server_threads": args.server_threads, "server_device": args.server_device,
                "output_dir": f"/tmp/trl_cb_learning_{kind}_{backend}_{seed}",
            }  # fmt: skip
            try:
                run = workers.run(spec, group=None, timeout=args.timeout)
            except common.WorkerError as err:  # one retry: a transient fault (a port taken meanwhile) must not end it
                print(f"\nrun {key} failed, retrying once: {str(err)[-500:]}", file=sys.stderr, flush=True)
                try:
                    run = workers.run(spec, group=None, timeout=args.timeout)
                except common.WorkerError as again:
                    results.fail(key, str(again))
                    continue
            results.add(key, run)
    bar.close()
    return results.finish(lambda payload: _print_tables(payload["summary"], payload["targets"], args.threshold))


if __name__ == "__main__":
    main()
