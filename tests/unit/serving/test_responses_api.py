"""OpenAI's Responses API (`/v1/responses`, `responses_api.py`) through the official `openai` client, as the Agents
SDK calls it: a text input with instructions (its prompt is the chat template's rendering of the system and user
messages; its logprobs exact against teacher forcing, with the wrong-temperature control), a function-calling turn and
the next turn with the tool's output sent back as input items, both streamed too (OpenAI's `response.*` events, read
by the SDK's own accumulator), and the refusals (422, naming what is not served).
"""

from __future__ import annotations

import json

import pytest
import requests

from tests.unit.serving.conftest import AUTH
from tests.unit.serving.test_openai import MODEL, MULTIPLY, TEMPERATURE, check_exact, scripted, served  # noqa: F401

#: `MULTIPLY` in the Responses shape: the function's fields at the top level.
MULTIPLY_TOOL = {"type": "function", **MULTIPLY["function"]}
QUESTION = "How many clips did Natalia sell?"


def test_a_text_response_with_instructions_and_exact_logprobs(served, tokenizer):  # noqa: F811
    client, _, reference = served
    response = client.responses.create(
        model=MODEL, input=QUESTION, instructions="Answer briefly.", max_output_tokens=16, temperature=TEMPERATURE,
        include=["message.output_text.logprobs"], extra_body={"return_token_ids": True},
    )  # fmt: skip
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert response.object == "response" and response.model == MODEL
    assert response.model_extra["prompt_token_ids"] == list(prompt)
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    part = message.content[0]
    assert part.type == "output_text" and response.output_text == part.text
    ids = response.model_extra["token_ids"]
    check_exact(reference, tokenizer, list(prompt), ids, [t.logprob for t in part.logprobs], part.text)
    ended = ids[-1] == tokenizer.eos_token_id
    assert response.status == ("completed" if ended else "incomplete")
    assert (response.incomplete_details is None) == ended
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(prompt), len(ids))


def test_a_function_call_and_the_turn_with_its_output(scripted):  # noqa: F811
    """The scripted policy calls multiply(3, 4): a `function_call` item; the next request sends the conversation back
    as the Agents SDK does (the call item, then a `function_call_output`) and gets "Done!"."""
    client, _, _ = scripted
    user = {"role": "user", "content": "What is 3 times 4?"}
    first = client.responses.create(model="scripted", input=[user], tools=[MULTIPLY_TOOL], max_output_tokens=16)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "multiply" and first.status == "completed"
    assert json.loads(calls[0].arguments) == {"a": 3, "b": 4}
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12"}
    history = [user, *(item.model_dump(exclude_none=True) for item in first.output), output]
    second = client.responses.create(model="scripted", input=history, tools=[MULTIPLY_TOOL], max_output_tokens=16)
    assert second.output_text == "Done!" and second.status == "completed"
    assert not [item for item in second.output if item.type == "function_call"]


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"previous_response_id": "resp_1"}, "stores no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"seed": 2**63}, "seed"),
        ({"temperature": 0.001}, "greedy"),
    ],
)
def test_what_is_not_served_is_refused(served, fields, named):  # noqa: F811
    _, url, _ = served
    answer = requests.post(url + "/v1/responses", json={"model": MODEL, "input": "hi", **fields}, headers=AUTH)
    assert answer.status_code == 422 and named in answer.text, answer.text


def test_a_streamed_response_arrives_in_order_and_adds_up(served, tokenizer):  # noqa: F811
    """`stream: true`, read by the SDK's own stream accumulator (it rebuilds the response from the events and checks
    their order and indices): the text deltas concatenate to the final text, the logprobs are exact, the events are
    numbered 0, 1, 2, ... (how many deltas depends on the machine's speed: the first piece at once, then at most
    one per 20 ms, the rest at the end)."""
    client, _, reference = served
    kinds, numbers, deltas = [], [], []
    with client.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=24, temperature=TEMPERATURE,
        include=["message.output_text.logprobs"], extra_body={"return_token_ids": True},
    ) as stream:  # fmt: skip
        for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and numbers == list(range(len(numbers)))
    assert "".join(deltas) == final.output_text
    assert deltas or not final.output_text  # text (a sample may end at EOS at once: then none) came as deltas
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    part = final.output[0].content[0]
    check_exact(reference, tokenizer, list(prompt), final.model_extra["token_ids"], [t.logprob for t in part.logprobs],
                part.text)  # fmt: skip


def test_a_streamed_function_call(scripted):  # noqa: F811
    """With tools, the text is held back and parsed: the stream carries the `function_call` item and its arguments."""
    client, _, _ = scripted
    user = {"role": "user", "content": "What is 3 times 4?"}
    with client.responses.stream(model="scripted", input=[user], tools=[MULTIPLY_TOOL], max_output_tokens=16) as s:
        kinds = [event.type for event in s]
        final = s.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"a": 3, "b": 4}
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
