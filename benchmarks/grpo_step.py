"""Training-step benchmark: median GRPO / RLOO step time with plain generate(), TRL's own CB path, and trl_cb.

    pip install -e . && python benchmarks/grpo_step.py    # tiny Qwen2, CPU, GSM8K-like: 8 prompts x G=8, <= 256 tokens
    python benchmarks/grpo_step.py --workload short       # the earlier default: 8 prompts x 4 completions x 48 tokens
    python benchmarks/grpo_step.py --trainers grpo --steps 10 --max-completion-length 128
    python benchmarks/grpo_step.py --quick                        # 1.5-3 min (every backend once), smoke test
    python benchmarks/grpo_step.py --model small                  # 8 layers x 256 wide: compute-heavier
    python benchmarks/grpo_step.py --trainers grpo --backends trl_cb --background-load 0 2   # quiet vs loaded
    python benchmarks/grpo_step.py --device cuda --model llama-1b-random --trainers grpo --max-completion-length 512

Backends, same workload and settings in one run, each (trainer, backend) in its own subprocess (isolation, see
benchmarks/common.py):
- `generate`:   TRL's trainer, `use_transformers_continuous_batching=False` (left-padded `model.generate`).
- `trl_native`: TRL's trainer with its own `use_transformers_continuous_batching=True` (new manager every step,
                no logprobs, no IS correction; `max_memory_percent` TRL's 0.5 unless `--native-memory-percent`).
- `trl_cb`:     trl_cb's trainer with the flag on (persistent engine, logprobs, IS correction).
- `trl_cb_async`: the same with `cb_async_generation=True` (engine fed ahead of the trainer, bounded staleness).
- `trl_cb_overlap_async`: the same with `cb_async_overlap=True`: the engine also generates during the trainer's forward
                and backward, on a view of the same weights, and pauses only for optimizer steps (docs/async.md);
                `--engine-threads` sets its intra-op threads (default: the trainer's `--threads`); several values
                (`1 2 trainer`, `trainer`: unset) run this backend once per value.
- `trl_cb_server`: trl_cb's trainer with `cb_server_urls` pointing at a local `trl-cb serve` replica the worker
                starts (sync: weights pushed before each step's generation).
- `trl_cb_server_async`: the same with `cb_async_generation=True`: the server generates while the trainer trains,
                weights pushed after every optimizer step (docs/server.md).

Threads: colocated backends use `--threads` (default: every core); the server backends split the cores, the server
`--server-threads` (default 1) and the trainer the rest (at least 1), so both setups use the same machine.

On CUDA (`--device cuda`, default model `llama-1b-random` with its calibrated GSM8K-like tail, `common.calibrate_tail`)
the model is loaded in `--dtype` (default float32) and trained with `bf16=True` (TRL's default: trl_cb generates on
bf16 copies of the weights); default backends `generate`, `trl_cb`, `trl_cb_async`, `trl_cb_overlap_async`.

Besides step times it reports samples/s (completions per step / median step time), tokens/s, and, for the trl_cb
backends, the trainer's wait for rollouts per step (sync: the generation call; async: the wait for finished groups)
and, for the server backends, the time of each weight push (part of the step: the trainer sends while it waits),
and the trainer process's peak RSS (a server backend's server is another process, not counted).

Workloads (`--workload`; `--prompts`, `--num-generations`, `--max-completion-length` override either):
- `gsm8k` (default): 8 prompts x G=8 completions, up to 256 tokens, long-tailed lengths (the preset's EOS bias; tiny:
  mean ~140 tokens): the shape of a GSM8K GRPO run.
- `short`: 8 prompts x 4 completions x up to 48 tokens (the default before; generation is a small part of the step).

Prompts: the GSM8K test split shipped with trl_cb (`trl_cb.offline.data.gsm8k_test`), chat-formatted.

Reward (`--reward`): `length` (default: characters / 100) drives completions longer as the weights learn, faster in
sync mode than with stale async groups, so backends end up generating different lengths (compare tokens/s then);
`random` (a hash of the completion's text in [0, 1)) moves the weights just as much but leaves lengths where they
are, so samples/s compare like with like.

`--background-load 0 2` runs every (trainer, backend) once per value, with that many busy-looping processes running
alongside (started before the run, stopped after it; benchmarks/common.py `background_load`), and reports each
loaded median against the same backend's median at the smallest load ("x quiet").

`--rounds 2` runs the whole list of runs twice, the second time in reverse order (A B C C B A): on a shared machine a
drift in load then falls on every variant alike, and ratios are taken within one invocation.

Each run trains `--warmup + --steps` steps in a process of its own (a fresh model: training moves the weights); step
times come from a `TrainerCallback` (step begin to step end, which includes generation, scoring and the optimizer
step). Every run is written to the JSON as soon as it ends (`--resume FILE` completes an interrupted invocation);
table on stdout, the JSON document as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import plots  # noqa: E402

BACKENDS = (
    "generate", "trl_native", "trl_cb", "trl_cb_async", "trl_cb_overlap_async", "trl_cb_server", "trl_cb_server_async"
)  # fmt: skip
CUDA_BACKENDS = ("generate", "trl_cb", "trl_cb_async", "trl_cb_overlap_async")
#: Backends whose rollouts come from a local `trl-cb serve` replica the worker starts (`--server-threads` threads).
SERVER_BACKENDS = ("trl_cb_server", "trl_cb_server_async")
TRAINERS = ("grpo", "rloo")
#: Step shapes: prompts per step, completions per prompt, max completion length (module docstring).
WORKLOADS = {
    "gsm8k": {"prompts": 8, "num_generations": 8, "max_completion_length": 256},
    "short": {"prompts": 8, "num_generations": 4, "max_completion_length": 48},
}


def _async_fields(spec: dict[str, Any]) -> dict[str, Any]:
    fields = {"cb_async_generation": True, "cb_async_max_staleness": spec["max_staleness"]}
    if spec["prefetch_depth"] is not None:  # unset: the config's default for the backend (0 with overlap, else 1)
        fields["cb_async_prefetch_depth"] = spec["prefetch_depth"]
    if spec["backend"] == "trl_cb_overlap_async":
        fields.update(cb_async_overlap=True, cb_async_overlap_engine_threads=spec.get("engine_threads"))
    return fields


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """One training run of `warmup + steps` steps (a process of its own)."""
    import torch
    import trl

    import trl_cb

    kind, backend = spec["trainer"], spec["backend"]
    package = trl_cb if backend.startswith("trl_cb") else trl
    config_cls = package.GRPOConfig if kind == "grpo" else package.RLOOConfig
    trainer_cls = package.GRPOTrainer if kind == "grpo" else package.RLOOTrainer
    cuda = spec["device"] != "cpu"
    tail = {"eos_logit_bias": spec["eos_logit_bias"], "tail_tokens": spec["tail_tokens"]}
    model, tokenizer = common.load_model(spec["model"], spec["device"], spec["dtype"], **tail)
    with contextlib.ExitStack() as stack:
        server = {}
        if backend in SERVER_BACKENDS:
            served = common.served_model(model, tokenizer, spec["server_threads"], spec["device"], spec["dtype"])
            server = {"cb_server_urls": [stack.enter_context(served)]}
        torch.set_num_threads(spec["trainer_threads"] if backend in SERVER_BACKENDS else spec["threads"])
        native = {"max_memory_percent": spec["native_memory_percent"]}  # TRL's own CB path: its default unless set
        args = config_cls(
            output_dir=spec["output_dir"], per_device_train_batch_size=spec["prompts"] * spec["num_generations"],
            num_generations=spec["num_generations"], max_completion_length=spec["max_completion_length"],
            max_steps=spec["warmup"] + spec["steps"], learning_rate=1e-4, beta=0.0, bf16=cuda, use_cpu=not cuda,
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, seed=spec["seed"],
            use_transformers_continuous_batching=backend != "generate",
            **({"transformers_continuous_batching_config": native} if backend == "trl_native" else {}),
            **(_async_fields(spec) if backend.endswith("_async") else {}), **server,
        )  # fmt: skip
        return _train(spec, args, trainer_cls, model, tokenizer)


def _train(spec: dict[str, Any], args: Any, trainer_cls: Any, model: Any, tokenizer: Any) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from trl_cb.offline.data import GSM8K_TEST_SIZE, gsm8k_test

    backend = spec["backend"]
    steps = spec["warmup"] + spec["steps"]
    dataset = Dataset.from_list(gsm8k_test(min(spec["prompts"] * steps, GSM8K_TEST_SIZE), seed=spec["seed"]))
    cuda = spec["device"] != "cpu"

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)

    def text(completion: Any) -> str:
        return completion if isinstance(completion, str) else completion[-1]["content"]

    def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [len(text(c)) / 100 for c in completions]

    def random_reward(completions: list[Any], **kwargs: Any) -> list[float]:  # same text, same reward
        return [zlib.crc32(text(c).encode()) / 2**32 for c in completions]

    rewards = {"length": length_reward, "random": random_reward}
    timer = StepTimer()
    trainer = trainer_cls(
        model=model, reward_funcs=rewards[spec["reward"]], args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[timer],
    )  # fmt: skip
    waits: list[float] = []
    if backend.startswith("trl_cb"):  # time the trainer's wait for rollouts
        rollouts = trainer.rollouts
        async_ = backend.endswith("_async")
        waits = common.record_call_times(
            rollouts.async_rollouts if async_ else rollouts, "take" if async_ else "generate"
        )
    pushes = common.record_call_times(trainer.rollouts.remote, "push_weights") if backend in SERVER_BACKENDS else []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = trainer.state.log_history
    lengths = [e["completions/mean_length"] for e in logs if "completions/mean_length" in e]
    async_logs = [e for e in logs if "async/staleness_max" in e]
    return {
        "step_times": timer.times[spec["warmup"] :], "mean_lengths": lengths, "waits": waits[spec["warmup"] :],
        "pushes": pushes[spec["warmup"] :], "completions_per_step": spec["prompts"] * spec["num_generations"],
        "staleness_max": max((e["async/staleness_max"] for e in async_logs), default=None),
        "dropped_total": async_logs[-1]["async/dropped_total"] if async_logs else None,
        "peak_rss_bytes": common.peak_rss_bytes(),  # the trainer's process (a server backend's server is another)
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    p.add_argument("--backends", nargs="+", default=None, choices=BACKENDS, help="default: all on CPU; see above")
    common.add_native_memory_option(p)
    p.add_argument("--model", default=None, choices=common.PRESETS, help="default: tiny (CPU), llama-1b-random (CUDA)")
    p.add_argument(
        "--background-load", type=int, nargs="+", default=[0],
        help="busy-looping processes running alongside each run; several values run each backend once per value",
    )  # fmt: skip
    p.add_argument("--workload", default="gsm8k", choices=sorted(WORKLOADS), help="step shape (default: gsm8k)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the workload's)")
    p.add_argument("--num-generations", type=int, default=None, help="G (default: the workload's)")
    p.add_argument("--max-completion-length", type=int, default=None, help="(default: the workload's)")
    p.add_argument("--steps", type=int, default=6, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--eos-logit-bias", type=float, default=None,
        help="EOS logit boost (default: per preset; llama-1b-random: the calibrated tail)",
    )  # fmt: skip
    p.add_argument("--no-tail", action="store_true", help="EOS not boosted: completions run to the cap")
    p.add_argument("--max-staleness", type=int, default=2, help="async backends: cb_async_max_staleness")
    p.add_argument("--prefetch-depth", type=int, default=None,
                   help="async backends: cb_async_prefetch_depth (default: 0 with overlap, else 1)")  # fmt: skip
    p.add_argument("--reward", default="length", choices=["length", "random"], help="see the module docstring")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, colocated backends")
    p.add_argument(
        "--engine-threads", type=engine_threads_value, nargs="+", default=[None],
        help="trl_cb_overlap_async: the engine's threads (`trainer`: unset); several values run it once per value",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="run the list this many times, every other one reversed")
    p.add_argument("--server-threads", type=int, default=1, help="the local server's threads (server backends)")
    p.add_argument("--trainer-threads", type=int, default=None, help="server backends (default: the rest, >= 1)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    # dtype: the training weights'; on CUDA, bf16=True generates on bf16 copies (TRL's default)
    args = common.parse(p, argv, "grpo_step", dtype="float32")
    if args.worker or args.replot:
        return args
    cuda = args.device != "cpu"
    args.model = args.model or ("llama-1b-random" if cuda else "tiny")
    args.backends = common.without_native_for_hybrids(
        args.model, args.backends or list(CUDA_BACKENDS if cuda else BACKENDS)
    )
    if args.no_tail and args.eos_logit_bias is not None:
        p.error("--no-tail and --eos-logit-bias exclude each other")
    if args.trainer_threads is None:
        args.trainer_threads = max(1, args.threads - args.server_threads)
    for name, value in WORKLOADS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.prompts, args.num_generations, args.max_completion_length, args.steps = 2, 2, 8, 2
    for name in ("prompts", "num_generations", "max_completion_length", "steps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    # the length tail as `load_model`'s keywords, resolved here so that the config records the model that was built
    args.tail_tokens = None
    if not args.no_tail:
        tail = common.length_tail(args.model, args.eos_logit_bias, args.max_completion_length)
        args.eos_logit_bias, args.tail_tokens = tail["eos_logit_bias"], tail["tail_tokens"]
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if any(n < 0 for n in args.background_load):
        p.error(f"--background-load values must be >= 0, got {args.background_load}")
    return args


def engine_threads_value(text: str) -> int | None:
    """`--engine-threads` values: a count >= 1, or `trainer` (unset: the engine takes the trainer's count)."""
    if text == "trainer":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"engine threads must be >= 1 or 'trainer', got {text}")
    return value


