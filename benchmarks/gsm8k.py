"""GSM8K-shaped rollout benchmark: continuous batching (trl_cb, TRL's native CB call) vs plain `generate()`.

    pip install -e . && python benchmarks/gsm8k.py            # offline default: tiny Qwen2, CPU, 4-6 min, 2 cores
    python benchmarks/gsm8k.py --quick                        # seconds, for smoke tests
    python benchmarks/gsm8k.py --model small --num-generations 32 64   # 8 layers x 256 wide, CPU: compute-heavier
    python benchmarks/gsm8k.py --model llama-1b-random --device cuda --max-new-tokens 2048 --num-generations 8 32 64
    python benchmarks/gsm8k.py --model tiny-qwen3.5     # Qwen3.5's hybrid layout (qwen3.5-0.8b-random: GPU size)
    python benchmarks/gsm8k.py --model Qwen/Qwen2.5-0.5B-Instruct --data-file gsm8k/test.jsonl --device cuda

Prompts: the GSM8K test split shipped with trl_cb (`offline.data.gsm8k_test`, a seeded sample), chat-formatted when
the tokenizer has a chat template; `--data-file` / `--dataset` replace it.

Backends (same prompts, same sampling settings, `top_k` set explicitly because `generate()` adds top_k=50 if unset):
- `generate`: left-padded `model.generate`, as TRL's default path calls it (one padded batch of P x N rows).
- `trl_native`: `model.generate_batch` as TRL's built-in CB path calls it: a fresh manager every round,
  `max_memory_percent=0.5`, no cache sizing, no logprobs. Left out for the hybrid presets (`HYBRID_PRESETS`):
  transformers' engine refuses their linear-attention layers.
- `trl_cb`: trl_cb's `ContinuousBatchingGenerator` (persistent, workload-sized, prefill shared per prompt, logprobs).

Workloads: the long-tailed sweep over `--num-generations` (the preset's EOS bias: completion lengths spread out, and
`generate()` pads every row to the longest), then no-tail points at `--no-tail-generations` (EOS bias 0: nearly every
completion runs to `--max-new-tokens`, so `generate()` has little padding to waste and CB's per-token cost decides).

Each (backend, N) point runs in its own subprocess (see benchmarks/common.py): one warm-up round, then `--repeats`
timed rounds, each on a fresh slice of P prompts. Outputs: a table on stdout, a JSON file and a PNG under `--out`
(default runs/benchmarks/ at the repository root, git-ignored; the results the docs cite are recorded with
`--out benchmarks/results`), and the JSON document as the last stdout line. `benchmarks/plot.py` redraws the PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    CPU_PRESETS,
    DEFAULT_OUT,
    EOS_BIAS,
    HYBRID_PRESETS,
    OUT_HELP,
    cpu_preset,
    environment,
    format_table,
    llama_1b_random,
    peak_rss_bytes,
    percentile,
    qwen3_5_08b_random,
    run_worker,
    summarize,
    write_json,
)

BACKENDS = ("generate", "trl_native", "trl_cb")
PRESETS = (*CPU_PRESETS, "llama-1b-random", "qwen3.5-0.8b-random")


# ------------------------------------------------------------------------------------------------------ worker


def _load_model(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = spec["device"]
    dtype = getattr(torch, spec["dtype"])
    name = spec["model"]
    if name in CPU_PRESETS:
        model, tokenizer = cpu_preset(name, spec["eos_logit_bias"], dtype)
    elif name == "llama-1b-random":
        model, tokenizer = llama_1b_random(dtype, device, spec["eos_logit_bias"])
    elif name == "qwen3.5-0.8b-random":
        model, tokenizer = qwen3_5_08b_random(dtype, device, spec["eos_logit_bias"])
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer


def _prompts(spec: dict[str, Any], tokenizer: Any, count: int) -> list[list[int]]:
    from trl_cb.offline.data import GSM8KScriptArguments, load_prompts, tokenize_prompt

    args = GSM8KScriptArguments(
        data_file=spec["data_file"], dataset_name=spec["dataset"], num_examples=count,
        conversational=tokenizer.chat_template is not None,
    )  # fmt: skip
    return [tokenize_prompt(tokenizer, r["prompt"]) for r in load_prompts(args, seed=spec["seed"])]


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One (backend, N) point: warm-up + repeats; returns the raw measurements."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from trl_cb import ContinuousBatchingGenerator

    model, tokenizer = _load_model(spec)
    P, N, warmup, repeats = spec["prompts_per_round"], spec["num_generations"], spec["warmup"], spec["repeats"]
    pool = _prompts(spec, tokenizer, P * (warmup + repeats))
    eos = tokenizer.eos_token_id
    gen_cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=spec["max_new_tokens"],
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    generator = None
    if spec["backend"] == "trl_cb":
        generator = ContinuousBatchingGenerator(model, gen_cfg)
    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mem_before = torch.cuda.memory_allocated()
    rss_before = peak_rss_bytes()
    times, tokens, lengths, pad_fractions = [], [], [], []
    for r in range(warmup + repeats):
        prompts = pool[r * P : (r + 1) * P]
        rows = [p for p in prompts for _ in range(N)]  # TRL hands each prompt N times
        torch.manual_seed(spec["seed"] + r)
        start = time.perf_counter()
        if spec["backend"] == "generate":
            batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt").to(spec["device"])
            with torch.no_grad():
                out = model.generate(**batch, generation_config=gen_cfg)
            completions = [_until_eos(row, eos) for row in out[:, batch["input_ids"].shape[1] :].tolist()]
            slots = out.shape[0] * (out.shape[1] - batch["input_ids"].shape[1])
        elif spec["backend"] == "trl_native":
            outputs = model.generate_batch(
                rows,
                generation_config=gen_cfg,
                continuous_batching_config=ContinuousBatchingConfig(max_memory_percent=0.5),
                progress_bar=False,
            )
            model.train()  # TRL puts the model back in train mode after every CB call
            completions = [o.generated_tokens for o in outputs.values()]
        else:
            completions = generator.generate(rows, num_generations=1).completion_ids
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if len(completions) != len(rows):
            raise RuntimeError(f"{spec['backend']} returned {len(completions)} completions for {len(rows)} rows")
        if r < warmup:
            continue
        n_tokens = sum(len(c) for c in completions)
        times.append(elapsed)
        tokens.append(n_tokens)
        lengths.extend(len(c) for c in completions)
        if spec["backend"] == "generate":
            pad_fractions.append(1.0 - n_tokens / max(slots, 1))
    if generator is not None:
        generator.close()
    peak = torch.cuda.max_memory_allocated() - mem_before if cuda else peak_rss_bytes() - rss_before
    return {
        "backend": spec["backend"],
        "num_generations": N,
        "completions_per_round": P * N,
        "times": times,
        "tokens": tokens,
        "lengths": lengths,
        "peak_memory_bytes": peak,
        "peak_memory_kind": "cuda_max_allocated" if cuda else "peak_rss_delta",
        "padding_fraction": (sum(pad_fractions) / len(pad_fractions)) if pad_fractions else None,
    }


# -------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"{' | '.join(PRESETS)} | hub id | local path (default: tiny)")
    p.add_argument("--data-file", default=None, help="GSM8K JSONL (question/answer); default: GSM8K test (vendored)")
    p.add_argument("--dataset", default=None, help="hub dataset id, e.g. openai/gsm8k (needs network)")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (default)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--num-generations", type=int, nargs="+", default=[8, 32, 64], help="N values (samples/prompt)")
    p.add_argument("--prompts-per-round", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per point (after one warm-up round)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"subset of {BACKENDS}")
    p.add_argument(
        "--eos-logit-bias", type=float, default=None, help="random presets: EOS logit boost (default: per preset)"
    )
    p.add_argument(
        "--no-tail-generations",
        type=int,
        nargs="*",
        default=[8],
        help="N values of the no-tail points (EOS bias 0: every completion runs to --max-new-tokens on the random "
        "presets, so generate() pads little); none to skip (default: 8)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--quick", action="store_true", help="tiny sweep in seconds (smoke test; not for numbers)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return args
    if args.eos_logit_bias is None:
        args.eos_logit_bias = EOS_BIAS.get(args.model, 4.0)
    if args.quick:
        args.num_generations, args.prompts_per_round, args.max_new_tokens, args.repeats = [2, 4], 2, 16, 1
        args.no_tail_generations = [2] if args.no_tail_generations else []
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        p.error(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    if args.model in HYBRID_PRESETS and "trl_native" in args.backends:
        print(f"{args.model}: trl_native left out (transformers' own CB engine refuses linear-attention layers)")
        args.backends = [b for b in args.backends if b != "trl_native"]
    for name, value in (("--prompts-per-round", args.prompts_per_round), ("--max-new-tokens", args.max_new_tokens),
                        ("--repeats", args.repeats)):  # fmt: skip
        if value <= 0:
            p.error(f"{name} must be > 0, got {value}")
    for name, values in (("--num-generations", args.num_generations), ("--no-tail-generations",
                                                                        args.no_tail_generations)):  # fmt: skip
        if any(n <= 0 for n in values):
            p.error(f"{name} values must be > 0, got {values}")
    if args.data_file is not None and not Path(args.data_file).is_file():
        p.error(f"--data-file not found: {args.data_file}")
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    from plot import render
    from tqdm import tqdm

    default_run = args.model == "tiny" and args.device == "cpu" and not args.quick
    print(
        f"trl_cb GSM8K rollout benchmark: model={args.model} device={args.device} N={args.num_generations} "
        f"prompts/round={args.prompts_per_round} max_new_tokens={args.max_new_tokens} backends={args.backends}"
        + (" — 4 to 6 minutes on 2 quiet CPU cores, 5 to 15 on a busy machine." if default_run else ""),
        flush=True,
    )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"}
    # The sweep (long-tailed with the presets' EOS bias; a hub model's own EOS), then the no-tail points (EOS bias 0
    # on the random presets: the baseline's best case, little padding to save). TRL's native CB path is left out of
    # the latter (minutes per point from its unsized cache, nothing it would show there).
    main_workload = "long_tail" if args.eos_logit_bias else "no_tail"
    main_workload = main_workload if args.model in EOS_BIAS else "model_eos"
    points = [(main_workload, args.eos_logit_bias, n, b) for n in args.num_generations for b in args.backends]
    no_tail_backends = [b for b in args.backends if b != "trl_native"] if args.model in EOS_BIAS else []
    points += [("no_tail", 0.0, n, b) for n in args.no_tail_generations for b in no_tail_backends]
    raw: list[dict[str, Any]] = []
    for workload, eos_bias, n, backend in tqdm(points, desc="benchmark points", unit="point"):
        spec = {
            "backend": backend, "num_generations": n, "warmup": 1, "repeats": args.repeats, "model": args.model,
            "device": args.device, "dtype": args.dtype, "prompts_per_round": args.prompts_per_round,
            "max_new_tokens": args.max_new_tokens, "eos_logit_bias": eos_bias, "seed": args.seed,
            "data_file": args.data_file, "dataset": args.dataset,
        }  # fmt: skip
        raw.append({"workload": workload, **run_worker(Path(__file__), spec, timeout=3600)})

    points_out = []
    for r in raw:
        base = next(
            (
                x
                for x in raw
                if x["backend"] == "generate"
                and x["num_generations"] == r["num_generations"]
                and x["workload"] == r["workload"]
            ),
            None,
        )
        time_stats = summarize(r["times"])
        points_out.append(
            {
                "workload": r["workload"],
                "backend": r["backend"],
                "num_generations": r["num_generations"],
                "completions_per_round": r["completions_per_round"],
                "round_time_s": time_stats,
                "tokens_per_s": summarize([t / s for t, s in zip(r["tokens"], r["times"])]),
                "speedup_vs_generate": (summarize(base["times"])["mean"] / time_stats["mean"]) if base else None,
                "peak_memory_mib": r["peak_memory_bytes"] / 2**20,
                "peak_memory_kind": r["peak_memory_kind"],
                "padding_fraction": r["padding_fraction"],
                "completion_length": {
                    "p50": percentile(r["lengths"], 50),
                    "p90": percentile(r["lengths"], 90),
                    "max": max(r["lengths"]),
                    "mean": sum(r["lengths"]) / len(r["lengths"]),
                },
                "num_completions": len(r["lengths"]),
            }
        )
    payload = {"benchmark": "gsm8k", "config": config, "env": environment(args.device), "points": points_out}
    rows = [
        {
            "workload": p["workload"].replace("_", " "), "N": p["num_generations"], "backend": p["backend"],
            "time": p["round_time_s"]["mean"], "std": p["round_time_s"]["std"], "tok_s": p["tokens_per_s"]["mean"],
            "speedup": p["speedup_vs_generate"],
            "mem": p["peak_memory_mib"], "pad": p["padding_fraction"], "p50": p["completion_length"]["p50"],
            "p90": p["completion_length"]["p90"], "max": p["completion_length"]["max"],
        }
        for p in points_out
    ]  # fmt: skip
    print(
        format_table(
            rows,
            [
                ("workload", "workload"),
                ("N", "N"),
                ("backend", "backend"),
                ("time", "s/round"),
                ("std", "±std"),
                ("tok_s", "tok/s"),
                ("speedup", "vs generate"),
                ("mem", "peak MiB"),
                ("pad", "pad frac"),
                ("p50", "len p50"),
                ("p90", "len p90"),
                ("max", "len max"),
            ],
        )  # fmt: skip
    )
    json_path = write_json(payload, args.out, "gsm8k")
    png_path = render(json_path, json_path.with_suffix(".png"))
    print(f"results: {json_path}\nplot: {png_path}")
    print(json.dumps(payload))
    return payload


if __name__ == "__main__":
    main()
