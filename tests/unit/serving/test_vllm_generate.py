"""What an RL environment library reads from a vLLM server, on trl_cb's (docs/server.md, "vLLM's token-in route"):
`POST /inference/v1/generate` in vLLM's request and answer shapes, with every logprob equal to teacher forcing under
the served weights and processing (controls: the same tokens without the request's processing miss by far);
`stop_token_ids` on every generation route (a scripted policy makes the stop certain); `max_model_len` on the model
card and vLLM's context-overflow wording in OpenAI's error shape; numbers sent as strings read as numbers before any
check, on every route; hostile bodies refused with 422 without echo. Servers run in this process (uvicorn in a thread).
"""

from __future__ import annotations

import copy

import openai
import pytest
import requests

from tests.unit.rollouts.test_generator import teacher_forced_logprobs
from tests.unit.serving.conftest import AUTH, FP32_LOGPROB_TOL, KEY, in_process_server
from tests.unit.serving.test_openai import warm
from trl_cb.offline import agent
from trl_cb.offline.tiny import tiny_model
from trl_cb.serving.server import create_app

MODEL = "tiny-vllm"
GENERATE = "/inference/v1/generate"
#: The scripted policy's answer, token by token (each token's successor is a function of it).
SCRIPT = "Café €😀"


@pytest.fixture(scope="module")
def sharp(tokenizer):
    """A std-0.2 tiny model served (fp32), and a copy for teacher forcing."""
    model = tiny_model(tokenizer, eos_logit_bias=2.0, init_std=0.2)
    reference = copy.deepcopy(model)
    with in_process_server(create_app(model, model_name=MODEL, tokenizer=tokenizer, api_key=KEY)) as url:
        warm(url, MODEL)
        yield url, reference


@pytest.fixture(scope="module")
def scripted():
    """A policy that answers `SCRIPT` after `<|assistant|>` with probability 1 - 1e-15 per token, then `<|end|>`
    (tests/parity/scripted.py's construction); its prompt ids."""
    tokenizer = agent.chat_tokenizer([])
    chain = ["<|assistant|>", *tokenizer.convert_ids_to_tokens(tokenizer.encode(SCRIPT)), "<|end|>"]
    assert len(set(chain)) == len(chain)
    model = agent.scripted_model(tokenizer, [(a, b, 40.0) for a, b in zip(chain, chain[1:])], max_positions=1024)
    messages = [{"role": "user", "content": "Say it"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(rendered)
    with in_process_server(create_app(model, model_name="scripted", tokenizer=tokenizer, api_key=KEY)) as url:
        warm(url, "scripted")
        yield url, tokenizer, prompt, messages


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, headers=AUTH, timeout=120)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (0.8, 20, 0.9)], ids=["T", "T-k-p"])
def test_token_in_route_is_vllms_and_exact(sharp, prompts, temperature, top_k, top_p):
    """vLLM's shapes (as verifiers reads them), and each sampled token's logprob equal to teacher forcing under the
    request's temperature, top-k and top-p. Control: the same tokens under plain softmax (T=1, no top-k/p)."""
    url, reference = sharp
    prompt = prompts[0]
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "max_tokens": 24, "n": 2, "logprobs": 1,
              "stop_token_ids": [], "skip_special_tokens": True}  # fmt: skip
    answer = post(url, GENERATE, {"model": MODEL, "token_ids": prompt, "sampling_params": params}).json()
    assert answer["prompt_token_ids"] == prompt and [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        assert ids and [entry["token"] for entry in content] == [f"token_id:{token}" for token in ids]
        assert choice["finish_reason"] in {"stop", "length"} and choice["token_weight_versions"] == [0] * len(ids)
        served = [entry["logprob"] for entry in content]
        exact = teacher_forced_logprobs(reference, prompt, ids, temperature, top_k, top_p)
        control = teacher_forced_logprobs(reference, prompt, ids, 1.0, 0, 1.0)
        gap = max(abs(a - b) for a, b in zip(exact.tolist(), served))
        miss = max(abs(a - b) for a, b in zip(control.tolist(), served))
        print(f"\n/inference/v1/generate vs teacher forcing max|d| = {gap:.2e} (control: {miss:.3f})")
        assert gap <= FP32_LOGPROB_TOL and miss > 1e-2
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in answer["choices"])
    plain = post(url, GENERATE, {"token_ids": prompt, "sampling_params": {"max_tokens": 4}}).json()
    assert plain["choices"][0]["logprobs"] is None  # vLLM: logprobs only when asked


