"""`trl-cb grpo|rloo|check-model` in process: parsing, refusals, names (rewards, offline model and data), dispatch.

End-to-end runs (subprocess, `accelerate launch`) are in tests/integration/test_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from trl import DatasetMixtureConfig, ScriptArguments

import trl_cb
from trl_cb.cli import command as cli
from trl_cb.offline import names
from trl_cb.offline.data import gsm8k_reward

ROOT = Path(__file__).resolve().parents[3]
RECIPES = ROOT / "examples" / "recipes"


@pytest.mark.parametrize(
    ("name", "config_cls", "trainer_cls"),
    [("grpo", trl_cb.GRPOConfig, trl_cb.GRPOTrainer), ("rloo", trl_cb.RLOOConfig, trl_cb.RLOOTrainer)],
)
def test_recipe_parses_into_trl_cb_classes(name, config_cls, trainer_cls):
    assert cli.algorithm(name).trainer is trainer_cls
    script, training, model, data = cli.make_parser(name).parse_args_and_config(
        ["--config", str(RECIPES / f"{name}_tiny.yaml"), "--max_steps", "3", "--cb_importance_sampling_clip_max", "2"]
    )
    assert type(training) is config_cls and training.use_transformers_continuous_batching
    assert training.max_steps == 3 and training.cb_importance_sampling_clip_max == 2.0  # command line beats recipe
    assert training.transformers_continuous_batching_config == {"max_memory_percent": 0.5}  # our __post_init__ ran
    assert (model.model_name_or_path, script.dataset_name) == (names.TINY_MODEL_NO_EOS_BIAS, cli.VENDORED_GSM8K)
    assert script.reward_funcs == ["char_share_reward"] and data.datasets == []


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_continuous_batching_is_on_unless_turned_off(name):
    training = cli.make_parser(name).parse_args_and_config(["--bf16", "false"])[1]
    assert training.use_transformers_continuous_batching
    off = ["--bf16", "false", "--use_transformers_continuous_batching", "false"]
    assert not cli.make_parser(name).parse_args_and_config(off)[1].use_transformers_continuous_batching


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_every_trl_flag_is_accepted(name):
    """Whatever `trl grpo` / `trl rloo` accepts, `trl-cb` accepts: TRL's own parser's options are a subset of ours."""
    trl_script = __import__(f"trl.scripts.{name}", fromlist=["make_parser"])
    theirs = {s for a in trl_script.make_parser()._actions for s in a.option_strings}
    ours = {s for a in cli.make_parser(name)._actions for s in a.option_strings}
    assert len(theirs) > 100 and theirs <= ours, sorted(theirs - ours)
    assert {"--use_transformers_continuous_batching", "--cb_async_generation", "--cb_importance_sampling_mode"} <= ours


def test_unknown_flag_fails_clearly_before_loading_anything(capsys):
    rc = cli.main(["grpo", "--config", str(RECIPES / "grpo_tiny.yaml"), "--no_such_flag", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "trl-cb grpo: error: unrecognized arguments: --no_such_flag 3" in err
    assert "Traceback" not in err and "--help" in err


def test_unknown_recipe_key_fails_clearly(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((RECIPES / "rloo_tiny.yaml").read_text() + "\nnum_generation: 4\n")  # typo of num_generations
    assert cli.main(["rloo", "--config", str(recipe)]) == 2
    assert "unrecognized arguments: --num_generation 4" in capsys.readouterr().err


def test_bad_values_fail_clearly(capsys):
    # A config's __post_init__ refusing a value: its message, exit 2, no traceback.
    bounds = ["--cb_importance_sampling_clip_min", "2", "--cb_importance_sampling_clip_max", "1"]
    assert cli.main(["rloo", *bounds, "--bf16", "false"]) == 2
    assert "must be smaller than clip_max" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse's own refusal (choices)
        cli.main(["grpo", "--cb_importance_sampling_mode", "nope"])
    assert exc.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_launch_options(tmp_path):
    config = ROOT / "examples" / "accelerate_configs" / "ddp.yaml"
    assert cli.launch_options(["--num_processes", "2", "--cpu"]) == ["--num_processes", "2", "--cpu"]
    assert cli.launch_options(["--accelerate_config", str(config)]) == ["--config_file", str(config)]
    assert cli.launch_options(["--accelerate_config", "zero3"])[0] == "--config_file"  # TRL's shipped names
    for bad in (["--no_such_flag"], ["--num_processes", "two"], ["--accelerate_config", str(tmp_path / "none")]):
        assert cli.launch_options(bad) is None, bad


def test_launch_options_are_refused_under_a_launcher(monkeypatch, capsys):
    """Inside `accelerate launch` a launch option on our command line would be lost: say where it belongs."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert cli.main(["grpo", "--bf16", "false", "--num_processes", "2"]) == 2
    assert "put it before `-m trl_cb.cli`" in capsys.readouterr().err


