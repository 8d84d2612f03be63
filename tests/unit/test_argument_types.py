"""Every public entry point refuses an argument of the wrong type with an error that names it (not a failure about
something else later: `'float' object has no attribute 'bit_length'`), and accepts the right types (the controls)."""

from __future__ import annotations

import typing

import pytest
from transformers import GenerationConfig

from trl_cb import ContinuousBatchingArguments, ContinuousBatchingGenerator, GRPOConfig, RLOOConfig
from trl_cb.offline.tiny import tiny_model

#: A wrong value per annotated type (a float where a count is expected, a string where a number is, ...).
WRONG = {bool: "yes", int: 2.5, float: "10", str: 3, dict: 5, list: 5}


@pytest.fixture(scope="module")
def generator(tokenizer):
    model = tiny_model(tokenizer)
    gen = ContinuousBatchingGenerator(model, GenerationConfig(max_new_tokens=2, do_sample=True))
    yield gen
    gen.close()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_generations": 2.5}, "num_generations"),
        ({"num_generations": True}, "num_generations"),
        ({"num_generations": "2"}, "num_generations"),
        ({"generation_config": {"max_new_tokens": 2}}, "generation_config"),
    ],
)
def test_generate_names_the_wrong_argument(generator, kwargs, name):
    with pytest.raises(TypeError, match=f"^{name} must be"):
        generator.generate([[5, 6, 7]], **kwargs)


def test_generate_refuses_a_string_of_prompts_and_accepts_the_right_types(generator):
    with pytest.raises(TypeError, match="prompt_ids must be a sequence"):
        generator.generate("5 6 7", num_generations=2)
    result = generator.generate([[5, 6, 7]], num_generations=2)  # control: the same call with the right types
    assert len(result.completion_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"model": "trl-cb/tiny"}, "model"),
        ({"generation_config": {"max_new_tokens": 2}}, "generation_config"),
        ({"continuous_batching_config": '{"page_size": 16}'}, "continuous_batching_config"),
        ({"cast_dtype": "bfloat16"}, "cast_dtype"),
        ({"timeout": "10"}, "timeout"),
        ({"gather_deepspeed3_params": 1}, "gather_deepspeed3_params"),
        ({"cast_lm_head_to_fp32": "no"}, "cast_lm_head_to_fp32"),
        ({"openmp_guard": 0}, "openmp_guard"),
        ({"keep_generation_weights": "auto"}, "keep_generation_weights"),
    ],
)
def test_generator_constructor_names_the_wrong_argument(tokenizer, kwargs, name):
    args = {"model": tiny_model(tokenizer), "generation_config": GenerationConfig(max_new_tokens=2), **kwargs}
    with pytest.raises(TypeError, match=f"^{name} must be"):
        ContinuousBatchingGenerator(**args)


def _cb_fields() -> list[tuple[str, typing.Any]]:
    return sorted(typing.get_type_hints(ContinuousBatchingArguments).items())


@pytest.mark.parametrize("cls", [GRPOConfig, RLOOConfig])
@pytest.mark.parametrize(("name", "annotation"), _cb_fields(), ids=[name for name, _ in _cb_fields()])
def test_config_fields_name_a_wrong_type(cls, name, annotation):
    """Every CB field, read from the annotations (a new field is covered without editing this test)."""
    parts = typing.get_args(annotation) if typing.get_origin(annotation) is not list else (annotation,)
    parts = parts or (annotation,)
    kinds = [typing.get_origin(p) or p for p in parts if p is not type(None)]
    wrong = next(value for kind, value in WRONG.items() if kind in kinds and not any(
        isinstance(value, k) for k in kinds if k in WRONG
    ))  # fmt: skip
    with pytest.raises(TypeError, match=f"^{name} must be"):
        cls(output_dir="/tmp/trl_cb_test", report_to=[], use_cpu=True, **{name: wrong})


def test_config_right_types_pass():
    """Control: right-typed values of every kind (ints where floats are allowed too)."""
    args = GRPOConfig(
        output_dir="/tmp/trl_cb_test", report_to=[], use_cpu=True, use_transformers_continuous_batching=True,
        cb_generation_timeout=10, cb_importance_sampling_clip_max=2, cb_keep_generation_weights=False,
        transformers_continuous_batching_config='{"page_size": 16}', cb_async_generation=True,
        cb_async_prefetch_depth=0, cb_server_api_key=None,
    )  # fmt: skip
    assert args.cb_generation_timeout == 10 and args.transformers_continuous_batching_config["page_size"] == 16
