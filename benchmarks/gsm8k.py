"""The seed comparison: rollouts of GSM8K-shaped rounds with trl_cb, TRL's native CB call and plain `generate()`.

    pip install -e . && python benchmarks/gsm8k.py            # offline default: tiny Qwen2, CPU, 4-6 min on 2 cores
    python benchmarks/gsm8k.py --quick                        # 1-1.5 min, for smoke tests
    python benchmarks/gsm8k.py --quick --native-memory-percent 0.02   # ~35 s: TRL's CB path sized from 2% of RAM
    python benchmarks/gsm8k.py --model small --num-generations 32 64   # 8 layers x 256 wide, CPU: compute-heavier
    python benchmarks/gsm8k.py --model llama-1b-random --device cuda --max-new-tokens 512 --num-generations 8 32 64
    python benchmarks/gsm8k.py --model tiny-qwen3.5     # Qwen3.5's hybrid layout (qwen3.5-0.8b-random: GPU size)
    python benchmarks/gsm8k.py --model Qwen/Qwen2.5-0.5B-Instruct --data-file gsm8k/test.jsonl --device cuda

Prompts: the GSM8K test split shipped with trl_cb (`offline.data.gsm8k_test`, a seeded sample), chat-formatted when
the tokenizer has a chat template; `--data-file` / `--dataset` replace it.

Backends (same prompts and sampling settings; `top_k` set explicitly because `generate()` adds top_k=50 if unset):
- `generate`: left-padded `model.generate`, as TRL's default path calls it (one padded batch of P x N rows).
- `trl_native`: `model.generate_batch` as TRL's built-in CB path calls it: a fresh manager every round,
  `max_memory_percent=0.5` (`--native-memory-percent`), no cache sizing, no logprobs, train mode restored after it.
- `trl_cb`: trl_cb's `ContinuousBatchingGenerator` (persistent, workload-sized, prefill shared per prompt, logprobs);
  `--cb-config JSON` adds engine settings (`transformers_continuous_batching_config` keys).
- `trl_cb_no_graphs`: the same with `{"use_cuda_graph": false}` (CUDA: the decode steps without CUDA graphs).
Default: the first three on CPU, all four on CUDA.

Workloads: the long-tailed sweep over `--num-generations` (the small presets' EOS bias; `llama-1b-random`'s calibrated
GSM8K-like tail, p90 at 0.7x `--max-new-tokens`: `common.calibrate_tail`), then no-tail points at
`--no-tail-generations` (EOS not boosted: nearly every completion runs to `--max-new-tokens`, so `generate()` has
little padding to waste and the per-token cost decides). The table shows each point's lengths (p50, p90, max, share
at the cap).

Each backend runs in its own process (`common.Workers`), kept across its points (one model build per backend) except
`trl_native` on CPU, whose unsized cache leaves a process slow: a process per point. Per point: one warm-up round,
then `--repeats` timed rounds, each on a fresh slice of P prompts. Every point is written to the JSON (and PNG) as
soon as it is measured; `--resume FILE` completes an interrupted run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import plots  # noqa: E402

BACKENDS = ("generate", "trl_native", "trl_cb", "trl_cb_no_graphs")
CPU_BACKENDS = BACKENDS[:3]
#: Engine settings of each trl_cb backend, on top of `--cb-config`.
CB_BACKENDS = {"trl_cb": {}, "trl_cb_no_graphs": {"use_cuda_graph": False}}

# ------------------------------------------------------------------------------------------------------ worker

_MODELS: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _model(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The point's model, built once per worker process and workload (the tail is part of the model)."""
    key = (spec["model"], spec["device"], spec["dtype"], spec["eos_logit_bias"], spec["tail_tokens"])
    if key not in _MODELS:
        _MODELS.clear()  # one model at a time in a process
        model, tokenizer = common.load_model(*key)
        tokenizer.padding_side = "left"
        _MODELS[key] = (model, tokenizer)
    return _MODELS[key]


