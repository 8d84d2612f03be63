"""`trl-cb serve`: run a rollout server (docs/server.md) on uvicorn. Thin: parsing and loading only; the app is
`trl_cb.serving.server.create_app`. Every option is checked while parsing (bad `--continuous_batching_config` JSON or
keys: exit status 2 naming the option), before any model is loaded. Ctrl-C stops it within about a second
(`timeout_graceful_shutdown=1`, then `os._exit`: interpreter teardown alone takes seconds); its queued requests are
answered 503 with `Retry-After` first (`serving.server.serve`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI


def continuous_batching_config(text: str) -> dict[str, Any]:
    """`--continuous_batching_config`: a JSON object of `ContinuousBatchingConfig` kwargs, keys checked here so that a
    typo fails in a second instead of after the model loaded."""
    from ..checks.engine_config import validate_cb_kwargs  # imports transformers: not at `trl-cb --help` time

    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of ContinuousBatchingConfig kwargs, got {text!r}")
    try:
        validate_cb_kwargs(config)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return config


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-cb serve", description="Serve rollouts with trl_cb's CB engine.")
    parser.add_argument("--model", required=True, help="checkpoint directory, hub name, or trl-cb/tiny")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (loopback by default)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    parser.add_argument(
        "--continuous_batching_config",
        type=continuous_batching_config,
        default=None,
        help="ContinuousBatchingConfig kwargs as a JSON object, e.g. '{\"max_memory_percent\": 0.3}'",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="prefill every prompt whole (default: reuse earlier requests' KV blocks for a shared prefix, never "
        "across a weight update)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="most sequences generating at once (more requests queue)"
    )
    parser.add_argument(
        "--gil-switch-interval-ms",
        type=positive_float,
        default=None,
        help="the interpreter's GIL hand-over interval (Python's default: 5 ms); lower answers /health and short "
        "requests sooner while answers are built, at some throughput (docs/benchmarks.md)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=None,
        help="largest request body read, in bytes (413 past it, counted while reading); default "
        "serving.protocol.DEFAULT_MAX_BODY_BYTES, 16 MiB",
    )
    return parser


def build_app(args: argparse.Namespace) -> FastAPI:
    """Load `args.model` in `args.dtype` on `args.device` and wrap it in the server app (what `main` serves)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..offline.tiny import resolve_model_name
    from ..serving.server import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_name(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    return create_app(
        model,
        tokenizer=load_tokenizer(path),
        model_name=args.model,
        api_key=args.api_key,
        continuous_batching_config=args.continuous_batching_config,
        max_num_seqs=args.max_num_seqs,
        prefix_caching=args.prefix_caching,
        **({"max_body_bytes": args.max_body_bytes} if args.max_body_bytes else {}),
    )


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer (text prompts and chat on the OpenAI-compatible routes), or None with a warning:
    then only token-id prompts are served."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        logging.getLogger(__name__).warning("No tokenizer at %s (%s): only token-id prompts are served.", path, exc)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..serving.server import serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    try:
        switch = args.gil_switch_interval_ms
        serve(app, args.host, args.port, timeout_graceful_shutdown=1, gil_switch_interval_ms=switch)  # SIGINT: 503s
    finally:
        app.state.engine_loop.close()
    # Nothing is left to save; the interpreter's teardown (torch, thread pools) takes ~5 s on CPU, which would break
    # the Ctrl-C-within-2-s promise: end the process now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
