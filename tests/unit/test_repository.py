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


def test_every_ci_command_fails_the_run_on_its_own():
    """`.ci/run` is `set -e`, which ignores a failure anywhere in an `a && b` or `a || b` list but its last command:
    `ruff check ... && ruff format --check ...` let lint errors through a green run. One command a line."""
    assert not [c for c in ci_test_commands() if "&&" in c or "||" in c or c.rstrip().endswith("\\")]
    script = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script


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


def result_files() -> set[str]:
    """Names of the result files in `benchmarks/results/`: the tracked ones in a git checkout (a user's untracked
    output is no part of the repository), else (an export) whatever the directory holds."""
    results = ROOT / "benchmarks" / "results"
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split("\0")
        paths = [ROOT / name for name in listed if name]
    else:
        paths = list(results.iterdir())
    return {p.name for p in paths if p.parent == results and p.suffix in (".json", ".png")}


def test_result_files_the_docs_cite_exist():
    """Every `benchmarks/results/...` file README.md and docs/ cite is tracked and on disk (`name.{json,png}`
    expanded), and no tracked result file is uncited: figures in the docs must point at the run that produced them."""
    cited: set[str] = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for stem, exts in re.findall(r"benchmarks/results/([\w.-]+?)(?:\.\{([\w,]+)\}|(?=[`)\s,;]))", doc.read_text()):
            names = [f"{stem}.{ext}" for ext in exts.split(",")] if exts else [stem]
            cited.update(names)
    # a bare `learning-...json` (no directory) next to a cited directory also counts as cited
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        cited.update(re.findall(r"`((?:gsm8k|grpo_step|learning)-\d{8}-\d{6}\.(?:json|png))`", doc.read_text()))
    present = result_files()
    assert cited, "the docs cite no benchmark result"
    assert cited <= present, f"cited but not tracked: {sorted(cited - present)}"
    assert not [n for n in cited if not (ROOT / "benchmarks" / "results" / n).is_file()], "cited files missing on disk"
    assert present <= cited, f"result files no doc cites: {sorted(present - cited)}"


#: A tracker issue number ("issue 27", "issues 31 and 26"): the repository's readers cannot open this project's
#: tracker; upstream issues are links. A machine path: a reader's machine has no /work or /tmp of ours.
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?\d+")
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/tmp/|/root/|/home/|<worktree>)")


def test_docs_name_no_issue_numbers_or_machine_paths():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [
        f"{doc.name}:{n}: {line.strip()[:100]}"
        for doc in docs
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if ISSUE_NUMBER.search(line) or MACHINE_PATH.search(line)
    ]
    assert not found, "\n".join(found)
    assert ISSUE_NUMBER.search("as issue 27 found") and MACHINE_PATH.search("PYTHONPATH=/work/main python")  # control
    assert not ISSUE_NUMBER.search("transformers issues [#48296](https://github.com/...)")


def test_readme_figures_are_those_of_docs_benchmarks():
    """README repeats no speed figure that docs/benchmarks.md does not state: every ratio in README (`1.45×`) is there.
    Control: a figure that is not there would be caught."""
    ratio = re.compile(r"\d+(?:\.\d+)?×")
    readme, benchmarks = (ROOT / "README.md").read_text(), (ROOT / "docs" / "benchmarks.md").read_text()
    stated = set(ratio.findall(benchmarks))

    def unstated(text: str) -> set[str]:
        return set(ratio.findall(text)) - stated

    assert not unstated(readme), f"README figures not in docs/benchmarks.md: {unstated(readme)}"
    assert unstated(readme + " reaches 123.45× generate()") == {"123.45×"}  # control