def test_outside_a_launcher_it_relaunches_with_the_launch_options(monkeypatch):
    """The launch options go to `accelerate launch`, everything else to the re-run, recipe keys stay in the recipe."""
    for key in (cli.LAUNCHED_ENV, "ACCELERATE_MIXED_PRECISION", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    seen = {}
    monkeypatch.setattr(cli, "relaunch", lambda name, argv, launch: seen.update(name=name, argv=argv, launch=launch))
    recipe = str(RECIPES / "grpo_tiny.yaml")
    cli.main(["grpo", "--config", recipe, "--num_processes", "2", "--max_steps", "2", "--cpu"])
    assert seen == {
        "name": "grpo",
        "argv": ["--config", recipe, "--max_steps", "2"],
        "launch": ["--num_processes", "2", "--cpu"],
    }


def test_bad_reward_name_fails_before_launching(monkeypatch, capsys):
    monkeypatch.setattr(cli, "relaunch", lambda *a: pytest.fail("launched despite a bad reward name"))
    assert cli.main(["grpo", "--config", str(RECIPES / "grpo_tiny.yaml"), "--reward_funcs", "gsm8k"]) == 2
    assert "Unknown reward function 'gsm8k'" in capsys.readouterr().err


def test_a_failed_launch_fails_the_command(monkeypatch):
    """The launched process's exit status is the command's: a failed run never reads as success."""
    import subprocess

    def failing_launch(args):
        assert args.module and args.training_script == cli.MODULE and args.training_script_args[:1] == ["grpo"]
        raise subprocess.CalledProcessError(returncode=3, cmd=["python", "-m", cli.MODULE])

    monkeypatch.setattr("accelerate.commands.launch.launch_command", failing_launch)
    monkeypatch.setenv(cli.LAUNCHED_ENV, "")  # restored (unset) after the test
    assert cli.relaunch("grpo", ["--max_steps", "1"], ["--num_processes", "1"]) == 3
    assert os.environ[cli.LAUNCHED_ENV] == "1"  # what tells the launched process it is the re-run


def test_reward_names():
    from trl.rewards import accuracy_reward, think_format_reward

    assert cli.resolve_reward("gsm8k_reward") is gsm8k_reward
    assert cli.resolve_reward("trl_cb.offline.data:gsm8k_reward") is gsm8k_reward
    assert cli.resolve_reward("trl_cb.offline.data.gsm8k_reward") is gsm8k_reward  # TRL's spelling
    assert cli.resolve_reward("accuracy_reward") is accuracy_reward
    share = cli.resolve_reward("char_share_reward")  # trl_cb.offline.data.char_share_reward() with its defaults
    assert share(["a" * 10, "ab" * 15, ""]) == [0.5, 0.5, 0.0] and share.__name__ == "share_of_'a'"
    assert cli.resolve_reward("think_format_reward") is think_format_reward
    overlong = cli.resolve_reward("get_soft_overlong_punishment")  # TRL's CLI values: 1280 tokens, 256 of slack
    assert overlong(completion_ids=[[0] * 1000, [0] * 1280 + [0] * 5]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="gsm8k_reward"):
        cli.resolve_reward("gsm8k")
    with pytest.raises(ValueError, match="Could not load reward function 'no_such_module:f'"):
        cli.resolve_reward("no_such_module:f")
    with pytest.raises(ValueError, match="not callable"):
        cli.resolve_reward("trl_cb.cli:TINY_MODEL")


def test_reward_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_for_cli_test.py").write_text("def short(completions, **kw):\n    return [0.5]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert cli.resolve_reward("my_rewards_for_cli_test:short")(["x"]) == [0.5]


def test_tiny_model_name(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = Path(cli.resolve_model(cli.TINY_MODEL))
    assert path.parent == tmp_path and (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    plain = Path(cli.resolve_model(names.TINY_MODEL_NO_EOS_BIAS))
    assert plain.parent == tmp_path and plain != path and (plain / "config.json").is_file()
    from safetensors.torch import load_file

    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    biased, unbiased = (load_file(p / "model.safetensors")["lm_head.weight"][eos] for p in (path, plain))
    assert biased.norm() > 5 * unbiased.norm()  # only the EOS row differs (bias_eos replaces it)
    assert cli.resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(ValueError, match="--model_name_or_path is required"):
        cli.resolve_model(None)


def test_tiny_checkpoint_tolerates_a_concurrent_writer(tmp_path, monkeypatch):
    """Ranks of one launch build the tiny checkpoint at once: the loser keeps the winner's copy, leaves no debris."""
    from trl_cb.offline import tiny

    target = tmp_path / "tiny"
    real_tokenizer = tiny.tiny_tokenizer

    def other_rank_finishes_first(*args, **kwargs):
        tok = real_tokenizer(*args, **kwargs)
        target.mkdir()
        (target / "config.json").write_text("{}")  # the other rank's complete checkpoint
        (target / "chat_template.jinja").write_text("")
        return tok

    monkeypatch.setattr(tiny, "tiny_tokenizer", other_rank_finishes_first)
    assert tiny.tiny_checkpoint(target) == str(target)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"] and (target / "config.json").read_text() == "{}"


def test_tiny_checkpoint_refuses_to_publish_an_incomplete_copy(tmp_path, monkeypatch):
    """Under torch.distributed transformers writes checkpoints from rank 0 only; another rank's empty copy must never
    be renamed into place (other ranks would then load a directory without config.json)."""
    import transformers

    from trl_cb.offline import tiny

    monkeypatch.setattr(transformers.PreTrainedModel, "should_save_on_this_rank", lambda self, main: False)
    with pytest.raises(RuntimeError, match="not rank 0"):
        tiny.tiny_checkpoint(tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_offline_dataset_name():
    data = cli.load_datasets(ScriptArguments(dataset_name=cli.SYNTHETIC_GSM8K), DatasetMixtureConfig())
    assert {k: v.num_rows for k, v in data.items()} == {"train": 1024, "test": 128}
    assert data["train"].column_names == ["prompt", "answer"] and data["train"][0]["answer"].lstrip("-").isdigit()
    with pytest.raises(ValueError, match="dataset_name"):
        cli.load_datasets(ScriptArguments(), DatasetMixtureConfig())


def test_gsm8k_shaped_data_is_mapped_to_prompt_records(tmp_path):
    """Real GSM8K rows (`question`, worked `answer` ending in `#### N`) become what `gsm8k_reward` scores."""
    rows = [
        {"question": "What is 1200+34?", "answer": "1200+34=1234\n#### 1,234"},
        {"question": "Q2", "answer": "#### 7"},
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixture = DatasetMixtureConfig(datasets=[{"path": "json", "data_files": str(path), "split": "train"}])
    train = cli.load_datasets(ScriptArguments(), mixture)["train"]
    assert sorted(train.column_names) == ["answer", "prompt"] and train["answer"] == ["1234", "7"]
    assert train[0]["prompt"].startswith("What is 1200+34?")
    assert gsm8k_reward(["... #### 1234", "#### 8"], train["answer"]) == [1.0, 0.0]


def test_check_model_dispatch(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("trl_cb.cli.check_model")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "trl_cb.cli.check_model", fake)
    assert cli.main(["check-model", "some/model", "--dtype", "bfloat16"]) == 3
    assert seen == [["some/model", "--dtype", "bfloat16"]]

    monkeypatch.setitem(sys.modules, "trl_cb.cli.check_model", None)  # as if the module were not installed
    assert cli.main(["check-model", "some/model"]) == 2
    assert "check-model: error: not available" in capsys.readouterr().err


def test_top_level_command(capsys):
    assert cli.main([]) == 0 and "{grpo,rloo,check-model,serve}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["ppo"])
    assert exc.value.code == 2 and "invalid choice: 'ppo'" in capsys.readouterr().err


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["trl-cb"].partition(":")
    assert (module, attr) == ("trl_cb.cli", "main") and cli.MODULE == module


def test_shipped_gsm8k_dataset_name_is_offline_and_chat_formatted():
    """`trl-cb/gsm8k`: the vendored GSM8K split, no hub; train and test are disjoint."""
    script = SimpleNamespace(dataset_name=cli.VENDORED_GSM8K, dataset_config=None, dataset_streaming=False)
    data = cli.load_datasets(script, SimpleNamespace(datasets=[]))
    assert (len(data["train"]), len(data["test"])) == (1191, 128)
    assert data["train"][0]["prompt"][0]["role"] == "user"
    assert not {r["prompt"][0]["content"] for r in data["test"]} & {r["prompt"][0]["content"] for r in data["train"]}


def test_serve_dispatch(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--help"])
    assert info.value.code == 0 and "--api-key" in capsys.readouterr().out


def test_package_and_command_help_import_neither_torch_nor_trainers():
    """`import trl_cb`, its data helpers and `trl-cb --help` start in a fraction of a second: they import none of
    torch, transformers, datasets or TRL's trainers (~10 s on a 2-core VM); a public name imports them when read."""
    probe = """
import sys
import trl_cb, trl_cb.offline.data
from trl_cb.cli import main
try:
    main(["--help"])
except SystemExit as exit_:
    assert exit_.code == 0, exit_.code
heavy = ("torch", "transformers", "datasets", "trl.trainer")
print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)
trainer = trl_cb.GRPOTrainer  # the control: reading a public name imports what it needs
print(sorted(m for m in heavy if m in sys.modules), trainer.__name__, file=sys.stderr)
"""
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = proc.stderr.strip().splitlines()[-2:]
    assert before == "[]" and after == "['datasets', 'torch', 'transformers', 'trl.trainer'] GRPOTrainer", proc.stderr
    assert set(trl_cb.__all__) <= set(dir(trl_cb)) and all(getattr(trl_cb, name) for name in trl_cb.__all__)
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainr'"):
        trl_cb.GRPOTrainr  # noqa: B018
