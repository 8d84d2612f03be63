"""GSM8K prompts and rewards, with no download.

Why: benchmarks and examples must run offline on real prompt lengths. The GSM8K *test* split (MIT, OpenAI) ships
with the package (`trl_cb/resources/gsm8k/`, its licence next to it) and is the default prompt source
(`gsm8k_test`); a user's JSONL file or the hub dataset replace it on request. Tests that only need prompt-shaped text
use `synthetic_gsm8k`, which generates GSM8K-style problems deterministically from a seed. Rewards: `gsm8k_reward`
(accuracy, for real models) and `char_share_reward` (a task a random tiny model learns offline, so that an offline
run shows learning).

Every path returns the same record shape: `{"prompt": str | list[message], "answer": str}`, where `answer` is the
final number as a string, and `prompt` is either plain text or, chat-formatted (`conversational=True`), one user
message `[{"role": "user", "content": text}]`, which TRL renders with the tokenizer's chat template.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .names import TINY_MODEL

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


def gsm8k_record(question: str, answer: str, conversational: bool = False) -> dict[str, Any]:
    """One GSM8K row (`question`, worked `answer` ending in `#### N`) as a `prompt`/`answer` record (`answer` = N);
    the prompt is one user message when `conversational`, else plain text."""
    text = question + _PROMPT_SUFFIX
    final = answer.split("####")[-1].strip().replace(",", "")
    return {"prompt": [{"role": "user", "content": text}] if conversational else text, "answer": final}


def _read_gsm8k_lines(lines: Any, source: str, limit: int | None, conversational: bool) -> list[dict[str, Any]]:
    records = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{source}:{line_no}: expected keys 'question' and 'answer', got {sorted(row)}")
        records.append(gsm8k_record(row["question"], row["answer"], conversational))
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise ValueError(f"{source} holds no records.")
    return records


def load_gsm8k_jsonl(path: str | Path, limit: int | None = None, conversational: bool = False) -> list[dict[str, Any]]:
    """Read GSM8K JSONL (`question`, `answer` with the final number after `####`) into `prompt`/`answer` records."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K data file not found: {path}")
    with path.open() as f:
        return _read_gsm8k_lines(f, str(path), limit, conversational)


GSM8K_TEST_SIZE = 1319  # problems in the vendored test split


def gsm8k_test(
    num_examples: int | None = None, seed: int | None = None, conversational: bool = True
) -> list[dict[str, Any]]:
    """Problems from the GSM8K test split shipped with trl_cb (package data; MIT licence, see its LICENSE).

    `seed=None` keeps the file's order (the first `num_examples` problems); an integer draws a seeded random
    subset in random order, the same on every machine. Chat-formatted (one user message) unless
    `conversational=False`.
    """
    if num_examples is not None and not 0 < num_examples <= GSM8K_TEST_SIZE:
        raise ValueError(f"num_examples must be in [1, {GSM8K_TEST_SIZE}] (the split's size), got {num_examples}.")
    source = resources.files("trl_cb.offline") / "resources" / "gsm8k" / "test.jsonl"
    with source.open("r", encoding="utf-8") as f:
        records = _read_gsm8k_lines(f, "trl_cb/offline/resources/gsm8k/test.jsonl", None, conversational)
    if seed is not None:
        random.Random(seed).shuffle(records)
    return records[:num_examples] if num_examples is not None else records


def tokenize_prompt(tokenizer: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of one record's prompt as TRL builds them: chat template with the generation prompt for messages,
    plain tokenization for text."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


_NUMBER_AFTER_MARK = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def gsm8k_reward(completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """TRL reward function: 1.0 when the number after `####` equals the reference answer, else 0.0.

    Completions may be plain strings or chat messages (the last message's content is scored).
    """
    rewards = []
    for completion, ref in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        match = _NUMBER_AFTER_MARK.search(text)
        rewards.append(1.0 if match and match.group(1).replace(",", "") == ref else 0.0)
    return rewards


def char_share_reward(char: str = "a", min_chars: int = 20) -> Callable[..., list[float]]:
    """A TRL reward function a random tiny model can learn offline: the share of `char` among a completion's
    characters, dividing by at least `min_chars`.

    Why: a random model earns no GSM8K reward, so a GSM8K run on it shows reward 0 and loss 0 and proves nothing. The
    share of one character starts low (about 0.04 for the tiny model and "a") and rises within tens of steps, through
    everything RL correctness depends on (sampling, logprobs, IS correction). Why the floor: with a
    plain share, a very short completion is a lottery ticket ("a" scores 1.0, "" scores 0), so one large update can
    teach the policy to stop at once; an all-empty group has zero reward variance, hence no gradient, and the run
    never recovers. Dividing by at least `min_chars` makes stopping early never pay.

    The task of `benchmarks/learning.py` and of the offline recipes (`--reward_funcs char_share_reward` is this
    function with the defaults). Completions may be plain strings or chat messages (the last message is scored).
    """

    def reward(completions: list[Any], **kwargs: object) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [t.count(char) / max(len(t), min_chars) for t in texts]

    reward.__name__ = f"share_of_{char!r}"
    return reward


def corpus_for_tokenizer(num_examples: int = 400, seed: int = 1234) -> list[str]:
    """Text to train the local tokenizer on: synthetic problems and answers plus the digits and answer marker."""
    texts = [r["prompt"] + f" #### {r['answer']}" for r in synthetic_gsm8k(num_examples, seed)]
    return texts + ["0 1 2 3 4 5 6 7 8 9 #### . , ? !"]


@dataclass
class GSM8KScriptArguments:
    """Data and model flags shared by the example scripts (parsed by `TrlParser` next to the trainer config).

    Defaults are offline: the tiny random model and the GSM8K test split shipped with trl_cb, chat-formatted.
    `--model_name_or_path`, `--data_file` and `--dataset_name` opt into real models and other data.
    """

    model_name_or_path: str = field(
        default=TINY_MODEL,
        metadata={"help": f"Hub id or local path of the policy; {TINY_MODEL!r} builds a random tiny Qwen2 offline."},
    )
    data_file: str | None = field(
        default=None,
        metadata={"help": "GSM8K JSONL file (question/answer); default: the GSM8K test split shipped with trl_cb."},
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset, e.g. 'openai/gsm8k' (needs network); overrides --data_file."}
    )
    num_examples: int = field(default=64, metadata={"help": "Training problems to use."})
    conversational: bool = field(
        default=True,
        metadata={"help": "Chat-format prompts (one user message); False: plain text, for models without a template."},
    )


def load_prompts(args: GSM8KScriptArguments, seed: int = 0) -> list[dict[str, Any]]:
    """`prompt`/`answer` records from the hub dataset, the JSONL file, or the vendored test split (in that order).

    The vendored split gives a seeded random subset of `num_examples` problems (see `gsm8k_test`).
    """
    if args.num_examples <= 0:
        raise ValueError(f"--num_examples must be > 0, got {args.num_examples}.")
    if args.dataset_name:
        from datasets import load_dataset

        rows = load_dataset(args.dataset_name, "main", split="train").select(range(args.num_examples))
        return [gsm8k_record(r["question"], r["answer"], args.conversational) for r in rows]
    if args.data_file:
        return load_gsm8k_jsonl(args.data_file, limit=args.num_examples, conversational=args.conversational)
    return gsm8k_test(min(args.num_examples, GSM8K_TEST_SIZE), seed=seed, conversational=args.conversational)
