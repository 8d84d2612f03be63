"""`trl-cb grpo | rloo | check-model | serve`: TRL's training command line, training with trl_cb's trainers.

Built from TRL's own pieces (`TrlParser`, `trl grpo` / `trl rloo`'s script arguments, `ModelConfig`,
`DatasetMixtureConfig`) with trl_cb's configs, so TRL's flags and recipes work and every trl_cb field is a flag too;
`use_transformers_continuous_batching` defaults to on. Unknown arguments must be `accelerate launch` options (else exit
status 2, before any model is loaded); outside a launcher the command re-runs itself under `accelerate launch -m
trl_cb.cli`. Offline names (nothing downloaded): models `trl-cb/tiny` and `trl-cb/tiny-no-eos-bias` (`offline/`,
saved once under the temp directory, rank 0 first), datasets `trl-cb/gsm8k` (the shipped GSM8K test split) and
`trl-cb/gsm8k-synthetic`. Rewards by name: `gsm8k_reward`, `char_share_reward` (what a random tiny model learns),
the names `trl grpo` knows, or `module.path:function`. Details: docs/index.md, "Command line". TRL pieces beyond its
top-level API are pinned by tests/unit/test_contracts.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..offline.names import TINY_MODEL, is_tiny_model_name

MODULE = "trl_cb.cli"  # what `accelerate launch --module` runs; `__name__` is "__main__" under `python -m`
logger = logging.getLogger(MODULE)

VENDORED_GSM8K = "trl-cb/gsm8k"
VENDORED_GSM8K_TEST_ROWS = 128
SYNTHETIC_GSM8K = "trl-cb/gsm8k-synthetic"
SYNTHETIC_GSM8K_ROWS = {"train": (1024, 0), "test": (128, 1)}  # split: (rows, seed)
# Set in the environment of the process this module re-runs under `accelerate launch` (accelerate copies it).
LAUNCHED_ENV = "TRL_CB_LAUNCHED"
ALGORITHMS = ("grpo", "rloo")
_EPILOG = (
    "Any other option is passed to `accelerate launch` (e.g. --num_processes 2, --config_file FILE, or TRL's "
    "--accelerate_config NAME|PATH). Offline names: --model_name_or_path trl-cb/tiny | trl-cb/tiny-no-eos-bias, "
    "--dataset_name trl-cb/gsm8k | trl-cb/gsm8k-synthetic. See docs/index.md, 'Command line'."
)


@dataclass(frozen=True)
class Algorithm:
    """What differs between `trl-cb grpo` and `trl-cb rloo`: TRL's script arguments, our config and trainer."""

    name: str
    script_arguments: type
    config: type
    trainer: type


def algorithm(name: str) -> Algorithm:
    """The classes for `name` (`grpo` or `rloo`), imported on demand: `trl-cb --help` stays fast."""
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.rloo import RLOOScriptArguments

    from ..configs import GRPOConfig, RLOOConfig
    from ..trainers import GRPOTrainer, RLOOTrainer

    table = {
        "grpo": Algorithm("grpo", GRPOScriptArguments, GRPOConfig, GRPOTrainer),
        "rloo": Algorithm("rloo", RLOOScriptArguments, RLOOConfig, RLOOTrainer),
    }
    if name not in table:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {sorted(table)}.")
    return table[name]


def make_parser(name: str, prog: str | None = None) -> Any:
    """`TrlParser` over (script arguments, trl_cb config, `ModelConfig`, `DatasetMixtureConfig`) — `trl <name>`'s."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    algo = algorithm(name)
    prog = prog or f"trl-cb {name}"
    parser = TrlParser(
        (algo.script_arguments, algo.config, ModelConfig, DatasetMixtureConfig),
        prog=prog,
        usage=f"{prog} [--config RECIPE.yaml] [--option value ...] [accelerate launch options]",
        epilog=_EPILOG,
    )
    # The point of `trl-cb` over `trl`: CB rollouts unless told otherwise (`false` gives TRL's generate() path).
    parser.set_defaults(use_transformers_continuous_batching=True)
    return parser


# --- rewards, model and data -------------------------------------------------------------------------------------


def reward_registry() -> dict[str, Callable[..., list[float]]]:
    """Reward functions known by bare name: trl_cb's two rewards and the names `trl grpo` / `trl rloo` accept."""
    from trl import rewards

    from ..offline.data import char_share_reward, gsm8k_reward

    return {
        "gsm8k_reward": gsm8k_reward,
        "char_share_reward": char_share_reward(),  # share of "a", at least 20 chars: what a random tiny model learns
        "accuracy_reward": rewards.accuracy_reward,
        "reasoning_accuracy_reward": rewards.reasoning_accuracy_reward,
        "think_format_reward": rewards.think_format_reward,
        # The values `trl grpo` uses for this factory, so that a TRL recipe means the same here.
        "get_soft_overlong_punishment": rewards.get_soft_overlong_punishment(
            max_completion_len=1280, soft_punish_cache=256
        ),
    }


