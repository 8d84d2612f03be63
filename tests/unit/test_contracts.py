"""Contract tests: the transformers and TRL surface trl_cb relies on (see trl_cb/_upstream.py, trl_cb/trainers.py).

Each test names what broke, so an upstream release that moves an API fails here first, cheaply and clearly,
instead of corrupting rollouts or their importance weights.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time

import pytest
import torch
import trl
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.continuous_batching.utils import WorkloadHints

from tests.conftest import sampling_config
from trl_cb import _upstream


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _manager(
    model, tokenizer, max_new_tokens: int = 4, num_blocks: int = 8, max_batch_tokens: int = 64, requests: int = 1
):
    """A started manager on the tiny model, sized by hand (page size 16)."""
    manager = _upstream.create_manager(
        model,
        sampling_config(tokenizer, max_new_tokens=max_new_tokens),
        ContinuousBatchingConfig(
            return_logprobs=True, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, page_size=16
        ),
        WorkloadHints(max_prompt_length=40, max_generated_length=max_new_tokens, num_requests=requests),
    )
    assert not manager.is_running(), "create_manager must not start the thread (resume does)"
    _upstream.resume(manager, model)
    return manager


# ------------------------------------------------------------------------------------------------- transformers


def test_cb_config_fields():
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert {"return_logprobs", "num_blocks", "max_batch_tokens", "page_size", "max_memory_percent"} <= names
    assert {"allow_block_sharing", "auto_switch_to_flash", "seed"} <= names


def test_manager_public_surface():
    for name in (
        "start",
        "stop",
        "destroy",
        "pause",
        "warmup",
        "is_running",
        "get_result",
        "switch_to_cb_friendly_attn",
    ):
        assert callable(getattr(ContinuousBatchingManager, name, None)), f"ContinuousBatchingManager.{name} is gone"
    assert params(ContinuousBatchingManager.add_request)[:4] == ["self", "input_ids", "request_id", "max_new_tokens"]
    assert "timeout" in params(ContinuousBatchingManager.get_result)


def test_generate_batch_and_init_signatures():
    from transformers.generation.continuous_batching import ContinuousMixin

    assert {"inputs", "generation_config", "continuous_batching_config"} <= set(params(ContinuousMixin.generate_batch))
    assert {"generation_config", "continuous_batching_config", "workload_hints"} <= set(
        params(ContinuousMixin.init_continuous_batching)
    )


def test_generation_output_and_hints_fields():
    names = {f.name for f in dataclasses.fields(GenerationOutput)}
    assert {"request_id", "generated_tokens", "logprobs", "error", "status"} <= names
    assert {"max_prompt_length", "max_generated_length", "num_requests"} <= {
        f.name for f in dataclasses.fields(WorkloadHints)
    }


def test_add_request_reads_num_return_sequences_for_forking(model, tokenizer, prompts):
    """`_upstream.add_forked_request` sets `manager.num_return_sequences` per request; add_request must read it."""
    manager = _manager(model, tokenizer, 4, 32, 128, 4)
    try:
        assert manager.num_return_sequences == 1
        ids = _upstream.add_forked_request(manager, prompts[0], "probe", 3, 4)
        assert ids == ["probe", "probe__child#0", "probe__child#1"]
        got = set()
        while len(got) < 3:
            result = manager.get_result(timeout=10)
            assert result is not None, "forked children never arrived"
            if result.is_finished():
                assert result.error is None and len(result.logprobs) == len(result.generated_tokens) == 4
                got.add(result.request_id)
        assert got == set(ids)
        assert _upstream.engine_fatal_error(manager) is None
        assert _upstream.resolved_cache_blocks(manager) >= 32
    finally:
        manager.destroy()


def test_internal_attributes_we_touch(model, tokenizer):
    manager = _manager(model, tokenizer, 4, 8, 64, 1)
    try:
        assert hasattr(manager, "_original_attn_impl"), "attention restore relies on manager._original_attn_impl"
        assert callable(manager.batch_processor.cache.reset), "prefix-cache reset relies on cache.reset()"
        assert hasattr(manager.background_thread_status, "fatal_error")
        _upstream.reset_prefix_cache(manager)  # under pause(), with the loop running
    finally:
        manager.destroy()


def test_eager_model_is_switched_and_restored(tokenizer):
    from trl_cb.tiny import tiny_model

    model = tiny_model(tokenizer)
    model.set_attn_implementation("eager")
    manager = _manager(model, tokenizer, 4, 8, 64, 1)
    try:
        assert model.config._attn_implementation == "paged|eager", "CB no longer switches eager to paged|eager"
        _upstream.restore_training_attention(manager)
        assert model.config._attn_implementation == "eager"
        _upstream.switch_to_generation_attention(manager, model)
        assert model.config._attn_implementation == "paged|eager"
        _upstream.restore_training_attention(manager)
    finally:
        manager.destroy()


def test_batch_processor_seeds_global_rng_upstream(model, tokenizer):
    """Why create_manager wraps construction in fork_rng: upstream re-seeds the global RNG when it builds the batch
    processor. If this test starts failing, upstream stopped doing so and the fork_rng can go."""
    cfg = ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=16, seed=5)
    manager = model.init_continuous_batching(
        generation_config=sampling_config(tokenizer), continuous_batching_config=cfg
    )
    try:
        torch.manual_seed(0)
        manager.warmup()
        after = torch.rand(2)
        torch.manual_seed(5)
        assert torch.equal(torch.rand(2), after)
    finally:
        _upstream.restore_training_attention(manager)
        manager.batch_processor = None


def test_generate_adds_top_k_but_cb_does_not():
    cfg = GenerationConfig(do_sample=True)
    assert cfg.top_k in (None, 50)  # generate() falls back to 50 when unset; we set top_k=0 explicitly for CB


# ---------------------------------------------------------------------------------------------------------- TRL


def test_trl_generation_hooks():
    assert params(trl.GRPOTrainer._generate_single_turn) == [
        "self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images",
    ]  # fmt: skip
    assert params(trl.RLOOTrainer._generate_single_turn) == ["self", "prompt_ids", "images", "multimodal_fields"]
    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        p = params(cls._get_per_token_logps_and_entropies)
        assert p[:5] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]
        assert "batch_size" in p


def test_trl_grpo_accepts_per_token_advantages_and_reads_is_ratio_for_vespo():
    src = inspect.getsource(trl.GRPOTrainer._compute_loss)
    assert "advantages.dim() == 1" in src, "GRPO loss no longer accepts (B, T) advantages"
    assert 'inputs.get("importance_sampling_ratio")' in src, "VESPO no longer reads importance_sampling_ratio"
    src = inspect.getsource(trl.RLOOTrainer._compute_loss)
    assert 'advantages = inputs["advantages"]' in src and "coef_1 * advantages" in src


def test_trl_output_keys_we_read():
    grpo = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    for key in ("sampling_per_token_logps", "old_per_token_logps", "completion_mask", "prompt_mask", "tool_mask"):
        assert f'"{key}"' in grpo, f"GRPO output no longer has {key!r}"
    rloo = inspect.getsource(trl.RLOOTrainer._generate_and_score_completions)
    for key in ("completion_ids", "completion_mask", "prompt_ids", "prompt_mask", "advantages"):
        assert f'"{key}"' in rloo


def test_trl_unwrap_helpers():
    from trl.distributed import DistributedBackend
    from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation

    assert {"gather_deepspeed3_params", "gradient_checkpointing_kwargs"} <= set(params(unwrap_model_for_generation))
    assert callable(DistributedBackend.summon_full_params)
    assert callable(disable_gradient_checkpointing)


@pytest.mark.parametrize("cls", [trl.GRPOConfig, trl.RLOOConfig])
def test_trl_config_fields_we_read(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    assert {"ds3_gather_for_generation", "bf16", "fp16", "gradient_checkpointing_kwargs", "temperature"} <= names


def test_torch_fsdp2_internals_we_save_and_restore():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    for name in ("unshard", "reshard", "set_reshard_after_forward", "_get_fsdp_state"):
        assert callable(getattr(FSDPModule, name, None)), f"FSDPModule.{name} is gone"
    assert "_auto_reshard_after_forward" in inspect.getsource(FSDPState.__init__)
    assert "post_forward_mesh_info" in inspect.getsource(FSDPParamGroup.__init__)
    assert "_fsdp_param_groups" in inspect.getsource(FSDPState)


def test_scheduler_state_read_under_pause(model, tokenizer, prompts):
    """Async version tagging reads each in-flight request's generated-token count under `pause()`; requests keep
    going after the pause (nothing drained)."""
    manager = _manager(model, tokenizer, 40, 64, 64, 2)
    try:
        scheduler = manager.batch_processor.scheduler
        assert isinstance(scheduler.active_requests, dict) and isinstance(scheduler.waiting_requests, dict)
        ids = _upstream.add_forked_request(manager, prompts[0], "p", 2, 40)
        seen: dict[str, int] = {}
        for _ in range(200):
            with manager.pause():
                seen = _upstream.inflight_generated_lengths(manager)
            if any(v > 0 for v in seen.values()):
                break
        assert set(seen) <= set(ids) and any(v > 0 for v in seen.values())
        finished = set()
        while len(finished) < 2:
            result = manager.get_result(timeout=10)
            assert result is not None, "requests did not continue after the pause"
            if result.is_finished():
                finished.add(result.request_id)
    finally:
        manager.destroy()


def test_suspend_resume_keeps_the_engine(model, tokenizer, prompts):
    """`_upstream.suspend` stops the loop through internals (`request_stop`, `_wake_up_loop`, `_generation_thread`)
    and `start()` must resume on the same batch processor and cache."""
    manager = _manager(model, tokenizer, 4, 32, 64, 2)
    try:
        processor, cache_tensor = manager.batch_processor, manager.batch_processor.cache.cache_tensor
        _upstream.suspend(manager)
        assert not manager.is_running() and manager._generation_thread is None
        _upstream.resume(manager, model)
        assert manager.is_running() and manager.batch_processor is processor
        assert manager.batch_processor.cache.cache_tensor is cache_tensor
        _upstream.add_forked_request(manager, prompts[0], "again", 2, 4)
        done = set()
        while len(done) < 2:
            result = manager.get_result(timeout=10)
            assert result is not None
            if result.is_finished():
                done.add(result.request_id)
    finally:
        manager.destroy()


# ------------------------------------------------------------------------------ abort / lifecycle (issue 9)


def test_hard_stop_abandons_outstanding_requests_and_marks_the_loop_stopped(model, tokenizer, prompts):
    """`_upstream.stop_now` relies on `request_stop(HARD_STOP)` ending the loop before its next batch (not after
    generating what is outstanding, as `destroy()` does) and on `local_status == STOPPED` once the thread is done."""
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

    assert BackgroundThreadStatus.HARD_STOP > BackgroundThreadStatus.FLUSH_AND_STOP
    src = inspect.getsource(ContinuousBatchingManager._run_generation_loop)
    assert "finally:" in src and "mark_as_stopped()" in src.split("finally:")[-1], "loop no longer marks STOPPED"
    manager = _manager(model, tokenizer, 2000, 256, 64, 8)
    try:
        assert isinstance(manager._generation_thread, threading.Thread) and hasattr(manager, "_wake_up_loop")
        for i, prompt in enumerate(prompts):
            manager.add_request(prompt, request_id=f"long{i}", max_new_tokens=2000)
        time.sleep(0.3)
        start = time.monotonic()
        assert _upstream.stop_now(manager, timeout=10)
        assert time.monotonic() - start < 2.0, "hard stop no longer stops promptly"
        assert manager._generation_thread is None
        status = manager.background_thread_status
        assert status.local_status == status.STOPPED
        results = []
        while (result := manager.get_result(timeout=0.1)) is not None:
            results.append(result)
        assert any(r.error is not None for r in results), "abandoned requests must come back failed"
        assert all(len(r.generated_tokens) < 2000 for r in results), "a hard stop must not generate the rest"
    finally:
        _upstream.restore_training_attention(manager)
        _upstream.release(manager)


def test_manager_constructor_switches_attention_before_it_can_raise(tokenizer):
    """Why `create_manager` restores attention and mode on failure: upstream switches eager -> paged|eager, then
    raises (here: page_size below its minimum of 4)."""
    from trl_cb.tiny import tiny_model

    model = tiny_model(tokenizer)
    model.set_attn_implementation("eager")
    cfg = ContinuousBatchingConfig(return_logprobs=True, num_blocks=8, max_batch_tokens=64, page_size=1)
    with pytest.raises(ValueError, match="page_size"):
        model.init_continuous_batching(generation_config=sampling_config(tokenizer), continuous_batching_config=cfg)
    assert model.config._attn_implementation == "paged|eager", "upstream no longer switches before raising"
    model.set_attn_implementation("eager")
    model.train()
    with pytest.raises(ValueError, match="page_size"):
        _upstream.create_manager(model, sampling_config(tokenizer), cfg, WorkloadHints(max_prompt_length=8))
    assert model.config._attn_implementation == "eager" and model.training


def test_cpython_thread_atexit_hook():
    """`_upstream.register_before_thread_join` needs the hook that runs before non-daemon threads are joined."""
    assert callable(getattr(threading, "_register_atexit", None)), "threading._register_atexit is gone"


def test_trainer_checkpoint_hooks_we_use():
    """Async resume: `on_save` fires right after `_save_checkpoint` wrote `<output_dir>/checkpoint-<global_step>`;
    `train(resume_from_checkpoint=True)` resolves the path with `get_last_checkpoint(output_dir)`."""
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    assert PREFIX_CHECKPOINT_DIR == "checkpoint" and callable(get_last_checkpoint)
    src = inspect.getsource(Trainer._maybe_log_save_evaluate)
    assert src.index("self._save_checkpoint(model, trial)") < src.index("self.callback_handler.on_save(")
    save = inspect.getsource(Trainer._save_checkpoint)
    assert 'checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"' in save
    assert params(Trainer.train)[1] == "resume_from_checkpoint"
    assert "get_last_checkpoint(args.output_dir)" in inspect.getsource(Trainer.train)


def test_trl_generation_schedule_and_prompt_tokenizer():
    """Async: prompts are tokenized with TRL's `_tokenize_prompts`; rollouts are taken once every
    `steps_per_generation * num_iterations` micro-steps (the default staleness bound is derived from it)."""
    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        assert callable(getattr(cls, "_tokenize_prompts", None))
        src = inspect.getsource(cls._prepare_inputs)
        assert "generate_every = self.args.steps_per_generation * self.num_iterations" in src
    for cls in (trl.GRPOConfig, trl.RLOOConfig):
        assert {"steps_per_generation", "num_iterations", "gradient_accumulation_steps"} <= {
            f.name for f in dataclasses.fields(cls)
        }
