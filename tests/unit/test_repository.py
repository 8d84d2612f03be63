"""The newcomer path: README's test commands are CI's, the test extra skips nothing, the tree holds no build output."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_test_commands() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Run the tests", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md: no bash block under '## Run the tests'"
    return [line for line in block.group(1).splitlines() if line.strip()]


def ci_test_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('# --- README.md "Run the tests"'))
    end = next(i for i, line in enumerate(lines) if line.startswith("# --- end of README commands"))
    return [line for line in lines[start + 1 : end] if line.strip() and not line.startswith("#")]


def test_readme_test_commands_are_what_ci_runs():
    assert readme_test_commands() == ci_test_commands()
    assert readme_test_commands()[0] == 'python -m pip install -e ".[test]"'


def test_test_extra_installs_what_the_suite_imports():
    """`pip install -e ".[test]"` must bring DeepSpeed and PEFT: without them the ZeRO-3 / LoRA tests skip."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    test = extras["test"]
    self_ref = next(r for r in test if r.startswith(f"{project['name']}["))
    included = set(self_ref[self_ref.index("[") + 1 : self_ref.index("]")].split(","))
    assert {"deepspeed", "peft"} <= included and {"deepspeed", "peft"} <= set(extras)
    assert any(r.startswith("pytest") for r in test) and any(r.startswith("ruff") for r in test)


@pytest.mark.skipif(not (ROOT / ".git").exists() or not shutil.which("git"), reason="not a git checkout")
def test_no_build_output_is_tracked_and_all_is_ignored():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in tracked if re.search(r"(\.egg-info/|^build/|^dist/|__pycache__/|\.pyc$)", f)]
    probes = ["trl_cb.egg-info/PKG-INFO", "build/lib/x.py", "dist/x.whl", "trl_cb/__pycache__/x.pyc", "runs/a/b"]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *probes], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert ignored == probes
