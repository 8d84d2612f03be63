"""`trl-cb serve`: run a rollout server (docs/server.md) on uvicorn. Thin: parsing and loading only; the app is
`trl_cb.serving.server.create_app`. Ctrl-C stops it within about a second (`timeout_graceful_shutdown=1`, then
`os._exit`: interpreter teardown alone takes seconds)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-cb serve", description="Serve rollouts with trl_cb's CB engine.")
    parser.add_argument("--model", required=True, help="checkpoint directory, hub name, or trl-cb/tiny")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (loopback by default)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    parser.add_argument("--continuous_batching_config", default=None, help="ContinuousBatchingConfig kwargs as JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="most sequences generating at once (more requests queue)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    import uvicorn
    from transformers import AutoModelForCausalLM

    from ..offline.names import is_tiny_model_name
    from ..offline.tiny import tiny_model_path
    from ..serving.server import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = tiny_model_path(args.model) if is_tiny_model_name(args.model) else args.model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    cb_config = json.loads(args.continuous_batching_config) if args.continuous_batching_config else None
    app = create_app(
        model,
        model_name=args.model,
        api_key=args.api_key,
        continuous_batching_config=cb_config,
        max_num_seqs=args.max_num_seqs,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=1)
    finally:
        app.state.engine.close()
    # Nothing is left to save; the interpreter's teardown (torch, thread pools) takes ~5 s on CPU, which would break
    # the Ctrl-C-within-2-s promise: end the process now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