def _prompts(spec: dict[str, Any], tokenizer: Any, count: int) -> list[list[int]]:
    from trl_cb.offline.data import GSM8KScriptArguments, load_prompts, tokenize_prompt

    args = GSM8KScriptArguments(
        data_file=spec["data_file"], dataset_name=spec["dataset"], num_examples=count,
        conversational=tokenizer.chat_template is not None,
    )  # fmt: skip
    return [tokenize_prompt(tokenizer, r["prompt"]) for r in load_prompts(args, seed=spec["seed"])]


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """One (workload, N, backend) point: a warm-up round, then `repeats` timed rounds."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from trl_cb import ContinuousBatchingGenerator

    model, tokenizer = _model(spec)
    model.eval()
    backend = spec["backend"]
    P, N, repeats = spec["prompts_per_round"], spec["num_generations"], spec["repeats"]
    pool = _prompts(spec, tokenizer, P * (1 + repeats))
    eos = tokenizer.eos_token_id
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=spec["max_new_tokens"],
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        memory_before = torch.cuda.memory_allocated()
    else:
        memory_before = common.reset_peak_rss()
    generator = None
    if backend in CB_BACKENDS:
        engine = {**spec["cb_config"], **CB_BACKENDS[backend]}
        generator = ContinuousBatchingGenerator(model, gen_cfg, continuous_batching_config=engine)
    times, tokens, lengths, pad_fractions = [], [], [], []
    for r in range(1 + repeats):
        prompts = pool[r * P : (r + 1) * P]
        rows = [p for p in prompts for _ in range(N)]  # TRL hands each prompt N times
        torch.manual_seed(spec["seed"] + r)
        start = time.perf_counter()
        if backend == "generate":
            batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt").to(spec["device"])
            with torch.no_grad():
                out = model.generate(**batch, generation_config=gen_cfg)
            completions = [_until_eos(row, eos) for row in out[:, batch["input_ids"].shape[1] :].tolist()]
            slots = out.shape[0] * (out.shape[1] - batch["input_ids"].shape[1])
        elif backend == "trl_native":
            outputs = model.generate_batch(
                rows, generation_config=gen_cfg, progress_bar=False,
                continuous_batching_config=ContinuousBatchingConfig(max_memory_percent=spec["native_memory_percent"]),
            )  # fmt: skip
            model.train()  # TRL puts the model back in train mode after every CB call
            completions = [o.generated_tokens for o in outputs.values()]
        else:
            completions = generator.generate(rows, num_generations=1).completion_ids
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if len(completions) != len(rows):
            raise RuntimeError(f"{backend} returned {len(completions)} completions for {len(rows)} rows")
        if r == 0:
            continue  # warm-up (engine build, allocator, kernels)
        times.append(elapsed)
        tokens.append(sum(len(c) for c in completions))
        lengths.extend(len(c) for c in completions)
        if backend == "generate":
            pad_fractions.append(1.0 - tokens[-1] / max(slots, 1))
    if generator is not None:
        generator.close()
    if cuda:
        peak, kind = torch.cuda.max_memory_allocated() - memory_before, "cuda_max_allocated"
    else:
        peak, kind = common.peak_rss_bytes() - memory_before, "peak_rss_delta"
    return {
        "times": times, "tokens": tokens, "lengths": lengths, "peak_memory_bytes": peak, "peak_memory_kind": kind,
        "padding_fraction": sum(pad_fractions) / len(pad_fractions) if pad_fractions else None,
    }  # fmt: skip


# -------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"{' | '.join(common.PRESETS)} | hub id | path (default: tiny)")
    p.add_argument("--data-file", default=None, help="GSM8K JSONL (question/answer); default: GSM8K test (shipped)")
    p.add_argument("--dataset", default=None, help="hub dataset id, e.g. openai/gsm8k (needs network)")
    p.add_argument("--num-generations", type=int, nargs="+", default=[8, 32, 64], help="N values (samples/prompt)")
    p.add_argument("--prompts-per-round", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per point (after one warm-up round)")
    p.add_argument("--backends", nargs="+", default=None, choices=BACKENDS, help="default: see above")
    p.add_argument("--cb-config", type=json.loads, default={}, help="engine settings (JSON) for the trl_cb backends")
    common.add_native_memory_option(p)
    p.add_argument(
        "--eos-logit-bias", type=float, default=None,
        help="random presets: EOS logit boost (default: per preset; llama-1b-random: the calibrated tail)",
    )  # fmt: skip
    p.add_argument(
        "--no-tail-generations", type=int, nargs="*", default=[8],
        help="N values of the no-tail points (EOS not boosted); none to skip (default: 8)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800, help="seconds one point may take")
    args = common.parse(p, argv, "gsm8k")
    if args.worker or args.replot:
        return args
    if args.backends is None:
        args.backends = list(CPU_BACKENDS if args.device == "cpu" else BACKENDS)
    if args.quick:
        args.num_generations, args.prompts_per_round, args.max_new_tokens, args.repeats = [2, 4], 2, 16, 1
        args.no_tail_generations = [2] if args.no_tail_generations else []
    for name in ("prompts_per_round", "max_new_tokens", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("num_generations", "no_tail_generations"):
        if any(n <= 0 for n in getattr(args, name)):
            p.error(f"--{name.replace('_', '-')} values must be > 0, got {getattr(args, name)}")
    if args.data_file is not None and not Path(args.data_file).is_file():
        p.error(f"--data-file not found: {args.data_file}")
    args.backends = common.without_native_for_hybrids(args.model, args.backends)
    return args


def todo(args: argparse.Namespace) -> list[tuple[str, int, str, dict[str, Any]]]:
    """(workload, N, backend, model settings) per point: the sweep, then the no-tail points (TRL's native CB path
    left out there: minutes per point from its unsized cache, nothing it would show)."""
    preset = args.model in common.PRESETS
    if not preset:
        sweep = ("model_eos", {"eos_logit_bias": None, "tail_tokens": None})
    else:
        tail = common.length_tail(args.model, args.eos_logit_bias, args.max_new_tokens)
        sweep = ("long_tail" if tail["eos_logit_bias"] or tail["tail_tokens"] else "no_tail", tail)
    points = [(sweep[0], n, b, sweep[1]) for n in args.num_generations for b in args.backends]
    no_tail = {"eos_logit_bias": None if args.model in common.FULL_SIZE_PRESETS else 0.0, "tail_tokens": None}
    no_tail_backends = [b for b in args.backends if b != "trl_native"] if preset else []
    return points + [("no_tail", n, b, no_tail) for n in args.no_tail_generations for b in no_tail_backends]


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per point: round time, tokens/s, speed against `generate()` at the same (workload, N), memory, lengths."""
    rows = []
    for p in points:
        workload, n, backend = p["key"]
        base = next((x for x in points if x["key"] == [workload, n, "generate"]), None)
        time_stats = common.summarize(p["times"])
        rows.append(
            {
                "workload": workload, "num_generations": n, "backend": backend, "round_time_s": time_stats,
                "tokens_per_s": common.summarize([t / s for t, s in zip(p["tokens"], p["times"])]),
                "speedup_vs_generate": common.summarize(base["times"])["mean"] / time_stats["mean"] if base else None,
                "peak_memory_mib": p["peak_memory_bytes"] / 2**20, "peak_memory_kind": p["peak_memory_kind"],
                "padding_fraction": p["padding_fraction"],
                "completion_length": common.length_stats(p["lengths"], cap=p["max_new_tokens"]),
            }
        )  # fmt: skip
    return {"summary": rows}


