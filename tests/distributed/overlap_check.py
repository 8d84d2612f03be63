"""DDP with `cb_async_overlap=True` on 2 CPU processes (gloo), launched with torchrun by test_distributed.py.

Each rank trains GRPO for `--steps` optimizer steps on the tiny model with the engine generating on its view of the
DDP module's parameters during forward and backward (accelerate wraps the model in `DistributedDataParallel`; the
engine's forwards run the view, never DDP's wrapper, so they take no part in its gradient all-reduce). Per rank the
report holds: the wrapper's type, the controller's type, each take's policy version and every completion's per-token
versions, the IS metrics, a digest of the final weights and the max |difference| between the ranks' final weights
(all-gathered), and whether any engine thread is left.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    import trl_cb
    from trl_cb.offline.data import synthetic_gsm8k
    from trl_cb.offline.tiny import tiny_model, tiny_tokenizer

    config = trl_cb.GRPOConfig(
        output_dir=os.path.join(args.report, "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=16, max_steps=args.steps, logging_steps=1, learning_rate=1e-2, beta=0.0,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
        use_transformers_continuous_batching=True, top_k=0, top_p=1.0, cb_async_generation=True, cb_async_overlap=True,
        cb_async_overlap_engine_threads=1,
    )  # fmt: skip
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)  # no EOS bias: completions run to 16 tokens, updates land mid-request

    def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [len(c) / 50 for c in completions]

    trainer = trl_cb.GRPOTrainer(
        model=model, reward_funcs=length_reward, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_list(synthetic_gsm8k(32, seed=1)),
    )  # fmt: skip
    takes: list[dict[str, Any]] = []
    backends: list[str] = []
    original_take = trainer.rollouts.async_rollouts.take

    def recording_take(inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows = original_take(inputs)
        controller = trainer.rollouts.async_rollouts.source
        backends.append(type(controller.backend).__name__)
        versions = [[int(v) for v in seq] for g in trainer.rollouts.async_rollouts.step_groups for seq in g.versions]
        lengths = [len(c) for g in trainer.rollouts.async_rollouts.step_groups for c in g.completion_ids]
        takes.append({"policy_version": controller.policy_version, "versions": versions, "lengths": lengths})
        return rows

    trainer.rollouts.async_rollouts.take = recording_take
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    rank = dist.get_rank()
    report = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "wrapper": type(trainer.model_wrapped).__name__,
        "backends": sorted(set(backends)),
        "takes": takes,
        "max_staleness": trainer.rollouts.async_rollouts.max_staleness(),
        "logs": [e for e in trainer.state.log_history if "loss" in e],
        "weights_digest": weights_digest(trainer.model),
        "max_rank_weight_diff": max((g - flat).abs().max().item() for g in gathered),
        "num_changed": sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters()),
        "engine_threads_left": sum("_run_generation_loop" in repr(t) for t in threading.enumerate()),
        "controller_stopped": trainer.rollouts.async_rollouts.source is None,
    }
    Path(args.report, f"rank{rank}.json").write_text(json.dumps(report, indent=2))
    trainer.accelerator.wait_for_everyone()  # leave the process group together (see train_check.py)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