def test_stop_token_ids_on_every_route(scripted):
    """The sample ends at the first stop token, kept (vLLM's), `finish_reason` stop, `stop_reason` the id, on the
    token-in route, completions and chat, whole and streamed. Control: without it the whole script comes."""
    url, tokenizer, prompt, messages = scripted
    script = tokenizer.encode(SCRIPT)
    stop = script[5]  # "Ġ", the space before €: the sample is "Café " (C a f Ã © Ġ)
    assert script.index(stop) == 5 and tokenizer.decode(script[:6]) == "Café "
    expected = script[:6]

    whole = post(url, GENERATE, {"token_ids": prompt, "sampling_params": {"max_tokens": 32}}).json()["choices"][0]
    assert whole["token_ids"] == script + [tokenizer.eos_token_id] and "stop_reason" not in whole  # the control
    params = {"max_tokens": 32, "stop_token_ids": [stop, 1]}
    choice = post(url, GENERATE, {"token_ids": prompt, "sampling_params": params}).json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)

    body = {"model": "scripted", "max_tokens": 32, "stop_token_ids": [stop], "return_token_ids": True}
    answer = post(url, "/v1/completions", {**body, "prompt": prompt}).json()["choices"][0]
    assert (answer["token_ids"], answer["text"], answer["stop_reason"]) == (expected, "Café ", stop)
    for path, extra in (("/v1/chat/completions", {"messages": messages}), ("/v1/chat/completions/tokens",
                                                                          {"tokens": prompt})):  # fmt: skip
        answer = post(url, path, {**body, **extra}).json()["choices"][0]
        assert (answer["token_ids"], answer["message"]["content"], answer["finish_reason"]) == (
            expected, "Café ", "stop"
        )  # fmt: skip
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    streamed = client.chat.completions.create(
        model="scripted", messages=messages, max_tokens=32, stream=True,
        extra_body={"stop_token_ids": [stop], "return_token_ids": True},
    )  # fmt: skip
    ids, text, finish = [], "", None
    for chunk in streamed:
        ids += chunk.choices[0].model_extra.get("token_ids") or []
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (ids, text, finish) == (expected, "Café ", "stop")
    binary = {"prompt": [prompt], "max_tokens": 8, "encoding": "binary", "stop_token_ids": [stop]}
    assert post(url, "/v1/completions", binary).status_code == 422  # the binary answer has no stop handling


def test_model_card_and_context_overflow(sharp, tokenizer):
    """`max_model_len` on the card (verifiers' prompt-length pre-flight); a prompt whose completion budget passes it
    gets vLLM's wording, 400 in OpenAI's shape (`openai.BadRequestError`), on every generation route."""
    url, reference = sharp
    limit = reference.config.max_position_embeddings
    card = requests.get(url + f"/v1/models/{MODEL}", headers=AUTH, timeout=10).json()
    assert card["max_model_len"] == limit == 2048
    prompt = [5] * 2000
    wording = (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2000 in the prompt, "
        "100 in the completion)."
    )
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=100)
    assert wording in caught.value.message and caught.value.body["type"] == "invalid_request_error"
    answers = [
        post(url, GENERATE, {"token_ids": prompt, "sampling_params": {"max_tokens": 100}}),
        post(url, "/v1/chat/completions/tokens", {"tokens": prompt, "max_tokens": 100}),
        post(url, "/v1/completions", {"prompt": [prompt], "max_tokens": 100, "stream": True}),
    ]
    for answer in answers:
        assert answer.status_code == 400 and wording in answer.json()["error"]["message"]
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_numbers_sent_as_strings_are_numbers_on_every_route(sharp, prompts):
    """`"0.0"` is off like 0.0, `"20"` a top-k, on each route; a string that is no number is refused (422) without
    echo. Control: a string past a field's bounds is refused like the number, naming it."""
    url, _ = sharp
    numbers = {"temperature": "0.7", "top_k": "20", "top_p": "0.9", "min_p": "0.0", "repetition_penalty": "1.0",
               "max_tokens": "4", "n": "2"}  # fmt: skip
    assert post(url, "/v1/completions", {"prompt": [prompts[0]], **numbers}).status_code == 200
    assert post(url, "/v1/chat/completions/tokens", {"tokens": prompts[0], **numbers}).status_code == 200
    answer = post(url, GENERATE, {"token_ids": prompts[0], "sampling_params": numbers})
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 2
    for value, name in (("hot", "temperature"), ("nan", "temperature"), ("1.5", "min_p"), ("1e999", "top_p")):
        for path, body in (
            ("/v1/completions", {"prompt": [prompts[0]], "max_tokens": 4, name: value}),
            (GENERATE, {"token_ids": prompts[0], "sampling_params": {"max_tokens": 4, name: value}}),
        ):
            refused = post(url, path, body)
            assert refused.status_code == 422 and name in refused.text, (path, name, refused.text)
            assert value not in refused.text.replace(name, "")  # never echoed


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"token_ids": [5] * 40_000}, "token_ids"),
        ({"token_ids": ["five"]}, "token_ids"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [5], "sampling_params": {"logprobs": 5}}, "logprobs"),
        ({"token_ids": [5], "sampling_params": {"seed": -2}}, "seed"),
        ({"token_ids": [5], "sampling_params": {"presence_penalty": 2.5}}, "presence_penalty"),
        ({"token_ids": [5], "sampling_params": {"typical_p": 0.5}}, "typical_p"),
        ({"token_ids": [5], "sampling_params": {"bad_words": ["x"]}}, "bad_words"),
        ({"token_ids": [5], "stream": True}, "stream"),
        ({"token_ids": [5], "priority": 1}, "priority"),
        ({"token_ids": [5], "extra": 1}, "extra"),
    ],
)
def test_token_in_route_refuses_what_it_cannot_serve(sharp, body, names):
    url, _ = sharp
    refused = post(url, GENERATE, body)
    assert refused.status_code == 422 and names in refused.text and len(refused.content) < 4096
    unknown = post(url, GENERATE, {"model": "other", "token_ids": [5]})
    assert unknown.status_code == 404