def print_table(summary: list[dict[str, Any]]) -> None:
    rows = [
        {
            "workload": s["workload"].replace("_", " "), "N": s["num_generations"], "backend": s["backend"],
            "time": s["round_time_s"]["mean"], "std": s["round_time_s"]["std"], "tok_s": s["tokens_per_s"]["mean"],
            "speedup": s["speedup_vs_generate"], "mem": s["peak_memory_mib"], "pad": s["padding_fraction"],
            **{k: s["completion_length"][k] for k in ("p50", "p90", "max", "at_cap")},
        }
        for s in summary
    ]  # fmt: skip
    columns = [("workload", "workload"), ("N", "N"), ("backend", "backend"), ("time", "s/round"), ("std", "±std"),
               ("tok_s", "tok/s"), ("speedup", "vs generate"), ("mem", "peak MiB"), ("pad", "pad frac"),
               ("p50", "len p50"), ("p90", "len p90"), ("max", "len max"), ("at_cap", "at cap")]  # fmt: skip
    print(common.format_table(rows, columns))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if common.other_mode(args, run_point, plots.render_gsm8k):
        return {}
    from tqdm import tqdm

    default_run = args.model == "tiny" and args.device == "cpu" and not args.quick and args.resume is None
    print(
        f"trl_cb GSM8K rollout benchmark: model={args.model} device={args.device} N={args.num_generations} "
        f"prompts/round={args.prompts_per_round} max_new_tokens={args.max_new_tokens} backends={args.backends}"
        + (" — 4 to 6 minutes on 2 quiet CPU cores, 5 to 15 on a busy machine." if default_run else ""),
        flush=True,
    )
    results = common.ResultFile("gsm8k", args, summarize, plots.render_gsm8k)
    print(f"points are written to {results.path} as they are measured", flush=True)
    with common.Workers(Path(__file__)) as workers:
        for workload, n, backend, model in tqdm(todo(args), desc="benchmark points", unit="point"):
            key = (workload, n, backend)
            if results.has(key):
                continue
            spec = {
                "backend": backend, "num_generations": n, "repeats": args.repeats, "model": args.model,
                "device": args.device, "dtype": args.dtype, "prompts_per_round": args.prompts_per_round,
                "max_new_tokens": args.max_new_tokens, "seed": args.seed, "data_file": args.data_file,
                "dataset": args.dataset, "cb_config": args.cb_config,
                "native_memory_percent": args.native_memory_percent, **model,
            }  # fmt: skip
            fresh = backend == "trl_native" and args.device == "cpu"  # its unsized cache leaves the process slow
            try:
                measured = workers.run(spec, group=None if fresh else backend, timeout=args.timeout)
            except common.WorkerError as err:
                results.fail(key, str(err))
                continue
            results.add(key, {**model, "max_new_tokens": args.max_new_tokens, **measured})
    return results.finish(lambda payload: print_table(payload["summary"]))


if __name__ == "__main__":
    main()
