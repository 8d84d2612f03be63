"""The docs name only scripts that exist: every `benchmarks/...` and `examples/...` file README.md and docs/*.md cite
is in the tree.

Why: a reader copies the command from the docs; a script that was renamed or folded into another (as
`benchmarks/agent_turns.py` was into `benchmarks/learning.py --task agent`) fails at once and reads as a broken
project. Result files (`benchmarks/results/...`) have their own check (`test_repository.py`).

One exception, stated where it applies: docs/benchmark-log.md is the dated measurement history and keeps its commands
as they were run; a script it names that has left the tree must be accounted for in the log's opening paragraph (what
it became, or that it was removed), so the reader is told before meeting the command.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = "benchmark-log.md"
#: A repository path under benchmarks/ or examples/ with a file extension, not preceded by a path or word character
#: (so `trl_cb/benchmarks/x.py` or a URL's tail is not taken for one). Results are checked elsewhere.
CITED_PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|examples)/[\w./-]*\w\.(?:py|sh|ya?ml|json|md|toml))")


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) for each `benchmarks/...` or `examples/...` file `text` names, results excluded."""
    return [
        (number, path)
        for number, line in enumerate(text.splitlines(), 1)
        for path in CITED_PATH.findall(line)
        if not path.startswith("benchmarks/results/")
    ]


def missing_paths(doc_name: str, text: str, root: Path = ROOT) -> list[str]:
    """`doc:line: path` for each cited path not in the tree under `root`; in the history log, only those its opening
    paragraph (the text before the first heading after the title) does not account for."""
    missing = [(n, p) for n, p in cited_paths(text) if not (root / p).is_file()]
    if doc_name == HISTORY:
        opening = re.split(r"\n#+ ", text.split("\n", 1)[-1], maxsplit=1)[0]
        named = re.findall(r"`([\w*.-]+\.py)`", opening)  # e.g. `payload.py`, `plot*.py`
        missing = [(n, p) for n, p in missing if not any(fnmatch.fnmatch(Path(p).name, name) for name in named)]
    return [f"{doc_name}:{n}: {p}" for n, p in missing]


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_script_the_docs_cite_exists():
    found = [line for doc in docs() for line in missing_paths(doc.name, doc.read_text())]
    assert not found, "the docs cite files that are not in the tree:\n" + "\n".join(found)
    cited = {p for doc in docs() for _, p in cited_paths(doc.read_text())}
    # the check reads what it should: the examples and the benchmark entry points are cited
    assert {"examples/agent_gsm8k.py", "examples/agent_openai_client.py", "benchmarks/learning.py"} <= cited


def test_a_made_up_path_is_reported():
    """Control: a path that is not in the tree is reported, in any doc; in the history log, only when its opening
    paragraph does not account for it; paths inside other directories and result files are not taken."""
    text = (
        "Run `python benchmarks/no_such_bench.py --quick` or examples/ghost_example.py, then `examples/grpo_gsm8k.py`."
    )
    assert missing_paths("async.md", text) == [
        "async.md:1: benchmarks/no_such_bench.py",
        "async.md:1: examples/ghost_example.py",
    ]
    log = "# Benchmark log\n\nScripts merged since: `old_bench.py` is `server.py`.\n\n## A run\n" + (
        "`python benchmarks/old_bench.py` and `python benchmarks/other_gone.py`\n"
    )
    assert missing_paths(HISTORY, log) == [f"{HISTORY}:6: benchmarks/other_gone.py"]
    assert missing_paths("async.md", log) == [
        "async.md:6: benchmarks/old_bench.py",
        "async.md:6: benchmarks/other_gone.py",
    ]
    assert cited_paths("trl_cb/benchmarks/x.py https://h/examples/y.py benchmarks/results/r.json") == []
