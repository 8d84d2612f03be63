"""`trl-cb check-model MODEL`: does trl_cb's CB engine sample exactly from *this* checkpoint?

Loads the checkpoint, runs the up-front checks (`checks/model.py`), samples a few completions through the same
`ContinuousBatchingGenerator` the trainers use, scores the same tokens with one teacher-forced forward and compares
the logprobs. Verdict on the last lines: `PASS`, or `FAIL` with the reason. Exit status 0 on PASS, 1 on FAIL.
Tolerance: an exact engine matches to ~1e-5 in float32 (default 1e-4); in bfloat16 / float16 noise reaches ~1e-2
(default 0.1). But the working-dtype forward is noisy itself: on sharp weights and long sequences its noise alone
exceeds those tolerances (an exact engine failed on an H100, docs/benchmark-log.md "GPU").

`--noise-floor` scores the tokens with a float64 copy of the same weights too. Rule (`floor_verdict`): PASS when
max |CB - fp64| <= max(tolerance, 2 x max |forward - fp64|): an exact engine is another working-dtype computation of
the same function, so its error is of the forward's order (measured ratios 0.5-1.9); the tolerance stays a floor. A
control (float64, prefix dropped, `_score`) must exceed that bound, else FAIL as inconclusive: a PASS that a cache
which lost the prompt would also get is false assurance, and scripts read only the exit status. docs/models.md.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from dataclasses import dataclass

import torch

from ..checks import model as model_checks
from ..engine import _upstream
from ..offline.tiny import resolve_model_name

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
_CONTROL_KEEP = 64  # prompt tokens the control reads (at most half the prompt): a cache that lost the rest
_FP32_NOISE_CEILING = 1e-2  # fp32 kernel noise measured up to 5.3e-4 (H100, sharp weights, 1,600-token prompts)


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


@dataclass
class NoiseFloor:
    """Gaps to a float64 teacher-forced forward of the same weights (`--noise-floor`); locations are over `bound`."""

    cb: Gap  # the engine's sampled logprobs
    forward: Gap  # the working-dtype teacher-forced forward: the model's own kernel noise
    control: Gap  # float64, the last `_CONTROL_KEEP` prompt tokens only: a cache that lost the prefix
    bound: float


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
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help="also score every sampled token with a float64 copy of the model (eager attention; needs 2x the "
        "float32 weights' memory, 4x bfloat16's) and PASS when the engine is within max(tolerance, 2x the "
        "working-dtype forward's own gap to float64): tells kernel noise from an engine bug",
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
    args.model = resolve_model_name(args.model)  # `trl-cb/tiny`: the offline checkpoint, built on first use

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
    forward = _score(model, prompts, completions, G, args.temperature)
    gap = _gap(logprobs, forward, prompts, G, tolerance)
    print(f"max |CB logprob - teacher-forced| = {gap.max_abs:.2e} (mean {gap.mean_abs:.2e})")
    window = getattr(model_checks.text_config(model.config), "sliding_window", None)
    if window is not None and longest <= window:
        print(f"note: sliding_window={window} was not crossed; --prompt-tokens {window + 16} checks it")
    if args.noise_floor:
        floor = _measure_noise_floor(model, prompts, completions, logprobs, forward, G, args.temperature, tolerance)
        _print_noise_floor(floor, args.dtype, tolerance)
        reason = floor_verdict(floor.cb.max_abs, floor.forward.max_abs, floor.control.max_abs, tolerance)
        if reason is not None:
            if floor.cb.max_abs > floor.bound:
                reason += f"; it {_where(floor.cb, window)}"
            return _fail(reason + ".")
        print("PASS: the engine is as close to the float64 logprobs as the model's own forward (within the bound).")
        return 0
    if gap.max_abs > tolerance:
        reason = f"logprob gap {gap.max_abs:.2e} > tolerance {tolerance:g}; it {_where(gap, window)}."
        if _noise_could_explain(gap.max_abs, dtype):
            reason += (
                f" A gap this size can be the model's own {args.dtype} kernel noise (sharp weights, long sequences):"
                " rerun with --noise-floor to judge the engine against that noise."
            )
        return _fail(reason)
    print("PASS: the engine samples from the model you train (within tolerance).")
    return 0


def floor_verdict(cb_max: float, forward_max: float, control_max: float, tolerance: float) -> str | None:
    """The `--noise-floor` rule (module docstring): `None` for PASS, else the reason naming the number that broke it.

    PASS needs max |CB - fp64| <= bound = max(tolerance, 2 x max |forward - fp64|), and the control above the bound
    (else a cache that lost the prefix would pass too, and the check proves nothing on this model and prompt)."""
    bound = noise_floor_bound(tolerance, forward_max)
    if cb_max > bound:
        return (
            f"CB vs float64 max {cb_max:.2e} > bound {bound:.2e} = max(tolerance {tolerance:g}, 2 x forward vs "
            f"float64 max {forward_max:.2e}): the engine is further from the exact logprobs than kernel noise explains"
        )
    if control_max <= bound:
        return (
            f"inconclusive: the control (prefix dropped) vs float64 max {control_max:.2e} <= bound {bound:.2e}, so "
            "a cache that lost the prompt's prefix would pass as well; use longer --prompt-tokens or float32"
        )
    return None


def noise_floor_bound(tolerance: float, forward_max: float) -> float:
    """Largest accepted max |CB - fp64|: twice the working-dtype forward's own max gap, never below `tolerance`."""
    return max(tolerance, 2.0 * forward_max)


