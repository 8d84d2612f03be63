"""The served sampling table (`checks/served_sampling.py`) is the one place the served set is spelled out: every
request body, the trainer's request, the refusal rule and the engine's warpers read it, and a body that spells a
served field out again is caught (control)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from transformers import GenerationConfig

from trl_cb.checks.generation_settings import SERVED_FIELDS, settings_servers_cannot_apply
from trl_cb.checks.served_sampling import SERVED_SAMPLING, served_names
from trl_cb.serving.openai_protocol import ChatCompletionRequest, OpenAICompletionRequest
from trl_cb.serving.protocol import GREEDY, CompletionRequest, ServedSampling
from trl_cb.serving.request_settings import engine_settings, only_temperature, warpers_needed
from trl_cb.serving.vllm_generate import VLLMSamplingParams
from trl_cb.trainers.remote import RemoteRollouts

ROOT = Path(__file__).resolve().parents[3]
NAMES = [setting.name for setting in SERVED_SAMPLING]
BODIES = [CompletionRequest, OpenAICompletionRequest, ChatCompletionRequest, VLLMSamplingParams]
VOCAB = 100


def spelled_out(cls: type) -> set[str]:
    """The served names a class annotates in its own body (a second definition of a served field)."""
    tree = ast.parse(inspect.getsource(cls).strip())
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    return {
        node.target.id
        for node in body.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in NAMES
    }


@pytest.mark.parametrize("body", BODIES, ids=lambda cls: cls.__name__)
def test_every_request_body_takes_the_served_fields_from_the_table(body):
    assert issubclass(body, ServedSampling)
    for setting in SERVED_SAMPLING:
        assert body.model_fields[setting.name].default is None  # unset means off
    own = [cls for cls in body.__mro__ if cls.__module__.startswith("trl_cb.") and cls is not ServedSampling]
    assert body in own and len(own) >= 4
    assert not {cls.__name__: spelled_out(cls) for cls in own if spelled_out(cls)}


def test_a_body_that_spells_a_served_field_out_is_caught():
    """Control: the check above flags a class that defines `top_k` itself."""

    class Respelled(ServedSampling):  # type: ignore[misc,valid-type]
        top_k: int = 0

    assert spelled_out(Respelled) == {"top_k"}


@pytest.mark.parametrize("setting", SERVED_SAMPLING, ids=lambda s: s.name)
def test_a_rows_bounds_hold_on_every_route(setting):
    body = {"prompt": [[1]], "max_tokens": 1}
    for bound, limit in setting.bounds.items():
        outside = limit if bound == "gt" else limit - 1 if bound == "ge" else limit + 1
        with pytest.raises(ValidationError, match=setting.name):
            CompletionRequest(**body, **{setting.name: outside})
        with pytest.raises(ValidationError, match=setting.name):
            VLLMSamplingParams(**{setting.name: outside})
    assert CompletionRequest(**body).sampling()[setting.name] == setting.off


def test_unset_fields_are_off_and_temperature_zero_is_greedy():
    off = {setting.name: setting.off for setting in SERVED_SAMPLING}
    for body in (
        CompletionRequest(prompt=[[1]], max_tokens=1),
        VLLMSamplingParams(),
        OpenAICompletionRequest(prompt="x"),
    ):
        assert body.sampling() == off
    assert VLLMSamplingParams(temperature=0, top_k=5).sampling() == {**off, **GREEDY}
    greedy_penalised = VLLMSamplingParams(temperature=0, repetition_penalty=1.5).sampling()
    assert greedy_penalised == {**off, **GREEDY, "repetition_penalty": 1.5}  # penalties still apply
    assert VLLMSamplingParams(top_k=-1).sampling()["top_k"] == 0  # vLLM's "every token"


def test_the_trainer_sends_every_served_setting():
    config = GenerationConfig(max_new_tokens=7, temperature=0.7, top_k=None, top_p=0.9)
    sent = RemoteRollouts(SimpleNamespace(generation_config=config)).sampling()
    off = {s.name: s.wire_value(None) for s in SERVED_SAMPLING}
    assert sent == {**off, "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 0}
    config.update(repetition_penalty=1.3, min_p=0.05)
    config.logit_bias = {5: -2.0}  # not a GenerationConfig field: an extra attribute (as TRL sets generation_kwargs)
    sent = RemoteRollouts(SimpleNamespace(generation_config=config)).sampling()
    assert (sent["repetition_penalty"], sent["min_p"], sent["logit_bias"]) == (1.3, 0.05, {"5": -2.0})
    assert CompletionRequest(prompt=[[1]], **sent).sampling()["logit_bias"] == ((5, -2.0),)  # read back as sent
    assert set(NAMES) <= sent.keys()


def test_the_refusal_rule_serves_exactly_the_table():
    assert set(NAMES) <= SERVED_FIELDS
    assert settings_servers_cannot_apply({name: 0.5 for name in NAMES}) == []
    assert settings_servers_cannot_apply({"typical_p": 0.5}) == ["typical_p"]  # not in the table: refused
    assert served_names() == ", ".join(NAMES[:-1]) + f" and {NAMES[-1]}"


def test_the_engine_warpers_follow_the_table():
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=500, top_p=0.9)
    assert warpers_needed(config, VOCAB) == {"temperature", "top_p"}  # top_k past the vocabulary masks nothing
    engine_config, kwargs = engine_settings(config, frozenset(NAMES), VOCAB)
    off = {s.name: s.off for s in SERVED_SAMPLING}
    assert kwargs == {**off, "temperature": 0.7, "top_k": VOCAB, "top_p": 0.9}  # every processor's value, per request
    assert (engine_config.temperature, engine_config.top_k, engine_config.top_p) == (0.5, VOCAB, 0.5)
    assert (engine_config.min_p, engine_config.repetition_penalty, engine_config.logit_bias) == (0.5, 2.0, ((0, 1.0),))
    off_engine, none = engine_settings(GenerationConfig(), frozenset(), VOCAB)
    assert none == {} and (off_engine.temperature, off_engine.top_k, off_engine.top_p) == (1.0, 0, 1.0)
    assert off_engine.min_p is None  # transformers builds a min-p warper whenever min_p is set, even to 0
    assert only_temperature({"temperature": 0.7, "top_k": VOCAB, "top_p": 1.0}, VOCAB)
    assert not only_temperature({"temperature": 0.7, "top_k": 5}, VOCAB)


def test_the_docs_table_names_every_served_setting():
    text = (ROOT / "docs" / "server.md").read_text()
    table = text[text.index("**vLLM's RL request fields") :].split("\n\n")[1]
    assert all(f"`{name}`" in table for name in NAMES)