def resolve_reward(name: str) -> Callable[..., list[float]]:
    """A reward function from a registry name, `module.path:function` or `module.path.function`.

    Import paths are resolved with the working directory on `sys.path`, as `trl grpo` does, so a `rewards.py` next
    to the recipe works.
    """
    registry = reward_registry()
    if name in registry:
        return registry[name]
    module_path, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not (sep and module_path and attr):
        raise ValueError(
            f"Unknown reward function {name!r}: expected one of {sorted(registry)} or an import path "
            "'module.path:function'."
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        func = getattr(importlib.import_module(module_path), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"Could not load reward function {name!r}: {err}") from err
    if not callable(func):
        raise ValueError(f"Reward function {name!r} is not callable (got {type(func).__name__}).")
    return func


def resolve_model(name_or_path: str | None) -> str:
    """An offline name (`trl-cb/tiny`, `trl-cb/tiny-no-eos-bias`) becomes the local tiny checkpoint; hub ids and paths
    pass through unchanged."""
    if not name_or_path:
        raise ValueError(f"--model_name_or_path is required (a hub id, a local path, or {TINY_MODEL!r} offline).")
    if not is_tiny_model_name(name_or_path):
        return name_or_path  # without importing torch: the CLI's parser starts fast
    from ..offline.tiny import resolve_model_name

    return resolve_model_name(name_or_path)


def load_datasets(script_args: Any, dataset_args: Any) -> Any:
    """The `DatasetDict` to train (and evaluate) on, chosen exactly as `trl grpo` chooses it, plus our offline name.

    `datasets` (a mixture) wins over `dataset_name`; GSM8K-shaped splits are mapped to `prompt`/`answer` records.
    """
    from datasets import Dataset, DatasetDict, load_dataset
    from trl import get_dataset

    from ..offline.data import synthetic_gsm8k

    if dataset_args.datasets:
        if script_args.dataset_name:
            logger.warning("Both `datasets` and `dataset_name` are set: loading `datasets`, ignoring `dataset_name`.")
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name == VENDORED_GSM8K:
        from ..offline.data import gsm8k_test

        rows = gsm8k_test(seed=0)
        held_out = VENDORED_GSM8K_TEST_ROWS
        train, test = rows[held_out:], rows[:held_out]
        dataset = DatasetDict({"train": Dataset.from_list(train), "test": Dataset.from_list(test)})
    elif script_args.dataset_name == SYNTHETIC_GSM8K:
        splits = SYNTHETIC_GSM8K_ROWS
        dataset = DatasetDict({s: Dataset.from_list(synthetic_gsm8k(n, seed)) for s, (n, seed) in splits.items()})
    elif script_args.dataset_name:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError(
            "Either `datasets` or `dataset_name` must be provided "
            f"({VENDORED_GSM8K!r} or {SYNTHETIC_GSM8K!r} offline)."
        )
    return type(dataset)({split: _as_prompt_records(ds) for split, ds in dataset.items()})  # (Iterable)DatasetDict


def _as_prompt_records(dataset: Any) -> Any:
    """Map a GSM8K-shaped split (`question`, `answer`, no `prompt`) to `prompt`/`answer`; anything else as it is."""
    from ..offline.data import gsm8k_record

    columns = set(dataset.column_names or [])
    if "prompt" in columns or not {"question", "answer"} <= columns:
        return dataset
    logger.info("GSM8K columns found (question/answer): mapping to prompt/answer records.")
    return dataset.map(lambda row: gsm8k_record(row["question"], row["answer"]), remove_columns=sorted(columns))


# --- running -----------------------------------------------------------------------------------------------------


def train(algo: Algorithm, script_args: Any, training_args: Any, model_args: Any, dataset_args: Any) -> None:
    """Train, save and finish as `trl grpo` / `trl rloo` do, with trl_cb's trainer."""
    from trl import get_peft_config, get_quantization_config

    reward_funcs: list[Any] = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    reward_funcs += [resolve_reward(name) for name in script_args.reward_funcs or []]
    if not reward_funcs:
        raise ValueError("No reward: pass --reward_funcs (e.g. gsm8k_reward) and/or --reward_model_name_or_path.")

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    # Rank 0 first: under torch.distributed only rank 0 writes checkpoint files (the offline tiny model).
    with training_args.main_process_first(local=False, desc="offline model and data"):
        model = resolve_model(model_args.model_name_or_path)
        dataset = load_datasets(script_args, dataset_args)
    trainer = algo.trainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    acc = trainer.accelerator
    rank, world, kind = acc.process_index, acc.num_processes, acc.distributed_type
    logger.info("trl-cb %s: process %d of %d (%s)", algo.name, rank, world, kind)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()  # finish the trackers, destroy the process group


def under_launcher() -> bool:
    """True inside `accelerate launch` (any launcher sets ACCELERATE_MIXED_PRECISION), torchrun, or our re-run."""
    return any(key in os.environ for key in (LAUNCHED_ENV, "ACCELERATE_MIXED_PRECISION", "LOCAL_RANK"))


def launch_options(remaining: list[str]) -> list[str] | None:
    """`remaining` as `accelerate launch` arguments (`--accelerate_config` resolved), or None if they are not."""
    from accelerate.commands.launch import launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    try:
        resolved = resolve_accelerate_config_argument(list(remaining))
    except ValueError:
        return None
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parsed, unknown = launch_command_parser().parse_known_args([*resolved, "--module", MODULE])
        except SystemExit:  # a launch option with a bad value
            return None
    ok = not unknown and parsed.training_script == MODULE and not parsed.training_script_args
    return resolved if ok else None


def relaunch(name: str, argv: list[str], launch_args: list[str]) -> int:
    """Re-run `trl-cb <name> argv` under `accelerate launch <launch_args>`; the launched processes' exit status."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args([*launch_args, "--module", MODULE, name, *argv])
    os.environ[LAUNCHED_ENV] = "1"
    try:
        launch_command(args)
    except subprocess.CalledProcessError as err:  # one process: its traceback is already on stderr
        return err.returncode or 1
    except ChildFailedError as err:  # several processes: torchrun's summary names the failed ranks
        logger.error("%s", err)
        return 1
    return 0


def run_training(name: str, argv: list[str]) -> int:
    """`trl-cb grpo|rloo ARGS`: parse (`--help` exits here), refuse unknown options, launch or train."""
    import yaml
    from trl.cli.commands.training import _subtract_subsequence

    prog = f"trl-cb {name}"
    parser = make_parser(name, prog=prog)
    try:
        *dataclasses, config_remaining, cli_remaining = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except (ValueError, OSError, yaml.YAMLError) as err:  # bad recipe, or a config's `__post_init__` refusing a value
        return _fail(prog, str(err))
    try:  # fail fast, before anything is launched or loaded
        for reward in dataclasses[0].reward_funcs or []:
            resolve_reward(reward)
    except ValueError as err:
        return _fail(prog, str(err))
    launched = under_launcher()
    if launched and cli_remaining:
        as_launch = launch_options(cli_remaining) is not None
        hint = " (an `accelerate launch` option: put it before `-m trl_cb.cli`)" if as_launch else ""
        return _fail(prog, f"unrecognized arguments: {' '.join(cli_remaining)}{hint}")
    remaining = config_remaining + cli_remaining
    launch_args = launch_options(remaining) if remaining else []
    if launch_args is None:
        return _fail(
            prog,
            f"unrecognized arguments: {' '.join(remaining)} (neither a {name} option nor an `accelerate launch` "
            "option; a recipe key counts as `--key value`)",
        )
    if not launched:
        return relaunch(name, _subtract_subsequence(argv, cli_remaining), launch_args)
    if config_remaining:
        logger.info("Recipe keys left to the launcher: %s", " ".join(config_remaining))
    train(algorithm(name), *dataclasses)
    return 0


def run_check_model(argv: list[str]) -> int:
    """`trl-cb check-model ARGS`: `trl_cb.cli.check_model.main(argv)`, imported only when asked for."""
    try:
        from .check_model import main as check_model_main
    except ModuleNotFoundError as err:
        if err.name != "trl_cb.cli.check_model":
            raise
        return _fail("trl-cb check-model", "not available in this installation of trl_cb (no trl_cb.cli.check_model).")
    return int(check_model_main(argv) or 0)


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}\nRun '{prog} --help' for the options.", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `trl-cb` console script and of `python -m trl_cb.cli`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="trl-cb",
        description="TRL's GRPO/RLOO command line with trl_cb's continuous-batching rollouts.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", metavar="{grpo,rloo,check-model,serve}")
    for name in ALGORITHMS:
        sub.add_parser(name, help=f"train with {name.upper()} (`trl-cb {name} --help`)", add_help=False)
    sub.add_parser("check-model", help="check that a model samples correctly through CB", add_help=False)
    sub.add_parser("serve", help="run a rollout server (`trl-cb serve --help`, docs/server.md)", add_help=False)
    args, _ = parser.parse_known_args(argv[:1])
    if args.command is None:
        parser.print_help()
        return 0
    rest = argv[1:]
    if args.command == "check-model":
        return run_check_model(rest)
    if args.command == "serve":
        from .serve import main as serve_main

        return serve_main(rest)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("trl_cb").setLevel(logging.INFO)
    return run_training(args.command, rest)


if __name__ == "__main__":
    sys.exit(main())