def run_list(args: argparse.Namespace) -> list[tuple[int, str, str, int, int | None]]:
    """(round, trainer, backend, load, engine threads) per run; odd rounds in reverse order (A B B A)."""
    once = [
        (t, b, n, e)
        for t in args.trainers
        for b in args.backends
        for n in args.background_load
        for e in (args.engine_threads if b == "trl_cb_overlap_async" else [None])
    ]
    return [(r, *run) for r in range(args.rounds) for run in (once if r % 2 == 0 else once[::-1])]


def _mean_length(point: dict[str, Any]) -> float | None:
    return statistics.fmean(point["mean_lengths"]) if point["mean_lengths"] else None


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run: the median step and its ratios to the same round's generate() / TRL CB runs and to the same backend's
    run at the smallest load; samples/s, tokens/s, the trainer's wait for rollouts, pushes, memory."""
    quiet = min(p["key"][3] for p in points)
    summary = []
    for p in points:
        rnd, trainer, backend, load, engine_threads = p["key"]
        median = statistics.median(p["step_times"])
        same_round = {x["key"][2]: statistics.median(x["step_times"]) for x in points
                      if (x["key"][0], x["key"][1], x["key"][3]) == (rnd, trainer, load)}  # fmt: skip
        base = next((x for x in points if x["key"] == [rnd, trainer, backend, quiet, engine_threads]), None)
        length = _mean_length(p)
        summary.append(
            {
                "trainer": trainer, "backend": backend, "background_load": load, "engine_threads": engine_threads,
                "round": rnd, "step_time_s": common.summarize(p["step_times"]),
                "ratio_vs_quiet": median / statistics.median(base["step_times"]) if base else None,
                "ratio_vs_trl_native": median / same_round["trl_native"] if "trl_native" in same_round else None,
                "ratio_vs_generate": median / same_round["generate"] if "generate" in same_round else None,
                "mean_completion_length": length, "samples_per_s": p["completions_per_step"] / median,
                "tokens_per_s": p["completions_per_step"] * length / median if length else None,
                "trainer_wait_s": common.summarize(p["waits"]) if p["waits"] else None,
                "weight_push_s": common.summarize(p["pushes"]) if p["pushes"] else None,
                "staleness_max": p["staleness_max"], "dropped_groups": p["dropped_total"],
                "peak_rss_mb": p["peak_rss_bytes"] / 2**20,
                "peak_cuda_mb": p["peak_cuda_bytes"] / 2**20 if p.get("peak_cuda_bytes") else None,
            }
        )  # fmt: skip
    return {"summary": summary}


