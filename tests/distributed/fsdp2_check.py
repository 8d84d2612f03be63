"""FSDP2 (`fully_shard`) adapter check on 2 CPU processes (gloo), launched with torchrun by test_distributed.py.

accelerate only turns FSDP on for GPU-class backends (on CPU it runs MULTI_CPU and leaves the model whole), so on a
CPU machine the trainer path cannot shard with FSDP2; this check drives the adapter on a model sharded by hand, the
way accelerate shards it on GPUs. Each rank samples different prompts with a different `max_new_tokens` (ranks run
a different number of engine forwards), then: logprobs vs a teacher-forced pass through the sharded model (full
weights, one forward per rank), parameters sharded again, an optimizer step, and the same after it (fresh weights).

`--bf16 cast`: fp32 shards, the generator casts (`cast_dtype=bfloat16`, what the trainers pass for `bf16=True`):
each round makes a transient bf16 copy of the unsharded parameters (sharded: not kept). `--bf16 mp`: what accelerate
builds for FSDP2 with `mixed_precision="bf16"` (fp32 shards, `MixedPrecisionPolicy(param_dtype=bf16, ...)`): the
unsharded parameters are bf16 already. Either way the reference forward runs as the trainer's would (autocast /
the policy), and the report adds the shards' dtype, whether the optimizer step moved them, the dtype the engine's
forwards saw, and the copy bytes held between rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig

from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine.precision import GenerationPrecision
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model, tiny_tokenizer


def teacher_forced_gaps(model, tokenizer, prompts, result, group: int) -> tuple[float, float]:
    """The largest and the mean |engine logprob - teacher-forced logprob| over the sampled tokens."""
    rows = [prompts[i // group] + c for i, c in enumerate(result.completion_ids)]
    batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt")  # left padding: one forward per rank
    with torch.no_grad():
        logprobs = torch.log_softmax(model(**batch).logits.float(), dim=-1)  # (B, L, V)
    gaps, width = [], batch["input_ids"].shape[1]
    for i, completion in enumerate(result.completion_ids):
        start = width - len(completion)  # completion tokens sit at the right end of the row
        ref = logprobs[i, start - 1 : width - 1].gather(-1, torch.tensor(completion)[:, None])[:, 0]
        gaps.append((ref - torch.tensor(result.logprobs[i])).abs())
    every = torch.cat(gaps)
    return every.max().item(), every.mean().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--bf16", choices=["cast", "mp"], default=None)
    parser.add_argument("--architecture", default="qwen2", choices=["qwen2", "qwen3_5"], help="qwen3_5: hybrid")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, architecture=args.architecture, eos_logit_bias=4.0)
    policy = {}
    if args.bf16 == "mp":  # accelerate's FSDP2 policy for mixed_precision="bf16" (utils/dataclasses.py)
        bf16 = torch.bfloat16
        policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)}
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    # The trainer's forward: fp32 (no flag), autocast (bf16 with fp32 shards), or the policy's own cast (mp).
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16 == "cast")
    seen: list[torch.dtype] = []
    q_proj = next(layer.self_attn.q_proj for layer in model.model.layers if hasattr(layer, "self_attn"))
    q_proj.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))  # read right after each round
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in synthetic_gsm8k(3, seed=10 + rank)]
    cfg = GenerationConfig(
        do_sample=True, top_k=0, top_p=1.0, max_new_tokens=16 + 12 * rank,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    report: dict = {"rank": rank, "world_size": dist.get_world_size(), "rounds": []}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cast_dtype = torch.bfloat16 if args.bf16 else None
    # Bytes of the module's tensors pointed at generation copies in each round (their storage moved inside `applied`).
    copied: list[int] = []
    real_applied = GenerationPrecision.applied

    @contextlib.contextmanager
    def measured_applied(self, module):
        tensors = [*module.parameters(), *module.buffers()]
        before = [t.data_ptr() for t in tensors]
        with real_applied(self, module):
            copied.append(sum(t.numel() * t.element_size() for t, b in zip(tensors, before) if t.data_ptr() != b))
            yield

    GenerationPrecision.applied = measured_applied
    with ContinuousBatchingGenerator(model, cfg, timeout=60, cast_dtype=cast_dtype) as gen:
        for _ in range(2):
            seen.clear()
            result = gen.generate(prompts, num_generations=2)
            engine_dtypes = sorted({str(d) for d in seen})
            sharded = all(isinstance(p, DTensor) for p in model.parameters())
            with autocast:
                diff, mean_diff = teacher_forced_gaps(model, tokenizer, prompts, result, 2)
            shard = q_proj.weight.to_local().detach().clone()
            batch = torch.tensor([prompts[0][:16]])  # a training step on the sharded model
            with autocast:
                loss = model(batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with autocast:  # control: the same samples against the weights after the step (a sampler that is wrong)
                control_diff, control_mean = teacher_forced_gaps(model, tokenizer, prompts, result, 2)
            report["rounds"].append(
                {
                    "max_diff": diff, "mean_diff": mean_diff, "control_max_diff": control_diff,
                    "control_mean_diff": control_mean, "sharded_after": sharded, "n": len(result.completion_ids),
                    "engine_dtypes": engine_dtypes, "copy_bytes_between_rounds": gen.generation_copy_bytes,
                    "copy_bytes_in_round": copied[-1],
                    "param_bytes_bf16": 2 * sum(p.numel() for p in model.parameters()),
                    "shard_dtypes": sorted({str(p.to_local().dtype) for p in model.parameters()}),
                    "step_moved_shard": not torch.equal(shard, q_proj.weight.to_local()),
                }
            )  # fmt: skip
        report["engine_builds"] = gen.num_engine_builds
    report["sharded_at_end"] = all(isinstance(p, DTensor) for p in model.parameters())
    Path(args.report, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
