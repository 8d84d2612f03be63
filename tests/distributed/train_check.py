"""Multi-process check, launched by tests/distributed/test_distributed.py through `accelerate launch`.

Trains GRPO (or RLOO) with the CB flag for 2 steps on the tiny model and writes, per rank, a JSON report: the IS
metrics (whose `sampling_logp_difference/max` is the max over all ranks of |sampling logprob - teacher-forced logprob
with the full weights|, TRL's old-logprob forward running through the sharded/wrapped model), whether parameters
were sharded again after every generation round, and how many engines were built.

Under ZeRO-3 (launched with every parameter partitioned: persistence threshold 0) each round also records what the
gather did, per rank: which parameters were partitioned before the round and after it, and what the engine's forward
read during it (a forward pre-hook on every module holding parameters), compared with the same parameters gathered
independently (`deepspeed.zero.GatheredParameters`) just before the round and cast to the generation dtype.
`TRAIN_CHECK_BROKEN_GATHER=1` (read here only) replaces TRL's gather for generation with one that skips
`GatheredParameters`, to show these checks fail when generation runs on partitioned parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset


def params_sharded(model: torch.nn.Module) -> bool | None:
    """True when every parameter is back in its sharded form (ZeRO-3 partitioned / FSDP2 DTensor), None if the
    strategy does not shard parameters."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params) or _is_fsdp2(model):
        return all(isinstance(p, DTensor) for p in params)
    return None


def _is_fsdp2(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _full_trainable(trainer: Any) -> dict[str, torch.Tensor]:
    """Trainable parameters by name, gathered to full tensors (ZeRO-3, FSDP2) on every rank."""
    from torch.distributed.tensor import DTensor

    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}


def _partitioned(params: dict[str, torch.nn.Parameter], world_size: int) -> list[str]:
    """Names of the ZeRO-3 parameters with more than `world_size` elements that are held as this rank's partition
    only: not available, an empty local tensor, a partition smaller than the whole."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [
        n for n, p in params.items()
        if p.ds_numel > world_size and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
        and p.numel() < p.ds_numel and p.ds_tensor.numel() < p.ds_numel
    ]  # fmt: skip


class EngineReads:
    """What the CB engine's forwards read during a generation round: a forward pre-hook on every module holding
    parameters records, once per round, each parameter's shape and its max |difference| from `reference` (the
    parameters gathered independently before the round, cast to the generation dtype). A parameter not whole when any
    forward of the round starts fails that forward at once, with its name. A hybrid's token mixers read some of their
    children's weights directly (Gated DeltaNet's `conv1d.weight`, never called as a module): their hook checks their
    children's parameters too."""

    def __init__(self, module: torch.nn.Module) -> None:
        from trl_cb.engine._upstream_recurrent import mixer_modules, recurrent_layers

        self.reference: dict[str, torch.Tensor] | None = None
        self.seen: dict[str, dict[str, Any]] = {}
        config = module.config.get_text_config()
        mixers = set(mixer_modules(module, config).values()) if recurrent_layers(config) else set()
        for prefix, sub in module.named_modules():
            if sub in mixers:
                sub.register_forward_pre_hook(self._hook(prefix, recurse=True))
            elif any(p is not None for p in sub._parameters.values()):
                sub.register_forward_pre_hook(self._hook(prefix))

    def _hook(self, prefix: str, recurse: bool = False) -> Any:
        def hook(sub: torch.nn.Module, args: Any) -> None:
            if self.reference is None:  # outside generation rounds
                return
            children = sub.named_modules() if recurse else [("", sub)]
            parameters = [(f"{c}.{n}" if c else n, p) for c, child in children for n, p in child._parameters.items()]
            for name, param in parameters:
                full_name = f"{prefix}.{name}" if prefix else name
                if param is None:
                    continue
                # Read from the dict, not `getattr`: DeepSpeed's `ZeROOrderedDict` getter gathers a partitioned
                # parameter on access during a forward, which would hide a missing gather here.
                ref = self.reference[full_name]
                if param.shape != ref.shape:  # every forward of the round
                    raise AssertionError(
                        f"the engine's forward got {full_name} not whole: shape {tuple(param.shape)}, "
                        f"gathered {tuple(ref.shape)}"
                    )
                if full_name in self.seen:  # values: once per round (no optimizer step within a round)
                    continue
                diff = (param.detach().float() - ref.float()).abs().max().item()
                self.seen[full_name] = {"dtype": str(param.dtype), "max_diff": diff}

        return hook

    @contextlib.contextmanager
    def round(self, reference: dict[str, torch.Tensor]) -> Iterator[None]:
        self.reference, self.seen = reference, {}
        try:
            yield
        finally:
            self.reference = None


@contextlib.contextmanager
def _broken_unwrap(model: Any, accelerator: Any, **kwargs: Any) -> Iterator[Any]:
    """TRL's `unwrap_model_for_generation` for ZeRO-3 without its `GatheredParameters`: DeepSpeed's hooks removed
    as TRL does, the parameters left partitioned (the deliberately broken gather of `TRAIN_CHECK_BROKEN_GATHER`)."""
    from trl.models.utils import add_hooks, remove_hooks

    remove_hooks(model)
    try:
        yield accelerator.unwrap_model(model)
    finally:
        add_hooks(model)


def _master_dtypes(trainer: Any) -> list[str]:
    """Dtypes of the fp32 master copies DeepSpeed's ZeRO-3 optimizer keeps (empty for other strategies)."""
    optimizer = getattr(trainer.model_wrapped, "optimizer", None)
    flat = getattr(optimizer, "fp32_partitioned_groups_flat", None) or []
    return sorted({str(t.dtype) for t in flat})


