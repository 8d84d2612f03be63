"""Sampled token ids to text, one token at a time, as the OpenAI-compatible routes return it (`openai_serving.py`).

Why incremental: a streamed answer sends each token's text as it is sampled, a stop string must be found while the
sample is still generating (so that it can end there), and OpenAI's per-token `tokens` / `text_offset` need each
token's share of the text. Decoding a growing prefix at every step costs O(length^2); here each step decodes a
window of a few tokens (the previous token as context, as vLLM does), and a token that ends inside a multi-byte
character yields no text until the character is complete.

Invariant (tested with the offline tokenizer and controls): the pieces concatenate to
`tokenizer.decode(ids, skip_special_tokens=...)` (without the `silent` tokens: the EOS that ends a sample adds no
text, as in vLLM, also where the tokenizer does not mark it special); `TokenText.text` is that concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StopMatch", "TokenText", "find_stop"]

#: Tokens decoded before the new one, as context (leading-space and merge rules depend on the previous piece).
_CONTEXT_TOKENS = 4
_INCOMPLETE = "\ufffd"


@dataclass
class TokenText:
    """The text of a growing sequence of sampled token ids (`add` one at a time; see the module docstring)."""

    tokenizer: Any
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    #: Per token: its share of the text ("" for a token that ends inside a character, whose text comes with a later
    #: token), and where that share starts in `text`.
    pieces: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    text: str = ""
    _read: int = 0  # ids[:_read] are in `text`

    def add(self, token_id: int, silent: bool = False) -> str:
        """Append one sampled token; return the text it completes (maybe ""). A `silent` token (the EOS that ended
        the sample) adds no text."""
        if silent:
            self.finish()
            self.ids.append(int(token_id))
            self._read = len(self.ids)
            self._record("")
            return ""
        self.ids.append(int(token_id))
        start = max(0, self._read - _CONTEXT_TOKENS)
        before = self._decode(self.ids[start : self._read])
        after = self._decode(self.ids[start:])
        if after.endswith(_INCOMPLETE) or not after.startswith(before):
            piece = ""  # the character is not complete yet (or the window shifts the text): wait for more tokens
        else:
            piece, self._read = after[len(before) :], len(self.ids)
        self._record(piece)
        return piece

    def extend(self, token_ids: list[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def finish(self) -> str:
        """The text still held back at the end of the sequence (an incomplete character decodes as U+FFFD), added to
        the last token's share."""
        if self._read == len(self.ids):
            return ""
        full = self._decode(self.ids)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self._read = len(self.ids)
        if rest and self.pieces:
            self.pieces[-1] += rest
            self.text += rest
        return rest

    def token_end(self, char: int) -> int:
        """How many tokens it takes for the text to reach `char` characters (the token whose share covers position
        `char - 1`, plus everything before it)."""
        for i, (offset, piece) in enumerate(zip(self.offsets, self.pieces)):
            if offset + len(piece) >= char and piece:
                return i + 1
        return len(self.ids)

    def _record(self, piece: str) -> None:
        self.offsets.append(len(self.text))
        self.pieces.append(piece)
        self.text += piece

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


@dataclass(frozen=True)
class StopMatch:
    stop: str
    start: int  # where the stop string starts in the text
    end: int  # where it ends


def find_stop(text: str, stops: list[str], searched: int = 0) -> StopMatch | None:
    """The earliest of `stops` in `text` (OpenAI: generation ends at the first stop string), looking only at
    positions a stop could newly end at since `searched` characters were last looked at; None if none."""
    best: StopMatch | None = None
    for stop in stops:
        at = text.find(stop, max(0, searched - len(stop) + 1))
        if at >= 0 and (best is None or at < best.start):
            best = StopMatch(stop, at, at + len(stop))
    return best
