"""vLLM's token-in, token-out route, `POST /inference/v1/generate`, as RL environment libraries call it (verifiers'
training mode, prime-rl, SkyRL): token ids in, sampled token ids and their logprobs out, no text on the wire.

Request (vLLM's `GenerateRequest`): `{"model", "token_ids", "sampling_params": {temperature, top_p, top_k, max_tokens,
stop_token_ids, stop, logprobs, skip_special_tokens, n, ...}}`. Answer (vLLM's `GenerateResponse`): `request_id`,
`choices[k] = {index, token_ids, logprobs: {content: [{"token": "token_id:<id>", "logprob"}]}, finish_reason,
stop_reason}`, `prompt_token_ids`, `usage`, with trl_cb's per-token `policy_logprobs`, `token_weight_versions` and
the choice's `weight_version` beside them (the RL fields every trl_cb route gives).

Invariants: the samples are the shared engine's, exactly as on `/v1/completions` (`openai_serving.py`: the same
flow, stop handling and answer values); `logprobs` are the sampled distribution's (after temperature, top-k, top-p),
`policy_logprobs` the trainer's `log_softmax(logits / T)`. Fields that would change the distribution and that the
server does not apply are refused with 422 naming them, never ignored; `logprobs` > 1 is refused (only the sampled
token's logprob is recorded: `logprobs: 1` returns it, with no alternatives).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi.responses import Response
from pydantic import Field

from ..rollouts.rollout_groups import RolloutGroup
from .openai_answers import DecodedSample, dump, usage
from .openai_serving import AnswerContext, Flows, OpenAIServing, all_groups, finished_sample
from .protocol import MAX_N, MAX_TOKENS, DecodedSamplingRequest, PromptIds
from .protocol import _Strict as Strict

__all__ = ["GenerateRequest", "VLLMSamplingParams", "generate"]

#: vLLM's `SamplingParams.max_tokens` default.
DEFAULT_MAX_TOKENS = 16


class VLLMSamplingParams(DecodedSamplingRequest):
    """vLLM's `sampling_params` (its defaults): what the engine applies, and the neutral values of what it does not
    (sent by clients that fill every field) accepted; anything else set is refused (422, naming it). The stop fields
    and the temperature rule: `DecodedSamplingRequest` (its `skip_special_tokens` changes nothing here: no text is
    returned)."""

    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1, le=MAX_TOKENS)
    logprobs: int | None = Field(default=None, ge=0, le=1)  # the sampled token's only: no alternatives
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    @property
    def return_token_ids(self) -> bool:
        return True  # the route is for token ids

    def max_new_tokens(self) -> int:
        """The completion-token limit under its one name inside trl_cb: `max_tokens`, or vLLM's default."""
        return DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class GenerateRequest(Strict):
    """vLLM's `/inference/v1/generate` body. `stream`, `kv_transfer_params`, multimodal `features` and a `priority`
    other than 0 are refused (422): this server does not serve them."""

    model: str | None = None
    token_ids: Annotated[PromptIds, Field(min_length=1)]
    sampling_params: VLLMSamplingParams = Field(default_factory=VLLMSamplingParams)
    request_id: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(default=None, max_length=256)  # prefix-cache isolation: no shared prefixes here
    stream: Literal[False] | None = False
    priority: Literal[0] = 0
    features: None = None
    kv_transfer_params: None = None


async def generate(serving: OpenAIServing, flows: Flows, body: GenerateRequest) -> Response:
    """vLLM's answer for `body` (module docstring): every sample of the one prompt, then one JSON object."""
    params, prompt = body.sampling_params, list(body.token_ids)
    ctx = serving.context(params, logprobs=params.logprobs is not None)
    flow, _ = serving.flow(flows, params, ctx, [prompt])
    groups = await all_groups(flow, 1)
    request_id = body.request_id or uuid.uuid4().hex
    answer = await serving.off_loop(_answer, ctx, request_id, params.n, prompt, groups[0])
    return Response(answer, media_type="application/json")


def _answer(ctx: AnswerContext, request_id: str, n: int, prompt: list[int], group: RolloutGroup) -> bytes:
    """The answer's JSON (decoded and encoded on the answer thread: `OpenAIServing.off_loop`)."""
    samples = [finished_sample(ctx, group, k, prompt) for k in range(n)]
    answer = {
        "request_id": request_id,
        "choices": [_choice(k, sample, ctx.logprobs) for k, sample in enumerate(samples)],
        "prompt_token_ids": prompt,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "usage": usage(len(prompt), sum(len(sample.token_ids) for sample in samples)),
    }
    return dump(answer)


def _choice(index: int, sample: DecodedSample, logprobs: bool) -> dict[str, Any]:
    """vLLM's choice: ids, and (asked for) each sampled token's logprob named `token_id:<id>`, as vLLM names tokens
    when it does not detokenize; trl_cb's RL fields beside them."""
    values = None
    if logprobs:
        content = [
            {"token": f"token_id:{token}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for token, lp in zip(sample.token_ids, sample.logprobs)
        ]
        values = {"content": content}
    return {
        "index": index,
        "token_ids": sample.token_ids,
        "logprobs": values,
        "finish_reason": sample.finish_reason,
        "stop_reason": sample.stop_reason,
        "policy_logprobs": sample.policy_logprobs,
        "token_weight_versions": sample.versions,
        "weight_version": sample.weight_version,
    }