#: Families built from tests/model_zoo.py (weights of std 0.2) rather than `trl_cb.offline.tiny`.
ZOO = ("gemma4_text", "deepseek_v3")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--trainer", default="grpo", choices=["grpo", "rloo"])
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16=True on an fp32-loaded model")
    parser.add_argument(
        "--architecture", default="qwen2", choices=["qwen2", "qwen3_5", *ZOO],
        help="qwen3_5: hybrid; gemma4_text / deepseek_v3: per-group cache geometry (tests/model_zoo.py)",
    )  # fmt: skip
    args = parser.parse_args()

    import trl_cb
    from trl_cb.offline.data import synthetic_gsm8k
    from trl_cb.offline.tiny import tiny_model, tiny_tokenizer

    config_cls = trl_cb.GRPOConfig if args.trainer == "grpo" else trl_cb.RLOOConfig
    trainer_cls = trl_cb.GRPOTrainer if args.trainer == "grpo" else trl_cb.RLOOTrainer
    use_cpu = not torch.cuda.is_available()
    config = config_cls(
        output_dir=os.path.join(args.report, "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=16, max_steps=2, logging_steps=1, learning_rate=1e-3, beta=0.0, bf16=args.bf16,
        use_cpu=use_cpu, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
        use_transformers_continuous_batching=True, top_k=0, top_p=1.0,
    )  # fmt: skip
    tokenizer = tiny_tokenizer()
    if args.architecture in ZOO:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.model_zoo
        from tests.model_zoo import SUPPORTED, tiny_arch_model

        arch = next(a for a in SUPPORTED if a.model_type == args.architecture)
        special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
        model = tiny_arch_model(arch, len(tokenizer), special)
    else:
        model = tiny_model(tokenizer, architecture=args.architecture, eos_logit_bias=4.0)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [len(c) / 50 for c in completions]

    trainer = trainer_cls(
        model=model, reward_funcs=length_reward, args=config, processing_class=tokenizer, peft_config=peft_config,
        train_dataset=Dataset.from_list(synthetic_gsm8k(32, seed=1)),
    )  # fmt: skip

    if os.environ.get("TRAIN_CHECK_BROKEN_GATHER") == "1":
        import trl.models.utils

        trl.models.utils.unwrap_model_for_generation = _broken_unwrap

    from trl_cb.rollouts.model_access import plain_module

    rounds: list[dict[str, Any]] = []
    builds: list[int] = []
    original = trainer.rollouts.generate
    generation_module = plain_module(trainer.model)  # the module the engine runs (PEFT: the base, adapters in it)
    engine_reads = EngineReads(generation_module)
    generation_dtype = torch.bfloat16 if args.bf16 else torch.float32

    def recording_generate(prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        params = dict(generation_module.named_parameters(remove_duplicate=False))
        zero3 = any(hasattr(p, "ds_id") for p in params.values())
        world_size = trainer.accelerator.num_processes
        zero3_round: dict[str, Any] = {}
        if zero3:
            import deepspeed

            zero3_round["num_large"] = sum(p.ds_numel > world_size for p in params.values())
            zero3_round["partitioned_before"] = _partitioned(params, world_size)
            with deepspeed.zero.GatheredParameters(list(params.values())):  # every rank, in the same order
                reference = {n: p.detach().to(generation_dtype, copy=True) for n, p in params.items()}
            with engine_reads.round(reference):
                completion_ids, logprobs = original(prompt_ids)
            zero3_round["partitioned_after"] = _partitioned(params, world_size)
            zero3_round["num_params"] = len(params)
            zero3_round["engine_read"] = len(engine_reads.seen)
            zero3_round["engine_dtypes"] = sorted({x["dtype"] for x in engine_reads.seen.values()})
            zero3_round["engine_max_diff"] = max((x["max_diff"] for x in engine_reads.seen.values()), default=None)
        else:
            completion_ids, logprobs = original(prompt_ids)
        rounds.append(
            {
                "num_prompts": len(prompt_ids),
                "num_completions": len(completion_ids),
                "lengths_match": all(len(c) == len(lp) for c, lp in zip(completion_ids, logprobs)),
                "sharded_after": params_sharded(trainer.model_wrapped),
                **zero3_round,
            }
        )
        builds.append(trainer.rollouts.generator.num_engine_builds)
        return completion_ids, logprobs

    trainer.rollouts.generate = recording_generate
    trained_before = {n: p.detach().float().clone() for n, p in _full_trainable(trainer).items()}
    trainer.train()
    trained_after = _full_trainable(trainer)

    rank = trainer.accelerator.process_index
    report = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "rounds": rounds,
        "engine_builds": builds[-1] if builds else 0,
        "logs": [e for e in trainer.state.log_history if "loss" in e],
        "generator_closed": trainer.rollouts.generator is None,
        # Module parameters by dtype, and the fp32 master weights where the strategy keeps them apart (ZeRO-3 with
        # bf16 holds the module in bf16 and the optimizer's fp32 partitions).
        "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "trainable_param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}),
        "master_dtypes": _master_dtypes(trainer),
        "num_trainable_changed": sum(
            not torch.equal(trained_before[n], trained_after[n].float()) for n in trained_before
        ),
        "num_trainable": len(trained_before),
    }
    Path(args.report, f"rank{rank}.json").write_text(json.dumps(report, indent=2))
    # Every rank leaves the process group before the interpreter exits: a rank that exits while the other still tears
    # down its gloo/TCPStore threads aborts ("terminate called without an active exception", SIGABRT; seen once in
    # five full suite runs, in the async server check).
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
