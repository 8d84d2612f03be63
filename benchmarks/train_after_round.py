"""The trainer's forward + backward right after a CB round, against the same before any round (CPU target: <= 1.2x).

    python benchmarks/train_after_round.py                  # tiny preset, CPU: batch 32 x 112 tokens, 5 rounds
    python benchmarks/train_after_round.py --quick          # ~15 s smoke test
    python benchmarks/train_after_round.py --model small --rounds 3 --background-load 2

Why: the engine runs in the trainer's process; a round must not leave the trainer's next forward and backward slower
(an OpenMP team left spinning, the engine's intra-op thread count left in place, memory left fragmented:
`trl_cb/engine/openmp.py`). Method, in one process: a first untimed pass; then per round, `--repeats` timed forward +
backward passes of one training batch (random ids, `--batch` x `--seq-len`, the loss of a causal LM, gradients
zeroed, no optimizer step: the weights stay put), a CB round (`--prompts` x `--num-generations`, `--max-new-tokens`
each) through one persistent `ContinuousBatchingGenerator` as the trainer holds it, and the same passes again.
Reported: each round's median ms before and after and their ratio, and the median ratio over rounds (spread: min,
max). Results: a JSON in `--out` written after every round, and a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

#: The CPU target of the engine-loop work: a pass after a round at most this many times one before.
TARGET = 1.2


def _passes(model: Any, batch: Any, repeats: int) -> list[float]:
    """`repeats` timed forward + backward passes (ms), gradients zeroed after each."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        times.append(1000 * (time.perf_counter() - start))
        model.zero_grad(set_to_none=True)
    return times


def _summary(points: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [p["ratio"] for p in points]
    if not ratios:
        return {}
    return {"median_ratio": statistics.median(ratios), "spread": [min(ratios), max(ratios)], "target": TARGET}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=["null", "tiny", "small"], help="an offline preset")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="timed passes before and after each round")
    p.add_argument("--batch", type=int, default=32, help="training rows (8 prompts x G = 4)")
    p.add_argument("--seq-len", type=int, default=112, help="tokens per training row")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--background-load", type=int, default=0, help="busy-looping processes alongside")
    args = common.parse(p, argv, "train_after_round")
    if args.quick:
        args.rounds, args.repeats, args.batch, args.seq_len, args.max_new_tokens = 2, 2, 8, 32, 8
    if args.device != "cpu":
        p.error("--device: the target is a CPU one (on a GPU the engine's threads do not share the trainer's cores)")
    if min(args.rounds, args.repeats, args.batch, args.seq_len, args.prompts, args.max_new_tokens) < 1:
        p.error("--rounds, --repeats, --batch, --seq-len, --prompts and --max-new-tokens must be >= 1")

    import torch
    from transformers import GenerationConfig

    from trl_cb import ContinuousBatchingGenerator

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = common.load_model(args.model, device="cpu")
    model.train()
    rng = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(3, len(tokenizer), (args.batch, args.seq_len), generator=rng)
    prompts = torch.randint(3, len(tokenizer), (args.prompts, 16), generator=rng).tolist()
    cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    results = common.ResultFile("train_after_round", args, summarize=_summary)
    print(f"train after round: {args.model}, batch {args.batch} x {args.seq_len}, {args.rounds} rounds")
    with common.background_load(args.background_load), ContinuousBatchingGenerator(model, cfg) as gen:
        _passes(model, batch, 1)  # warm: the first pass allocates
        for i in range(args.rounds):
            before = statistics.median(_passes(model, batch, args.repeats))
            model.eval()
            gen.generate(prompts, num_generations=args.num_generations)
            model.train()
            after = statistics.median(_passes(model, batch, args.repeats))
            results.add([i], {"before_ms": before, "after_ms": after, "ratio": after / before})
            print(f"  round {i}: {before:.1f} ms before, {after:.1f} ms after: {after / before:.2f}x", flush=True)
    results.finish(_table)
    return 0


def _table(document: dict[str, Any]) -> None:
    low, high = document["spread"]
    print(f"median after / before: {document['median_ratio']:.2f}x (spread {low:.2f}-{high:.2f}; target <= {TARGET}x)")


if __name__ == "__main__":
    raise SystemExit(main())
