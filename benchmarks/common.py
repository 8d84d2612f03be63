"""What every benchmark script shares: options, models, worker processes, results written as they are measured.

- Options (`add_options`, `finish_options`): `--device`, `--dtype`, `--seed`, `--out`, `--quick`, `--resume FILE`
  (skip the points FILE already holds) and `--replot FILE` (redraw FILE's PNG: no model, no GPU needed).
- Models (`load_model`): the offline presets, built from a config with a local tokenizer (`null`, `tiny`, `small`,
  `tiny-qwen3.5`, `llama-1b-random`, `qwen3.5-0.8b-random`), or a hub id / path. A length tail is a property of the
  model, so every backend sees the same one: an EOS logit bias (`EOS_BIAS`), the calibrated GSM8K-like tail
  (`calibrate_tail`) or none (`suppress_eos`); `length_tail` is the one rule that picks a preset's long tail.
- Workers (`Workers`): each backend runs in its own Python process, so one backend's allocations and threads never
  slow the next (TRL's native CB call sizes its cache from free memory and leaves a CPU process slow afterwards). A
  process is kept for the next point of the same backend where the backend allows it (one model build per backend);
  a point runs under a timeout, and a point that fails or times out is recorded as such while the sweep goes on.
- Results (`ResultFile`): the JSON document (and its PNG) is rewritten after every point, so an interrupted run keeps
  every point it measured; the JSON is also the last stdout line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Where a run writes its JSON and PNG unless `--out` says otherwise: git-ignored, so a run never changes the checkout.
#: The results docs/benchmarks.md cites are recorded with `--out benchmarks/results`.
DEFAULT_OUT = ROOT / "runs" / "benchmarks"
#: Random-init offline presets: `null` (1 layer x 32 wide: a forward costs next to nothing), `tiny` (2 x 64) and
#: `small` (8 x 256) on the local 512-token tokenizer; `llama-1b-random`: Llama-3.2-1B's shape and 128,256-entry
#: vocabulary, for a GPU. Hybrids (Qwen3.5's 3:1 Gated DeltaNet / full-attention layout): `tiny-qwen3.5` (4 x 64) on
#: CPU, `qwen3.5-0.8b-random` (Qwen3.5-0.8B's text layout at full size) for a GPU.
PRESETS = ("null", "tiny", "small", "tiny-qwen3.5", "llama-1b-random", "qwen3.5-0.8b-random")
#: Presets with recurrent layers: transformers' own CB engine (TRL's native call) refuses them ("Invalid layer type:
#: linear_attention"), so the scripts leave `trl_native` out for them.
HYBRID_PRESETS = ("tiny-qwen3.5", "qwen3.5-0.8b-random")
#: Full-size presets (GPU): their tail is calibrated per `max_new_tokens` (`calibrate_tail`), not an `EOS_BIAS`.
FULL_SIZE_PRESETS = ("llama-1b-random", "qwen3.5-0.8b-random")
#: EOS logit bias per small preset: long-tailed lengths on GSM8K-style prompts (tiny at 4.0: p50 ~30, p90 ~90 of 256;
#: tiny-qwen3.5 at 2.0: p50 18, p90 76).
EOS_BIAS = {"null": 4.0, "tiny": 4.0, "small": 6.0, "tiny-qwen3.5": 2.0}
#: The calibrated tail (`calibrate_tail`): per-token EOS probability set so that the 90th percentile of the lengths is
#: this share of `max_new_tokens`; a constant hazard then gives p50 ~ 0.21x and ~4% of completions at the cap, near
#: GSM8K's shape on a real model (p50 ~ 0.25x, p90 ~ 0.7x of a 512-token cap, some at the cap).
TAIL_P90_SHARE = 0.7
RESULT_PREFIX = "@@trl_cb-bench-result "
#: Options that say where and how a run is written, not what it measures: a `--resume` may differ in them.
RUN_OPTIONS = ("out", "quick")


# ------------------------------------------------------------------------------------------------------- options


def add_options(p: argparse.ArgumentParser, out_name: str) -> None:
    """The options every script takes (`out_name`: the result files' stem)."""
    g = p.add_argument_group("common")
    g.add_argument("--device", default="cpu", help="cpu (default) | cuda | auto")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result directory (default: runs/benchmarks/)")
    g.add_argument("--quick", action="store_true", help="the smallest sweep of every part (smoke test)")
    g.add_argument("--resume", type=Path, default=None, help=f"a {out_name}-*.json to complete: its points are kept")
    g.add_argument("--replot", type=Path, default=None, help=f"redraw the PNG of a {out_name}-*.json and exit")
    g.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def parse(p: argparse.ArgumentParser, argv: list[str] | None, out_name: str, **defaults: Any) -> argparse.Namespace:
    """`p`'s arguments with the common options added (`add_options`; `defaults` overrides theirs), resolved
    (`finish_options`) unless the run is a worker's or a `--replot`."""
    add_options(p, out_name)
    p.set_defaults(**defaults)
    args = p.parse_args(argv)
    if not (args.worker or args.replot):
        finish_options(p, args)
    return args


def finish_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve `auto` device and the default dtype; check the common options."""
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device must be cpu, cuda or auto, got {args.device!r}")
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.dtype not in ("float32", "bfloat16", "float16"):
        p.error(f"--dtype must be float32, bfloat16 or float16, got {args.dtype!r}")
    for name in ("resume", "replot"):
        path = getattr(args, name)
        if path is not None and not path.is_file():
            p.error(f"--{name}: no such file: {path}")


#: `max_memory_percent` of TRL's own CB path when its config leaves it unset (`GRPOConfig.__post_init__`).
NATIVE_MEMORY_PERCENT = 0.5


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_native_memory_option(p: argparse.ArgumentParser) -> None:
    """`--native-memory-percent`: the `trl_native` backend's `max_memory_percent`. TRL's default (0.5) is the
    benchmark's; on a CPU it sizes the cache from half the RAM, allocated afresh every round (half a minute per
    round on a 24 GB VM), so a smoke test that only checks the orchestration may pass a small one (recorded)."""
    p.add_argument(
        "--native-memory-percent", type=_fraction, default=NATIVE_MEMORY_PERCENT,
        help=f"trl_native's max_memory_percent (default {NATIVE_MEMORY_PERCENT}, TRL's own)",
    )  # fmt: skip


def without_native_for_hybrids(model: str, backends: list[str]) -> list[str]:
    """`backends` less `trl_native` for a hybrid preset (transformers' own CB engine refuses its layers), said so."""
    if model in HYBRID_PRESETS and "trl_native" in backends:
        print(f"{model}: trl_native left out (transformers' own CB engine refuses linear-attention layers)")
        return [b for b in backends if b != "trl_native"]
    return backends


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's options as JSON values (what the result file records)."""
    skip = {"worker", "resume", "replot"}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


# -------------------------------------------------------------------------------------------------------- models


def load_model(
    name: str,
    device: str = "cpu",
    dtype: str = "float32",
    eos_logit_bias: float | None = None,
    tail_tokens: int | None = None,
) -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode on `device`: a preset (`PRESETS`, random init, offline) or a hub id / path.

    Length tail (random presets): `tail_tokens` calibrates the GSM8K-like tail for that `max_new_tokens`
    (`calibrate_tail`); else `eos_logit_bias` (None: the plain init) boosts EOS as `trl_cb.offline.tiny.bias_eos`.
    Either is drawn from fixed seeds, so every worker process builds the same model whatever it ran before (a bias
    probed from the process's own random state gave one backend a p50 length of 173 and another 2 on one preset)."""
    import torch

    from trl_cb.offline.tiny import bias_eos, small_model, tiny_model, tiny_tokenizer

    torch_dtype = getattr(torch, dtype)
    bias = eos_logit_bias if tail_tokens is None else None
    if name in ("null", "tiny", "small", "tiny-qwen3.5"):
        tokenizer = tiny_tokenizer()  # the builders apply `bias` under their own seed (as the tiny checkpoints do)
        if name == "tiny-qwen3.5":
            model = tiny_model(tokenizer, architecture="qwen3_5", eos_logit_bias=bias)
        elif name == "small":
            model = small_model(tokenizer, eos_logit_bias=bias, dtype=torch.float32)
        else:
            size = {"hidden_size": 32, "num_layers": 1} if name == "null" else {}
            model = tiny_model(tokenizer, eos_logit_bias=bias, **size)
        model.to(device=device, dtype=torch_dtype)
        bias = None
    elif name == "llama-1b-random":
        model, tokenizer = _llama_1b_random(torch_dtype, device)
    elif name == "qwen3.5-0.8b-random":
        model, tokenizer = _qwen3_5_08b_random(torch_dtype, device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, attn_implementation="sdpa").to(device)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model.eval(), tokenizer
    cuda = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        if tail_tokens is not None:
            calibrate_tail(model, tokenizer.eos_token_id, tail_tokens)
        elif bias is not None:
            bias_eos(model, tokenizer.eos_token_id, bias)
    return model.eval(), tokenizer


def length_tail(model: str, eos_logit_bias: float | None, max_new_tokens: int) -> dict[str, Any]:
    """`load_model`'s length-tail keywords (`eos_logit_bias`, `tail_tokens`) for a preset's long-tailed workload: an
    explicit `eos_logit_bias` wins, else a full-size preset gets the tail calibrated for `max_new_tokens`, else the
    preset's `EOS_BIAS`. One rule, so the same flags give the same model in every script."""
    if eos_logit_bias is not None:
        return {"eos_logit_bias": eos_logit_bias, "tail_tokens": None}
    if model in FULL_SIZE_PRESETS:
        return {"eos_logit_bias": None, "tail_tokens": max_new_tokens}
    return {"eos_logit_bias": EOS_BIAS[model], "tail_tokens": None}


def _llama_1b_random(dtype: Any, device: str) -> tuple[Any, Any]:
    """Llama-3.2-1B at full size, random init (no hub). The 128,256-entry vocabulary makes the LM head and sampling
    cost what they cost on the real model."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=True,
    )  # fmt: skip
    return _full_size_random(config, dtype, device)


def _qwen3_5_08b_random(dtype: Any, device: str) -> tuple[Any, Any]:
    """Qwen3.5-0.8B's text layout at full size, random init (no hub): 24 layers of 1,024 (18 Gated DeltaNet, every
    4th full attention with 8 query / 2 KV heads of 256), MLP 3,584, the 248,320-entry vocabulary; the Gated
    DeltaNet heads (16 key, 16 value, 128 wide) are this preset's assumption."""
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=248_320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    return _full_size_random(config, dtype, device)


def _full_size_random(config: Any, dtype: Any, device: str) -> tuple[Any, Any]:
    """A full-size model from `config`, random init on `device` (seconds on a GPU, not a minute on a CPU), its LM head
    untied so the EOS row can move alone; the local tokenizer covers the first 4,096 ids (prompts, EOS, pad)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_cb.offline.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer(vocab_size=4096)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(config, key, getattr(tokenizer, key))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model, tokenizer


def calibrate_tail(
    model: Any, eos_id: int, max_new_tokens: int, p90_share: float = TAIL_P90_SHARE, rows: int = 256, steps: int = 24
) -> float:
    """Set the EOS row of the LM head so that a generated token is EOS with probability h, where a geometric length
    with hazard h has its 90th percentile at `p90_share * max_new_tokens` (`h = 1 - 0.1 ** (1 / (p90_share * M))`).
    Returns the scale set (the mean EOS logit): the upper end of the bisection's last bracket, whose hazard was
    measured at or above the target (unless the search hit its scale cap); it is not measured again.

    How: the EOS row points along the mean final hidden state (as `bias_eos`), scaled; the scale is found by bisection
    (in log space) on the hazard measured where it matters, in generation: `rows` sampled completions of `steps`
    tokens from random prompts, EOS events over tokens generated (a fixed seed, so each scale is judged on the same
    draws). A random model's states vary little along a completion, so the hazard stays near h at every position;
    the lengths actually sampled are reported by the benchmarks (p50/p90/max, share at the cap)."""
    import math

    import torch

    target = 1.0 - 0.1 ** (1.0 / max(1.0, p90_share * max_new_tokens))
    weight = model.lm_head.weight
    device, vocab = weight.device, weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(vocab, 4096), (rows, 16), generator=generator).to(device)
    hidden = model.model(input_ids=prompts).last_hidden_state.reshape(-1, model.config.hidden_size).float()
    # The direction whose projection varies least relative to its mean (Fisher's: the covariance's inverse applied
    # to the mean), so the EOS logit is nearly the same in every context and the hazard nearly constant.
    mean = hidden.mean(0)
    centered = hidden - mean
    covariance = centered.T @ centered / len(hidden)
    ridge = 1e-3 * covariance.diagonal().mean() * torch.eye(len(mean), device=mean.device)
    direction = torch.linalg.solve(covariance + ridge, mean)
    direction = direction / (hidden @ direction).mean()  # a unit mean projection: the scale is the mean EOS logit
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else eos_id

    def set_scale(scale: float) -> None:
        weight[eos_id] = (direction * scale).to(weight.dtype)

    def hazard(scale: float) -> float:
        set_scale(scale)
        torch.manual_seed(0)
        out = model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=steps, eos_token_id=eos_id, pad_token_id=pad,
        )[:, prompts.shape[1] :]  # fmt: skip
        ended = out == eos_id  # (rows, steps)
        stopped = ended.any(1)
        tokens = torch.where(stopped, ended.int().argmax(1) + 1, torch.full_like(stopped, steps, dtype=torch.long))
        return float(stopped.sum()) / float(tokens.sum())

    low, high = 1e-2, 4.0
    while hazard(high) < target and high < 1e4:
        low, high = high, high * 4
    for _ in range(10):  # log-space bisection: the hazard grows roughly exponentially with the scale
        mid = math.sqrt(low * high)
        low, high = (mid, high) if hazard(mid) < target else (low, mid)
    set_scale(high)
    return high


def suppress_eos(model: Any, eos_id: int, logit_scale: float) -> None:
    """No length tail: the EOS row of the LM head is zero (logit 0) and the other rows scaled so the logits' spread is
    `logit_scale` (max ~3x that): P(EOS) ~ exp(-3 x logit_scale) per token, every completion runs to the cap. A step's
    cost does not depend on how peaked the distribution is."""
    import torch

    device = model.lm_head.weight.device
    vocab = min(model.lm_head.weight.shape[0], 512)
    probe = torch.randint(3, vocab, (8, 32), generator=torch.Generator().manual_seed(0)).to(device)
    spread = float(model(input_ids=probe).logits.float().std())
    model.lm_head.weight.mul_(logit_scale / spread)
    model.lm_head.weight[eos_id] = 0.0


# ------------------------------------------------------------------------------------------------------- workers


class WorkerError(RuntimeError):
    """A point failed in its worker (the worker's message and stderr tail), or ran past its timeout."""


def serve_points(run_point: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The worker side (`--worker`): read one JSON spec per stdin line, answer each with `run_point(spec)` as one
    marked stdout line (libraries may print too), until stdin closes. A failure is answered as `{"error": ...}`; the
    parent then replaces the process."""
    import traceback

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = run_point(json.loads(line))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
            answer = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        print(RESULT_PREFIX + json.dumps(answer), flush=True)
        if "error" in answer:
            return


class _Worker:
    def __init__(self, script: Path, env: dict[str, str]) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr, text=True, bufsize=1, env=env, start_new_session=True,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                self.lines.put(line[len(RESULT_PREFIX) :])
        self.lines.put(None)  # the process closed its stdout (exited)

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]

    def ask(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise WorkerError(f"timed out after {timeout:.0f} s") from None
        if line is None:
            raise WorkerError(f"the worker exited (status {self.proc.wait()}):\n{self.stderr_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise WorkerError(f"{answer['error']}\n{answer.get('traceback', '')}\n{self.stderr_tail()}")
        return answer

    def kill(self) -> None:
        """Stop this worker and whatever it started (its own session: servers, load processes)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.stderr.close()

    def close(self) -> None:
        if self.proc.stdin is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class Workers:
    """Worker processes of one script (`script --worker`, answering with `serve_points`), one per `group`.

    `run(spec, group)` runs one point in the group's process, started at first use and kept for the group's next
    point; `group=None` runs it in a process of its own, stopped after it. A failed or timed-out point raises
    `WorkerError` and its process is replaced at the group's next point."""

    def __init__(self, script: Path) -> None:
        self.script = script
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.pool: dict[str, _Worker] = {}
        if threading.current_thread() is threading.main_thread():
            # The workers run in sessions of their own (so that a kill reaches what they started): a SIGTERM to this
            # process (`timeout`, a job scheduler) must stop them too, through `close`, not orphan them.
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def run(self, spec: dict[str, Any], group: str | None, timeout: float) -> dict[str, Any]:
        worker = self.pool.pop(group, None) if group is not None else None
        worker = worker or _Worker(self.script, self.env)
        try:
            answer = worker.ask(spec, timeout)
        except BaseException:  # a failed point, or this process stopping (SIGTERM, Ctrl-C) while the point runs
            worker.kill()
            raise
        if group is None:
            worker.close()
        else:
            self.pool[group] = worker
        return answer

    def close(self) -> None:
        for worker in self.pool.values():
            worker.close()
        self.pool.clear()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------------- results


class ResultFile:
    """One run's JSON document, rewritten (atomically) after every point, its PNG redrawn with it.

    The document: `{"benchmark", "config", "env", "complete", "points": [...], "failed": [...], **summary}`; each
    point holds its `key` (what identifies it in the sweep). `resume`: an earlier document of the same benchmark whose
    measured settings (`config` minus `RUN_OPTIONS`) match: its points are kept and `has(key)` is true for them."""

    def __init__(
        self,
        benchmark: str,
        args: argparse.Namespace,
        summarize: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
        render: Callable[[Path, Path], Path] | None = None,
    ) -> None:
        self.benchmark, self.summarize, self.render = benchmark, summarize, render
        self.config, self.points, self.failed = config_of(args), [], []
        if args.resume is not None:
            earlier = json.loads(args.resume.read_text())
            if earlier.get("benchmark") != benchmark:
                raise SystemExit(
                    f"--resume: {args.resume} is a {earlier.get('benchmark')!r} result, not {benchmark!r}"
                )
            differ = sorted(
                k for k in set(self.config) | set(earlier["config"])
                if k not in RUN_OPTIONS and self.config.get(k) != earlier["config"].get(k)
            )  # fmt: skip
            if differ:
                raise SystemExit(f"--resume: {args.resume} was measured with other settings: {differ}")
            self.points = earlier["points"]
            self.path = args.resume
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            self.path = args.out / f"{benchmark}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        self.env = environment(args.device)

    def has(self, key: Sequence[Any]) -> bool:
        return any(p["key"] == list(key) for p in self.points)

    def add(self, key: Sequence[Any], point: dict[str, Any]) -> None:
        self.points.append({"key": list(key), **point})
        self.save()

    def fail(self, key: Sequence[Any], error: str) -> None:
        """A point that failed or timed out: named in the document, the sweep goes on."""
        self.failed.append({"key": list(key), "error": error[-2000:]})
        print(f"point {list(key)} failed: {error[-600:]}", file=sys.stderr, flush=True)
        self.save()

    def payload(self, complete: bool = False) -> dict[str, Any]:
        summary = self.summarize(self.points) if self.summarize and self.points else {}
        return {
            "benchmark": self.benchmark, "config": self.config, "env": self.env, "complete": complete,
            "points": self.points, "failed": self.failed, **summary,
        }  # fmt: skip

    def save(self, complete: bool = False) -> dict[str, Any]:
        payload = self.payload(complete)
        staging = self.path.with_suffix(".json.tmp")
        staging.write_text(json.dumps(payload, indent=1))
        os.replace(staging, self.path)
        if self.render is not None and self.points:
            try:
                self.render(self.path, self.path.with_suffix(".png"))
            except Exception as exc:  # noqa: BLE001 - a plot must never cost a measured point
                print(f"plot not drawn: {type(exc).__name__}: {exc}", file=sys.stderr)
        return payload

    def finish(self, table: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """The final document: written, `table(document)` printed (when there are points), its paths, then the
        document itself as the last stdout line."""
        payload = self.save(complete=not self.failed)
        if table is not None and self.points:
            table(payload)
        print(f"results: {self.path}" + (f"\nplot: {self.path.with_suffix('.png')}" if self.render else ""))
        print(json.dumps(payload))
        return payload


def replot(path: Path, render: Callable[[Path, Path], Path]) -> None:
    """`--replot FILE`: redraw FILE's PNG next to it."""
    print(render(path, path.with_suffix(".png")))


def other_mode(
    args: argparse.Namespace,
    run_point: Callable[[dict[str, Any]], dict[str, Any]] | None,
    render: Callable[[Path, Path], Path],
) -> bool:
    """Run the modes every script shares instead of its sweep (`--worker`: answer points; `--replot FILE`) and say
    whether one ran."""
    if getattr(args, "worker", False) and run_point is not None:
        serve_points(run_point)
        return True
    if args.replot:
        replot(args.replot, render)
        return True
    return False


def environment(device: str) -> dict[str, Any]:
    """Machine, versions, commit and load, so a result file says where and with what it was measured."""
    import torch
    import transformers
    import trl

    import trl_cb

    if device.startswith("cuda") and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "device": device_name, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__, "trl_cb": trl_cb.__version__,
        "git_commit": commit, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg": os.getloadavg(),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------ measurements


def summarize(values: Sequence[float]) -> dict[str, float]:
    """median/mean/std/min/max of a list of measurements (std 0 for one value)."""
    vals = list(values)
    return {
        "median": statistics.median(vals), "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "min": min(vals), "max": max(vals),
    }  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[rank])


def length_stats(lengths: Sequence[int], cap: int | None = None) -> dict[str, float]:
    """Completion lengths: p50/p90/max/mean, and the share at the cap when given."""
    out = {
        "p50": percentile(lengths, 50), "p90": percentile(lengths, 90), "max": max(lengths),
        "mean": statistics.fmean(lengths),
    }  # fmt: skip
    if cap is not None:
        out["at_cap"] = sum(1 for n in lengths if n >= cap) / len(lengths)
    return out


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (Linux `clear_refs`) and return the current RSS: `peak_rss_bytes() - it` is then
    the peak of the work that follows, even when earlier work in the process peaked higher."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident set size since the last `reset_peak_rss` (or its start)."""
    peak = _status_bytes("VmHWM")
    if peak:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def record_call_times(obj: Any, name: str) -> list[float]:
    """Replace the method `obj.<name>` by a wrapper that appends each call's wall-clock seconds to the returned list
    (the trainer's wait for rollouts inside a step, a weight push), without changing what the call does."""
    times: list[float] = []
    original = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    return times


@contextmanager
def background_load(num_processes: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`num_processes` busy-looping Python processes for the duration of the block: the condition of a shared machine,
    where thread pools that spin while waiting behave very differently. Stops only the processes it started."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(num_processes)
    ]
    try:
        if procs:
            time.sleep(0.2)  # let them get scheduled before measuring
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


@contextmanager
def served_model(
    model: Any, tokenizer: Any, threads: int, device: str = "cpu", dtype: str = "float32"
) -> Iterator[str]:
    """A local `trl-cb serve` replica (`threads` torch threads, on `device` in `dtype`) holding a copy of `model`;
    yields its URL. The trainer pushes its own weights before the first sample, so the copy only fixes the shape."""
    from trl_cb.serving.launch import local_rollout_server

    with tempfile.TemporaryDirectory(prefix="trl_cb_served_") as directory:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        extra = ["--device", device, "--dtype", dtype]
        with local_rollout_server(directory, threads=threads, extra_args=extra) as server:
            yield server.url


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: `columns` is [(key, header)]; floats get 3 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return "-" if value is None else str(value)

    table = [[header for _, header in columns]] + [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
