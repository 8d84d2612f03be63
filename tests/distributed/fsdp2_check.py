"""FSDP2 (`fully_shard`) adapter check on 2 CPU processes (gloo), launched with torchrun by test_distributed.py.

accelerate only turns FSDP on for GPU-class backends (on CPU it runs MULTI_CPU and leaves the model whole), so on a
CPU machine the trainer path cannot shard with FSDP2; this check drives the adapter on a model sharded by hand, the
way accelerate shards it on GPUs. Each rank samples different prompts with a different `max_new_tokens` (ranks run
a different number of engine forwards), then: logprobs vs a teacher-forced pass through the sharded model (full
weights, one forward per rank), parameters sharded again, an optimizer step, and the same after it (fresh weights).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig

from trl_cb import ContinuousBatchingGenerator
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model, tiny_tokenizer


def teacher_forced_max_diff(model, tokenizer, prompts, result, group: int) -> float:
    rows = [prompts[i // group] + c for i, c in enumerate(result.completion_ids)]
    batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt")  # left padding: one forward per rank
    with torch.no_grad():
        logprobs = torch.log_softmax(model(**batch).logits.float(), dim=-1)  # (B, L, V)
    worst, width = 0.0, batch["input_ids"].shape[1]
    for i, completion in enumerate(result.completion_ids):
        start = width - len(completion)  # completion tokens sit at the right end of the row
        ref = logprobs[i, start - 1 : width - 1].gather(-1, torch.tensor(completion)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(result.logprobs[i])).abs().max().item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, eos_logit_bias=4.0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in synthetic_gsm8k(3, seed=10 + rank)]
    cfg = GenerationConfig(
        do_sample=True, top_k=0, top_p=1.0, max_new_tokens=16 + 12 * rank,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    report: dict = {"rank": rank, "world_size": dist.get_world_size(), "rounds": []}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with ContinuousBatchingGenerator(model, cfg, timeout=60) as gen:
        for _ in range(2):
            result = gen.generate(prompts, num_generations=2)
            sharded = all(isinstance(p, DTensor) for p in model.parameters())
            diff = teacher_forced_max_diff(model, tokenizer, prompts, result, 2)
            report["rounds"].append({"max_diff": diff, "sharded_after": sharded, "n": len(result.completion_ids)})
            batch = torch.tensor([prompts[0][:16]])  # a training step on the sharded model
            model(batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        report["engine_builds"] = gen.num_engine_builds
    report["sharded_at_end"] = all(isinstance(p, DTensor) for p in model.parameters())
    Path(args.report, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