def print_table(summary: list[dict[str, Any]]) -> None:
    rows = [
        {
            "trainer": s["trainer"], "backend": s["backend"], "load": s["background_load"], "round": s["round"],
            "engine": "-" if s["backend"] != "trl_cb_overlap_async" else (s["engine_threads"] or "trainer's"),
            "vs_quiet": s["ratio_vs_quiet"], "median": s["step_time_s"]["median"], "min": s["step_time_s"]["min"],
            "max": s["step_time_s"]["max"], "vs_native": s["ratio_vs_trl_native"],
            "vs_generate": s["ratio_vs_generate"], "len": s["mean_completion_length"], "sps": s["samples_per_s"],
            "tps": s["tokens_per_s"], "push": s["weight_push_s"]["mean"] if s["weight_push_s"] else None,
            "wait": s["trainer_wait_s"]["mean"] if s["trainer_wait_s"] else None, "rss": s["peak_rss_mb"],
            "cuda": s["peak_cuda_mb"],
        }
        for s in summary
    ]  # fmt: skip
    columns = [("trainer", "trainer"), ("backend", "backend"), ("load", "bg load"), ("round", "round"),
               ("engine", "engine threads"), ("median", "median s/step"), ("vs_quiet", "x quiet"), ("min", "min"),
               ("max", "max"), ("vs_native", "x TRL CB"), ("vs_generate", "x generate"), ("sps", "samples/s"),
               ("tps", "tokens/s"), ("wait", "wait s/step"), ("push", "push s"), ("len", "mean len"),
               ("rss", "peak RSS MB"), ("cuda", "peak CUDA MB")]  # fmt: skip
    print(common.format_table(rows, columns))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if common.other_mode(args, run_point, plots.render_grpo_step):
        return {}
    from tqdm import tqdm

    print(
        f"trl_cb training-step benchmark: {args.prompts} prompts x {args.num_generations} completions x "
        f"{args.max_completion_length} tokens, {args.steps} timed steps, model={args.model} on {args.device}, "
        f"trainers={args.trainers}, background load={args.background_load}",
        flush=True,
    )
    results = common.ResultFile("grpo_step", args, summarize, plots.render_grpo_step)
    print(f"runs are written to {results.path} as they finish", flush=True)
    with common.Workers(Path(__file__)) as workers:
        for rnd, kind, backend, load, engine_threads in tqdm(run_list(args), desc="training runs", unit="run"):
            key = (rnd, kind, backend, load, engine_threads)
            if results.has(key):
                continue
            spec = {
                "trainer": kind, "backend": backend, "model": args.model, "device": args.device, "dtype": args.dtype,
                "prompts": args.prompts, "num_generations": args.num_generations,
                "max_completion_length": args.max_completion_length, "steps": args.steps, "warmup": args.warmup,
                "eos_logit_bias": args.eos_logit_bias, "tail_tokens": args.tail_tokens, "seed": args.seed,
                "max_staleness": args.max_staleness, "prefetch_depth": args.prefetch_depth, "threads": args.threads,
                "server_threads": args.server_threads, "trainer_threads": args.trainer_threads, "reward": args.reward,
                "engine_threads": engine_threads, "output_dir": f"/tmp/trl_cb_bench_{kind}_{backend}",
                "native_memory_percent": args.native_memory_percent,
            }  # fmt: skip
            with common.background_load(load):
                try:
                    results.add(key, workers.run(spec, group=None, timeout=args.timeout))
                except common.WorkerError as err:
                    results.fail(key, str(err))
    return results.finish(lambda payload: print_table(payload["summary"]))


if __name__ == "__main__":
    main()