def _noise_could_explain(gap_max: float, dtype: torch.dtype) -> bool:
    """Whether a plain-check gap may be kernel noise rather than an engine bug (then FAIL suggests `--noise-floor`).

    Half-precision noise alone reached 2.8 nats on sharp weights (H100), so any gap may be noise there; in float32
    noise stayed below 1e-3, and structural errors (a lost window, mask or soft-cap) move logprobs by 1e-2 and more."""
    return dtype != torch.float32 or gap_max < _FP32_NOISE_CEILING


def _where(gap: Gap, window: int | None) -> str:
    """Where `gap` first crosses its threshold, for the FAIL line (a window size helps read a late start)."""
    where = (
        f"starts at completion {gap.completion} token {gap.token} (sequence position {gap.position}): sampled "
        f"logprob {gap.sampled:.4f}, teacher-forced {gap.teacher_forced:.4f}"
    )
    if window is not None:
        where += f"; the model's sliding_window is {window}"
    return where


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


def _measure_noise_floor(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    logprobs: list[list[float]],
    forward: list[torch.Tensor],
    G: int,
    temperature: float,
    tolerance: float,
) -> NoiseFloor:
    """Score the sampled tokens with a float64 copy of `model` (the exact logprobs of the weights the engine has) and
    measure CB's, the working-dtype `forward`'s and the prefix-dropping control's gaps to it."""
    reference = _float64_copy(model)
    exact = _score(reference, prompts, completions, G, temperature)
    control = _score(reference, prompts, completions, G, temperature, keep_prompt=_CONTROL_KEEP)
    del reference
    forward_gap = _gap(forward, exact, prompts, G, tolerance)
    bound = noise_floor_bound(tolerance, forward_gap.max_abs)
    return NoiseFloor(
        cb=_gap(logprobs, exact, prompts, G, bound),
        forward=forward_gap,
        control=_gap(control, exact, prompts, G, bound),
        bound=bound,
    )


def _float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy on the same device, with eager attention (fused kernels have no float64 path on every device;
    eager is plain matmuls). The copy keeps the working dtype's rounded weights: it is exact for *those* weights."""
    reference = copy.deepcopy(model).to(torch.float64).eval()
    reference.set_attn_implementation("eager")
    return reference


def _print_noise_floor(floor: NoiseFloor, dtype_name: str, tolerance: float) -> None:
    print("noise floor, gaps to a float64 teacher-forced forward of the same weights:")
    rows = (
        ("CB", floor.cb, "the engine"),
        (f"forward ({dtype_name})", floor.forward, "the model's own kernel noise"),
        ("control (prefix dropped)", floor.control, f"float64 on the last min({_CONTROL_KEEP}, half) prompt tokens"),
    )
    for name, gap, meaning in rows:
        print(f"  {name + ' vs float64:':<38} max {gap.max_abs:.2e} (mean {gap.mean_abs:.2e})  {meaning}")
    print(f"bound = max(tolerance {tolerance:g}, 2 x {floor.forward.max_abs:.2e}) = {floor.bound:.2e}")


@torch.no_grad()
def _score(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    G: int,
    temperature: float,
    keep_prompt: int | None = None,
) -> list[torch.Tensor]:
    """Teacher-forced logprobs of every completion's tokens after its prompt (float64, on CPU; empty for an empty
    completion), from logits / `temperature` as the engine samples. Log-softmax runs in float32, as the trainer's,
    or float64 for a float64 model. `keep_prompt`: read only the last min(keep_prompt, len(prompt) // 2) prompt
    tokens, at their true positions (the control)."""
    device = next(model.parameters()).device
    scores = []
    for i, completion in enumerate(completions):
        prompt = prompts[i // G]
        start = 0 if keep_prompt is None else len(prompt) - max(1, min(keep_prompt, len(prompt) // 2))
        ids = torch.tensor([prompt[start:] + completion], device=device)  # (1, L)
        positions = torch.arange(start, start + ids.shape[1], device=device)[None] if start else None  # (1, L)
        logits = model(ids, position_ids=positions).logits[0, len(prompt) - start - 1 : -1]  # (T, V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion, device=device)[:, None])
        scores.append(picked[:, 0].to("cpu", torch.float64))  # (T,)
    return scores


def _gap(
    sampled: list[list[float]] | list[torch.Tensor],
    reference: list[torch.Tensor],
    prompts: list[list[int]],
    G: int,
    threshold: float,
) -> Gap:
    """Largest and mean |sampled - reference| over all tokens, and the first token (by sequence position) over
    `threshold`."""
    worst, total, count = 0.0, 0.0, 0
    first: tuple[int, int, int, float, float] | None = None
    for i, (values, ref) in enumerate(zip(sampled, reference, strict=True)):
        if not len(ref):
            continue
        values = torch.as_tensor(values, dtype=torch.float64)
        diff = (values - ref).abs()  # (T,)
        worst = max(worst, diff.max().item())
        total += diff.sum().item()
        count += diff.numel()
        over = (diff > threshold).nonzero()
        if over.numel():
            t = int(over[0])
            position = len(prompts[i // G]) + t
            if first is None or position < first[2]:
                first = (i, t, position, float(values[t]), float(ref[t]))
    i, t, pos, s, r = first if first is not None else (-1, -1, -1, float("nan"), float("nan"))
    return Gap(worst, total / max(count, 1), i, t, pos, s, r)


if __name__ == "__main__":
    sys.exit(main())
