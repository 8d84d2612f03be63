"""Sampled token ids to text, one token at a time, as the OpenAI-compatible routes return it (`openai_serving.py`).

Why incremental: a streamed answer sends each token's text as it is sampled, a stop string must be found while the
sample is still generating (so that it can end there), and OpenAI's per-token `tokens` / `text_offset` need each
token's share of the text. Decoding a growing prefix at every step costs O(length^2); here each step decodes a
window of a few tokens (the previous token as context, as vLLM does), and a token that ends inside a multi-byte
character yields no text until the character is complete.

Invariant (tested with the offline tokenizer and controls): the pieces concatenate to
`tokenizer.decode(ids, skip_special_tokens=...)` (without the `silent` tokens: the EOS that ends a sample adds no
text, as in vLLM, also where the tokenizer does not mark it special); `TokenText.text` is that concatenation.

Each token's own bytes (OpenAI's chat `logprobs.content[i].bytes`, which exists for tokens that end inside a
character) come from `TokenBytes`: for a byte-level BPE vocabulary they are the token's bytes exactly, so a valid
UTF-8 completion's tokens' bytes concatenate to its UTF-8 bytes, while its pieces (`token`) concatenate to its text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StopMatch", "TokenBytes", "TokenText", "find_stop"]

#: Tokens decoded before the new one, as context (leading-space and merge rules depend on the previous piece).
_CONTEXT_TOKENS = 4
_INCOMPLETE = "\ufffd"
#: SentencePiece's byte-fallback tokens (`<0xE2>`): one raw byte each.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token id's own UTF-8 bytes, from the tokenizer's vocabulary (built once per tokenizer, then a lookup).

    Why not `piece.encode()`: a token that ends inside a multi-byte character has no text of its own (its piece is
    "", the character comes with a later token), yet it carries some of that character's bytes; OpenAI's `bytes`
    field exists to return exactly those. Rules, in order: a token the text leaves out (a silent EOS, a special token
    under `skip_special_tokens`) has no bytes; an added token's bytes are its content's; with a byte-level decoder
    (GPT-2, Llama 3, Qwen: every RL tokenizer we serve) each vocabulary character maps back to one byte
    (`bytes_to_unicode`, inverted); a byte-fallback token `<0xHH>` is byte HH; any other token (SentencePiece
    pieces, which are whole characters) is its piece's UTF-8.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.added: dict[int, tuple[str, bool]] = {
            int(i): (str(token.content), bool(token.special))
            for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        }
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.byte_of: dict[str, int] | None = None
        if _byte_level(tokenizer):
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._cache: dict[int, bytes | None] = {}  # None: the piece's bytes

    def of(self, token_id: int, piece: str, skip_special_tokens: bool, silent: bool = False) -> bytes:
        """The bytes token `token_id` contributes to the text (`piece`: its share of the text, the fallback)."""
        if silent or (skip_special_tokens and token_id in self.special_ids):
            return b""
        if token_id in self.added:
            content, special = self.added[token_id]
            return b"" if special and skip_special_tokens else content.encode("utf-8")
        if token_id not in self._cache:
            self._cache[token_id] = self._vocabulary_bytes(token_id)
        known = self._cache[token_id]
        return piece.encode("utf-8") if known is None else known

    def _vocabulary_bytes(self, token_id: int) -> bytes | None:
        token = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if not isinstance(token, str):
            return None
        if self.byte_of is not None and all(char in self.byte_of for char in token):
            return bytes(self.byte_of[char] for char in token)
        match = _BYTE_TOKEN.fullmatch(token)
        return bytes([int(match.group(1), 16)]) if match else None


def _byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder is byte-level (alone or in a sequence of decoders)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in decoders)


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
