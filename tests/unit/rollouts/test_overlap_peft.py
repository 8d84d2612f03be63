"""True overlap with a PEFT LoRA model (trl_cb/rollouts/overlap.py): the engine view aliases the adapter tensors the
optimizer trains, so every token's logprob is the one of the adapters at its recorded version, and the frozen base
weights are never written.

The trainer's LoRA forward and backward run while the engine generates (each grants the engine a forward and waits
until it started, `test_overlap.engine_runs_during_forward_and_backward`), then AdamW steps the adapters inside the
optimizer-step pause. Same tiny std-0.2 model and teacher-forced reference as test_overlap.py.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tests.conftest import sampling_config
from tests.gates import engine_throttle
from tests.unit.rollouts.test_overlap import (
    CONTROL_GAP,
    FP32_TOL,
    engine_runs_during_forward_and_backward,
    engine_threads,
    sharp_model,
    version_gaps,
    wait_in_backward,
)
from trl_cb import ContinuousBatchingGenerator
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.rollouts.async_controller import AsyncRolloutController
from trl_cb.rollouts.model_access import plain_module

peft = pytest.importorskip("peft")

#: Optimizer steps taken while requests generate (the brief's floor: 3).
STEPS = 4


def lora_model(tokenizer) -> torch.nn.Module:
    """The tiny std-0.2 model with non-zero LoRA adapters on every attention and MLP projection (a step of the
    adapters moves the logprobs by more than `CONTROL_GAP`)."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return peft.get_peft_model(sharp_model(tokenizer), config)


def test_lora_overlap_matches_each_version_and_leaves_the_base_untouched(tokenizer, monkeypatch):
    """Four AdamW steps of the adapters while requests generate: the view reads the training adapters (same storage),
    every token equals teacher forcing under the adapters of its version over its KV prefix (`FP32_TOL`), the base
    weights are bitwise unchanged. Control: the adapters before the update miss."""
    model = lora_model(tokenizer)
    module = plain_module(model)  # what the trainers give the engine: the base model with the LoRA layers in it
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in module.named_parameters() if p.requires_grad)
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    models = {0: copy.deepcopy(module).eval()}
    rows = synthetic_gsm8k(40, seed=4)
    stream = ((r, tokenizer(r["prompt"])["input_ids"]) for r in itertools.cycle(rows))
    generator = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=64))
    ctl = AsyncRolloutController(
        generator, module, stream, max_prompt_len=64, overlap=True, num_generations=2, groups_per_step=2,
        prefetch_depth=2, max_staleness=STEPS, keep_stale=True,
    )  # fmt: skip
    ctl.start()
    optimizer = torch.optim.AdamW(trainable, lr=5e-2)
    batch = torch.randint(5, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    waits = []
    try:
        view = ctl.backend.view.module
        shared = [
            (n, p.data_ptr() == q.data_ptr())
            for (n, p), (_, q) in zip(module.named_parameters(), view.named_parameters())
        ]
        assert all(same for _, same in shared) and sum("lora_" in n for n, _ in shared) == len(trainable)
        with engine_throttle(view, monkeypatch) as throttle:
            for version in range(1, STEPS + 1):
                throttle.step(2)
                model.train()
                with engine_runs_during_forward_and_backward(module, throttle) as waited:
                    logits = model(batch).logits
                    wait_in_backward(logits, throttle, waited)
                    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
                    loss.backward()
                waits.append(len(waited))
                with ctl.weight_update():
                    optimizer.step()
                optimizer.zero_grad()
                models[version] = copy.deepcopy(module).eval()
            throttle.open()
            groups = [g for _ in range(3) for g in ctl.take(2)[0]]
    finally:
        ctl.stop()
    assert waits == [2] * STEPS, "the engine must have stepped during every LoRA forward and backward"
    assert not engine_threads()
    assert all(torch.equal(frozen[n], p) for n, p in module.named_parameters() if not p.requires_grad)
    gaps, controls, straddled = version_gaps(models, groups)
    print(f"\nLoRA: updates mid-request {sorted(straddled)}; max|d|={max(gaps):.2e}; control {min(controls):.3f}")
    assert len(straddled) >= 3, f"only updates {sorted(straddled)} landed while a request was generating"
    assert max(gaps) <= FP32_TOL
    assert controls and min(controls) > CONTROL_GAP


def test_trainer_with_lora_and_overlap_trains_the_adapters_only(tokenizer, tmp_path):
    """GRPO with `peft_config` and `cb_async_overlap=True`, three optimizer steps: the overlap controller ran on a view
    of the base model with its adapters, the adapters moved, the base weights did not, no engine thread is left."""
    from datasets import Dataset

    from tests.unit.trainers.test_trainers import length_reward
    from trl_cb import GRPOConfig, GRPOTrainer
    from trl_cb.offline.tiny import tiny_model

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
        max_steps=3, logging_steps=1, learning_rate=1e-2, beta=0.0, report_to=[], save_strategy="no", use_cpu=True,
        use_transformers_continuous_batching=True, disable_tqdm=True, cb_async_generation=True, cb_async_overlap=True,
    )  # fmt: skip
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = GRPOTrainer(
        model=tiny_model(tokenizer, eos_logit_bias=4.0), reward_funcs=length_reward, args=args, peft_config=config,
        train_dataset=Dataset.from_list(synthetic_gsm8k(16, seed=5)), processing_class=tokenizer,
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    controllers: list[str] = []
    take = trainer.rollouts.async_rollouts.take

    def recording_take(inputs: list) -> list:
        rows = take(inputs)
        controllers.append(type(trainer.rollouts.async_rollouts.source.backend).__name__)
        return rows

    trainer.rollouts.async_rollouts.take = recording_take
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3 and logs[-1]["async/policy_version"] == 2
    assert set(controllers) == {"OverlapEngineBackend"}
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert moved and all("lora_" in n for n in moved), sorted(moved)[:5]
    assert trainer.rollouts.async_rollouts.source is None and not engine_threads()
