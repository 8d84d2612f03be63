"""`trl-cb check-model MODEL`: does trl_cb's CB engine sample exactly from *this* checkpoint?

Loads the checkpoint, runs the up-front checks (`checks/model.py`), samples a few completions through the same
`ContinuousBatchingGenerator` the trainers use, scores the same tokens with one teacher-forced forward and compares
the logprobs. Verdict on the last lines: `PASS`, or `FAIL` with the reason (a refused architecture, an engine error,
or a logprob gap with its size and the first token where it starts). Exit status 0 on PASS, 1 on FAIL.

    trl-cb check-model Qwen/Qwen2.5-0.5B-Instruct --device cuda
    trl-cb check-model ./my-checkpoint --dtype bfloat16 --tolerance 0.1 --prompt-tokens 5000

Tolerance: an exact engine matches to ~1e-5 in float32 (default 1e-4); in bfloat16 / float16 kernel and batching
noise alone reaches ~1e-2 (default 0.1: structural errors still show, small ones do not).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass

import torch

from ..checks import model as model_checks
from ..engine import _upstream

logger = logging.getLogger(__name__)

_PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The history of the printing press begins",
    "Question: A train travels 60 km in 45 minutes. What is its average speed in km/h?\nAnswer:",
    "Once upon a time, in a village at the edge of a forest,",
    "Translate to French: The weather is lovely today, so we will walk to the market.",
    "List three prime numbers greater than 100:",
    "In a surprising turn of events, the committee announced",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Gap:
    """Where the sampled logprobs first leave the teacher-forced ones, and by how much at most."""

    max_abs: float
    mean_abs: float
    completion: int  # index of the completion holding the first token over the tolerance (-1: none)
    token: int  # its position in the completion
    position: int  # its position in the whole sequence (prompt + completion)
    sampled: float
    teacher_forced: float


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-cb check-model",
        description="Check that trl_cb's continuous batching engine samples exactly from a checkpoint: up-front "
        "compatibility checks, one short CB round, a teacher-forced comparison of the logprobs. Exit 0 on PASS.",
    )
    parser.add_argument("model", help="hub id or local path of a causal LM checkpoint")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="default: float32 (exact check)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts to sample from (default 4)")
    parser.add_argument("--num-generations", type=int, default=2, help="samples per prompt (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per completion (default 32)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="make every prompt this many tokens long (repeating its text), e.g. past the model's sliding window",
    )
    parser.add_argument(
        "--tolerance", type=float, default=None, help="largest accepted |logprob gap| (default 1e-4 fp32, 0.1 else)"
    )
    parser.add_argument("--attn-implementation", default=None, help="e.g. sdpa, eager (default: as the model loads)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code from the hub")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the check; print the report and the verdict; return the exit status (0 PASS, 1 FAIL)."""
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype]
    tolerance = args.tolerance if args.tolerance is not None else (1e-4 if dtype == torch.float32 else 0.1)
    torch.manual_seed(args.seed)
    print(f"check-model {args.model}: device={device}, dtype={args.dtype}, tolerance={tolerance:g}")

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    try:
        model_checks.check_config(config)
    except model_checks.UnsupportedModelError as err:
        return _fail(f"refused architecture. {err}")

    t0 = time.perf_counter()
    model, tokenizer = _load(args, device, dtype)
    print(f"loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"attention {_upstream.attention_implementation(model)}) in {time.perf_counter() - t0:.1f}s")  # fmt: skip
    try:
        model_checks.check_model(model)
    except model_checks.UnsupportedModelError as err:
        return _fail(f"refused architecture. {err}")

    prompts = _prompts(tokenizer, model, args.num_prompts, args.prompt_tokens)
    try:
        completions, logprobs, seconds = _sample(model, tokenizer, prompts, args)
    except Exception as err:  # noqa: BLE001 - an engine failure is a verdict (named in it), not a crash
        return _fail(f"the continuous batching round failed: {type(err).__name__}: {err}")
    G = args.num_generations
    longest = max(len(prompts[i // G]) + len(c) for i, c in enumerate(completions))
    print(f"sampled {len(completions)} completions ({sum(map(len, completions))} tokens, sequences up to "
          f"{longest} tokens) in {seconds:.1f}s")  # fmt: skip
    gap = _compare(model, prompts, completions, logprobs, G, args.temperature, tolerance)
    print(f"max |CB logprob - teacher-forced| = {gap.max_abs:.2e} (mean {gap.mean_abs:.2e})")
    window = getattr(model_checks.text_config(model.config), "sliding_window", None)
    if window is not None and longest <= window:
        print(f"note: sliding_window={window} was not crossed; --prompt-tokens {window + 16} checks it")
    if gap.max_abs > tolerance:
        where = (
            f"starts at completion {gap.completion} token {gap.token} (sequence position {gap.position}): sampled "
            f"logprob {gap.sampled:.4f}, teacher-forced {gap.teacher_forced:.4f}"
        )
        if window is not None:
            where += f"; the model's sliding_window is {window}"
        return _fail(f"logprob gap {gap.max_abs:.2e} > tolerance {tolerance:g}; it {where}.")
    print("PASS: the engine samples from the model you train (within tolerance).")
    return 0


def _fail(reason: str) -> int:
    print(f"FAIL: {reason}")
    return 1


def _load(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype, "trust_remote_code": args.trust_remote_code}
    if args.attn_implementation:
        kwargs["attn_implementation"] = args.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError):  # no tokenizer saved: random prompt ids are as good for this check
        logger.warning("No tokenizer found next to the model: prompting with random token ids.")
        tokenizer = None
    return model, tokenizer


def _prompts(tokenizer, model, num_prompts: int, prompt_tokens: int | None) -> list[list[int]]:
    vocab = model_checks.text_config(model.config).vocab_size
    prompts = []
    for i in range(num_prompts):
        if tokenizer is None:
            ids = torch.randint(0, vocab, (prompt_tokens or 24,)).tolist()
        else:
            text = _PROMPTS[i % len(_PROMPTS)]
            ids = tokenizer(text)["input_ids"]
            while prompt_tokens is not None and len(ids) < prompt_tokens:
                ids = ids + tokenizer(" " + text)["input_ids"]
            ids = ids[:prompt_tokens] if prompt_tokens else ids
        prompts.append(ids)
    return prompts


def _sample(model, tokenizer, prompts: list[list[int]], args: argparse.Namespace):
    from transformers import GenerationConfig

    from ..rollouts.generator import ContinuousBatchingGenerator

    eos = getattr(model.generation_config, "eos_token_id", None)
    pad = getattr(model.generation_config, "pad_token_id", None)
    if tokenizer is not None:
        eos = tokenizer.eos_token_id if eos is None else eos
        pad = tokenizer.pad_token_id if pad is None else pad
    cfg = GenerationConfig(
        do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
        eos_token_id=eos, pad_token_id=pad if pad is not None else eos,
    )  # fmt: skip
    t0 = time.perf_counter()
    with ContinuousBatchingGenerator(model, cfg) as gen:
        result = gen.generate(prompts, num_generations=args.num_generations)
    return result.completion_ids, result.logprobs, time.perf_counter() - t0


@torch.no_grad()
def _compare(model, prompts, completions, logprobs, G: int, temperature: float, tolerance: float) -> Gap:
    """Teacher-force every completion after its prompt; find the largest gap and the first token over `tolerance`."""
    worst, total, count = 0.0, 0.0, 0
    first: tuple[int, int, int, float, float] | None = None
    device = next(model.parameters()).device
    for i, (completion, sampled) in enumerate(zip(completions, logprobs, strict=True)):
        if not completion:
            continue
        prompt = prompts[i // G]
        ids = torch.tensor([prompt + completion], device=device)  # (1, L)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (T, V)
        ref = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0]
        diff = (ref.cpu() - torch.tensor(sampled)).abs()  # (T,)
        worst = max(worst, diff.max().item())
        total += diff.sum().item()
        count += diff.numel()
        over = (diff > tolerance).nonzero()
        if over.numel():
            t = int(over[0])
            if first is None or len(prompt) + t < first[2]:
                first = (i, t, len(prompt) + t, float(sampled[t]), float(ref[t]))
    i, t, pos, s, r = first if first is not None else (-1, -1, -1, float("nan"), float("nan"))
    return Gap(worst, total / max(count, 1), i, t, pos, s, r)


if __name__ == "__main__":
    sys.exit(main())
