"""The packed answer encoding (`protocol.PackedColumns` → JSON → `PackedChoices.unpack`): values round-trip exactly
(int32 ids and versions, fp32 logprobs bit for bit) on ragged choices, and a body whose lengths, offsets or buffers do
not fit together raises `ValueError` naming the field instead of misaligning tokens between choices."""

from __future__ import annotations

import base64
import json
import math
import struct

import pytest
import torch

from trl_cb.serving.protocol import PackedChoices, PackedColumns, value_runs


def _fp32(values: torch.Tensor) -> list[float]:
    return values.float().tolist()  # fp32 values as Python floats, as the engine hands them over


def _choices() -> list[dict]:
    """Ragged choices: empty, one token, a long one with three version runs, a -inf logprob, policy logprobs equal to
    the logprobs (one list object or an equal copy) and different from them."""
    gen = torch.Generator().manual_seed(0)
    lengths = [0, 1, 8192, 37, 0, 5]
    choices = []
    for c, n in enumerate(lengths):
        logprobs = _fp32(torch.log_softmax(torch.randn(max(n, 1), generator=gen), -1))[:n]
        versions = [2] * (n // 3) + [3] * (n // 3) + [7] * (n - 2 * (n // 3))
        policy = logprobs if c % 3 == 0 else list(logprobs) if c % 3 == 1 else _fp32(torch.randn(n, generator=gen))
        choices.append(
            {
                "token_ids": torch.randint(0, 2**31 - 1, (n,), generator=gen).tolist(),
                "logprobs": logprobs,
                "policy_logprobs": policy,
                "token_weight_versions": versions,
                "index": c,
                "prompt_index": c // 2,
                "weight_version": min(versions, default=1),
                "finish_reason": "stop" if c % 2 else "length",
            }
        )
    choices[3]["logprobs"][4] = -math.inf
    return choices


def _packed(choices: list[dict]) -> bytes:
    columns = PackedColumns()
    for c in choices:
        scalars = {k: c[k] for k in ("index", "prompt_index", "weight_version", "finish_reason")}
        runs = value_runs(c["token_weight_versions"])
        columns.add(c["token_ids"], c["logprobs"], c["policy_logprobs"], runs, **scalars)
    return b"".join(columns.json_pieces())


def _bits(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def test_round_trip_is_exact_on_ragged_choices():
    choices = _choices()
    unpacked = PackedChoices.model_validate_json(_packed(choices)).unpack()
    assert len(unpacked) == len(choices)
    for sent, got in zip(choices, unpacked):
        assert got.token_ids == sent["token_ids"] and got.token_weight_versions == sent["token_weight_versions"]
        assert _bits(got.logprobs) == _bits(sent["logprobs"])  # bit-exact fp32 (the -inf too)
        assert _bits(got.policy_logprobs) == _bits(sent["policy_logprobs"])
        assert got.policy_logprobs is not got.logprobs  # the caller may change one without the other
        scalars = ("index", "prompt_index", "weight_version", "finish_reason")
        assert [getattr(got, k) for k in scalars] == [sent[k] for k in scalars]


def test_policy_logprobs_equal_to_the_logprobs_are_sent_once():
    choices = [c for c in _choices() if c["index"] % 3 != 2]  # policy logprobs equal to the logprobs everywhere
    assert json.loads(_packed(choices))["policy_logprobs"] is None
    assert json.loads(_packed(_choices()))["policy_logprobs"] is not None


def test_version_runs_of_any_list():
    assert value_runs([]) == ([], [])
    assert value_runs([4] * 5 + [6] * 3) == ([4, 6], [5, 3])
    assert value_runs([1, 0, 0, 1, 1, 0]) == ([1, 0, 1, 0], [1, 2, 2, 1])  # not nondecreasing: still exact


def test_large_answer_is_written_in_pieces_that_join_into_valid_base64():
    n = 3 * 2**18 + 5  # just over one piece of raw bytes per buffer: two base64 pieces
    choice = {"token_ids": list(range(n)), "logprobs": [-0.5] * n, "policy_logprobs": [-0.25] * n}
    columns = PackedColumns()
    columns.add(**choice, version_runs=([0], [n]), index=0, prompt_index=0, weight_version=0, finish_reason=None)
    pieces = columns.json_pieces()
    assert max(len(p) for p in pieces) <= 2**20
    (got,) = PackedChoices.model_validate_json(b"".join(pieces)).unpack()
    assert got.token_ids == choice["token_ids"] and got.policy_logprobs == choice["policy_logprobs"]


def _body(**changes) -> dict:
    body = json.loads(_packed(_choices()))
    body.update(changes)
    return body


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (lambda b: {"num_tokens": [b["num_tokens"][0] + 1, *b["num_tokens"][1:]]}, "token_ids holds"),
        (lambda b: {"num_tokens": [1, 0, *b["num_tokens"][2:]]}, "version runs cover"),  # same total, shifted
        (lambda b: {"token_ids": _b64(base64.b64decode(b["token_ids"])[:-4])}, "token_ids holds"),  # truncated
        (lambda b: {"logprobs": _b64(base64.b64decode(b["logprobs"])[:-2])}, "logprobs holds"),  # partial element
        (lambda b: {"policy_logprobs": _b64(base64.b64decode(b["policy_logprobs"])[4:])}, "policy_logprobs holds"),
        (lambda b: {"token_ids": b["token_ids"][:-3] + "!!="}, "token_ids is not base64"),
        (lambda b: {"version_lengths": b["version_lengths"][:-1]}, "version values"),
        (lambda b: {"version_runs": [b["version_runs"][0] + 1, *b["version_runs"][1:]]}, "version values"),
        (lambda b: {"version_lengths": [*b["version_lengths"][:-2], 1, b["version_lengths"][-1] - 1]}, "cover"),
        (lambda b: {"index": b["index"][:-1]}, "index"),
        (lambda b: {"finish_reason": b["finish_reason"] + ["stop"]}, "finish_reason has"),
    ],
    ids=[
        "num-tokens-past-buffer",
        "offsets-shifted",
        "truncated-ids",
        "partial-fp32",
        "policy-misaligned",
        "bad-base64",
        "runs-unpaired",
        "runs-count",
        "runs-shifted",
        "index-short",
        "column-long",
    ],
)
def test_malformed_packed_bodies_raise(changes, message):
    body = _body()
    body.update(changes(body))
    with pytest.raises(ValueError, match=message):
        PackedChoices.model_validate(body).unpack()


@pytest.mark.parametrize(
    "changes", [{"num_tokens": [-1, 1, 8192, 37, 0, 5]}, {"version_lengths": [0]}, {"token_ids": None}]
)
def test_malformed_packed_bodies_fail_validation(changes):
    with pytest.raises(ValueError):  # pydantic's ValidationError: negative counts, empty runs, missing buffers
        PackedChoices.model_validate(_body(**changes)).unpack()
