"""GSM8K-shaped prompts and a reward, with no download.

Why: tests, examples and the default benchmark must run offline. This module generates GSM8K-style word problems
deterministically from a seed (same seed, same problems, on every machine) and reads the real GSM8K JSONL format
(`{"question": ..., "answer": "... #### 42"}`) when the user has a file. Both paths return the same record shape:
`{"prompt": str, "answer": str}`, where `answer` is the final number as a string.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

_NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena")
_ITEMS = ("apples", "marbles", "books", "pencils", "stickers", "cookies", "coins", "shells", "cards", "eggs")
_PROMPT_SUFFIX = "\nAnswer with the final number after '####'."


def _problem(rng: random.Random) -> dict[str, str]:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(4)
    if kind == 0:
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"
        ans = a + b
    elif kind == 1:
        a = max(a, b + 1)
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?"
        ans = a - b
    elif kind == 2:
        q = f"{name} buys {c} boxes of {item} with {b} {item} in each box. How many {item} does {name} buy in total?"
        ans = b * c
    else:
        q = (
            f"{name} has {a} {item}. {other} has {c} times as many {item} as {name}, then loses {b} of them. "
            f"How many {item} does {other} have?"
        )
        ans = a * c - b
    return {"prompt": q + _PROMPT_SUFFIX, "answer": str(ans)}


def synthetic_gsm8k(num_examples: int, seed: int = 0) -> list[dict[str, str]]:
    """`num_examples` deterministic GSM8K-style problems (`prompt`, `answer`)."""
    if num_examples <= 0:
        raise ValueError(f"num_examples must be > 0, got {num_examples}.")
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(num_examples)]


def gsm8k_record(question: str, answer: str) -> dict[str, str]:
    """One GSM8K row (`question`, worked `answer` ending in `#### N`) as a `prompt`/`answer` record (`answer` = N)."""
    return {"prompt": question + _PROMPT_SUFFIX, "answer": answer.split("####")[-1].strip().replace(",", "")}


def load_gsm8k_jsonl(path: str | Path, limit: int | None = None) -> list[dict[str, str]]:
    """Read GSM8K JSONL (`question`, `answer` with the final number after `####`) into `prompt`/`answer` records."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K data file not found: {path}")
    records = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{line_no}: expected keys 'question' and 'answer', got {sorted(row)}")
            records.append(gsm8k_record(row["question"], row["answer"]))
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"{path} holds no records.")
    return records


_NUMBER_AFTER_MARK = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def gsm8k_reward(completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """TRL reward function: 1.0 when the number after `####` equals the reference answer, else 0.0."""
    rewards = []
    for completion, ref in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        match = _NUMBER_AFTER_MARK.search(text)
        rewards.append(1.0 if match and match.group(1).replace(",", "") == ref else 0.0)
    return rewards


def corpus_for_tokenizer(num_examples: int = 400, seed: int = 1234) -> list[str]:
    """Text to train the local tokenizer on: synthetic problems and answers plus the digits and answer marker."""
    texts = [r["prompt"] + f" #### {r['answer']}" for r in synthetic_gsm8k(num_examples, seed)]
    return texts + ["0 1 2 3 4 5 6 7 8 9 #### . , ? !"]


@dataclass
class GSM8KScriptArguments:
    """Data and model flags shared by the example scripts (parsed by `TrlParser` next to the trainer config).

    Defaults are offline: the tiny random model and generated problems. `--model_name_or_path`,
    `--data_file` and `--dataset_name` opt into real models and data.
    """

    model_name_or_path: str = field(
        default="tiny",
        metadata={"help": "Hub id or local path of the policy; 'tiny' builds a random tiny Qwen2 offline."},
    )
    data_file: str | None = field(
        default=None, metadata={"help": "GSM8K JSONL file (question/answer); default: generated problems."}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset, e.g. 'openai/gsm8k' (needs network); overrides --data_file."}
    )
    num_examples: int = field(default=64, metadata={"help": "Training problems to use."})


def load_prompts(args: GSM8KScriptArguments, seed: int = 0) -> list[dict[str, str]]:
    """`prompt`/`answer` records from the hub dataset, the JSONL file, or the generator (in that order)."""
    if args.num_examples <= 0:
        raise ValueError(f"--num_examples must be > 0, got {args.num_examples}.")
    if args.dataset_name:
        from datasets import load_dataset

        rows = load_dataset(args.dataset_name, "main", split="train").select(range(args.num_examples))
        return [gsm8k_record(r["question"], r["answer"]) for r in rows]
    if args.data_file:
        return load_gsm8k_jsonl(args.data_file, limit=args.num_examples)
    return synthetic_gsm8k(args.num_examples, seed=seed)
