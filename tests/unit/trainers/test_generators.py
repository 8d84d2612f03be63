"""The trainers build every generator in one place (`trainers/generators.py`), with the same arguments whether the
round is synchronous or the in-process async rollouts' (which once lost the accelerator, the ZeRO-3 gathering flag
and the gradient-checkpointing kwargs)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.trainers.test_trainers import make_trainer
from trl_cb.rollouts.generator import ContinuousBatchingGenerator
from trl_cb.trainers import generators


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_kwargs` is deprecated:FutureWarning")  # transformers 5
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_sync_and_async_generators_are_built_with_the_same_arguments(kind, tokenizer, tmp_path, monkeypatch):
    built: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def recording(*args: Any, **kwargs: Any) -> ContinuousBatchingGenerator:
        built.append((args, kwargs))
        return ContinuousBatchingGenerator(*args, **kwargs)

    monkeypatch.setattr(generators, "ContinuousBatchingGenerator", recording)
    trainer = make_trainer(
        kind, tokenizer, tmp_path, cb_async_generation=True, max_completion_length=8, cb_keep_generation_weights=False,
        gradient_checkpointing_kwargs={"use_reentrant": False}, cb_generation_timeout=600.0,
    )  # fmt: skip
    try:
        sync = trainer.rollouts.sync_generator()  # evaluation's round
        trainer.rollouts.async_rollouts.controller()  # training's in-process async rollouts
    finally:
        trainer.rollouts.close()
    assert len(built) == 2, "one generator per path, both from trainers/generators.py"
    (sync_args, sync_kwargs), (async_args, async_kwargs) = built
    assert sync_args == async_args and sync_args[0] is trainer.model_wrapped
    assert sync_kwargs == async_kwargs
    assert sync_kwargs["accelerator"] is trainer.accelerator and sync.accelerator is trainer.accelerator
    assert sync_kwargs["gather_deepspeed3_params"] is trainer.args.ds3_gather_for_generation
    assert sync_kwargs["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert sync_kwargs["keep_generation_weights"] is False and sync_kwargs["timeout"] == 600.0
