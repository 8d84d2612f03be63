"""Binary answers (`encoding="binary"`): length-prefixed frames of raw little-endian arrays, no base64 and no JSON per
token, read on the trainer's side into tensors without one Python object per token.

One frame (docs/server.md):

    prefix   16 bytes   b"TCB1", u32 header bytes H, u64 array bytes A (little-endian)
    header   H bytes    a `protocol.FrameHeader` as JSON, space-padded so that the arrays start 8-byte aligned
    arrays   A bytes    int32 token_ids[T], fp32 logprobs[T], then fp32 policy_logprobs[T] unless they equal the
                        logprobs (`choices.policy_logprobs_sent`), T = sum(choices.num_tokens); choice after choice

A `/v1/completions` answer is one frame; a `/v1/completions/stream` answer is one frame per finished group, or an
error frame (no arrays) that ends it. Media type `FRAMES_MEDIA_TYPE`. Invariants: a reader never returns a short
frame (a stream that ends inside one raises `FrameError`, as do a wrong magic, array bytes that do not match the
header's token count, and columns that do not fit together); decoded values are the server's bit for bit (fp32
logprobs, int32 ids and versions).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .protocol import FrameHeader, PackedColumns

#: Media type of a binary answer (and of a stream of them).
FRAMES_MEDIA_TYPE = "application/vnd.trl-cb.frames"
_MAGIC = b"TCB1"
_PREFIX = struct.Struct("<4sIQ")  # magic, header bytes, array bytes
#: Largest header a reader accepts (a header holds only per-choice columns: ~100 bytes per choice).
MAX_HEADER_BYTES = 64 * 2**20


class FrameError(ValueError):
    """A binary answer that breaks the frame format (bad magic, truncated, lengths that do not fit)."""


def frame_pieces(header: dict[str, Any], columns: PackedColumns | None = None) -> list[bytes]:
    """One frame (prefix and header, then each choice's packed arrays as separate pieces: nothing joined here) of
    `header` (a `FrameHeader`'s fields other than `choices`) and `columns`' choices."""
    arrays: list[bytes] = []
    if columns is not None:
        sent = columns.policy_sent()
        header = {**header, "choices": {**columns.scalars(), "policy_logprobs_sent": sent}}
        arrays = columns.token_ids + columns.logprobs + (columns.policy_logprobs if sent else [])
    text = FrameHeader(**header).model_dump_json(exclude_none=True).encode()
    text += b" " * (-(_PREFIX.size + len(text)) % 8)  # the arrays start 8-byte aligned
    prefix = _PREFIX.pack(_MAGIC, len(text), sum(len(a) for a in arrays))
    return [prefix + text, *arrays]


def read_frames(pieces: Iterable[bytes]) -> Iterator[bytearray]:
    """Each whole frame of a byte stream as its own buffer, as soon as its last byte arrives (one copy of each byte);
    `FrameError` for a wrong magic, an oversized header, or a stream that ends inside a frame."""
    held: list[bytes] = []  # received, not yet in a yielded frame
    have = 0
    need: int | None = None  # the current frame's size, once its prefix is in
    for piece in pieces:
        if not piece:
            continue
        held.append(piece)
        have += len(piece)
        while True:
            if need is None:
                if have < _PREFIX.size:
                    break
                need = _frame_size(_first_bytes(held, _PREFIX.size))
            if have < need:
                break
            frame = bytearray(need)
            view, filled = memoryview(frame), 0
            while filled < need:
                chunk = held.pop(0)
                take = min(len(chunk), need - filled)
                view[filled : filled + take] = chunk[:take]
                filled += take
                if take < len(chunk):
                    held.insert(0, chunk[take:])
            have -= need
            need = None
            yield frame
    if have:
        expected = f"{need} bytes" if need is not None else f"a {_PREFIX.size}-byte prefix"
        raise FrameError(f"truncated frame: the answer ended after {have} bytes of {expected}")


def _first_bytes(held: list[bytes], count: int) -> bytes:
    first, taken = [], 0
    for chunk in held:
        if taken >= count:
            break
        first.append(chunk)
        taken += len(chunk)
    return b"".join(first)[:count]


def _frame_size(prefix: bytes) -> int:
    magic, header_bytes, array_bytes = _PREFIX.unpack(prefix)
    if magic != _MAGIC:
        raise FrameError(f"not a trl_cb frame (starts with {prefix[:8]!r})")
    if header_bytes > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {header_bytes} bytes (at most {MAX_HEADER_BYTES})")
    return _PREFIX.size + header_bytes + array_bytes


@dataclass
class ArrayChoice:
    """One decoded choice: `protocol.Choice`'s fields, the per-token ones as 1-D tensors viewing the frame's buffer
    (int32 `token_ids` and `token_weight_versions`, fp32 logprobs). `policy_logprobs` is the `logprobs` tensor itself
    when the server sent them once (equal values): treat both as read-only."""

    index: int
    prompt_index: int
    weight_version: int
    finish_reason: str | None
    token_ids: torch.Tensor  # (T_c,) int32
    logprobs: torch.Tensor  # (T_c,) fp32
    policy_logprobs: torch.Tensor  # (T_c,) fp32
    token_weight_versions: torch.Tensor  # (T_c,) int32


def decode_frame(frame: bytearray) -> tuple[FrameHeader, list[ArrayChoice]]:
    """A frame from `read_frames`: its header and its choices (none for an error frame); `FrameError` naming the
    field when the columns or the array bytes do not fit together."""
    _, header_bytes, array_bytes = _PREFIX.unpack_from(frame)
    start = _PREFIX.size + header_bytes
    try:
        header = FrameHeader.model_validate_json(frame[_PREFIX.size : start])
    except ValueError as exc:  # pydantic's ValidationError
        raise FrameError(f"frame header: {str(exc)[:300]}") from None
    columns = header.choices
    if columns is None:
        if array_bytes:
            raise FrameError(f"a frame without choices carries {array_bytes} array bytes")
        return header, []
    try:
        total = columns.checked_total()
        arrays = 3 if columns.policy_logprobs_sent else 2
        if array_bytes != 4 * arrays * total:
            raise FrameError(f"frame arrays hold {array_bytes} bytes, {total} tokens need {4 * arrays * total}")
        columns.check_runs()
    except FrameError:
        raise
    except ValueError as exc:
        raise FrameError(str(exc)) from None
    # (T,) each, viewing `frame`: no copy, no per-token object
    token_ids = _array(frame, "<i4", total, start)
    logprobs = _array(frame, "<f4", total, start + 4 * total)
    policy = _array(frame, "<f4", total, start + 8 * total) if columns.policy_logprobs_sent else logprobs
    runs = np.array(columns.version_values, dtype=np.int32)
    versions = torch.from_numpy(np.repeat(runs, columns.version_lengths))  # numpy's: ~50x torch's on 2M tokens
    sizes = columns.num_tokens
    if not sizes:
        return header, []
    split = [torch.split(t, sizes) for t in (token_ids, logprobs, policy, versions)]
    choices = [
        ArrayChoice(
            index=columns.index[c],
            prompt_index=columns.prompt_index[c],
            weight_version=columns.weight_version[c],
            finish_reason=columns.finish_reason[c],
            token_ids=split[0][c],
            logprobs=split[1][c],
            policy_logprobs=split[2][c],
            token_weight_versions=split[3][c],
        )
        for c in range(len(sizes))
    ]
    return header, choices


def _array(frame: bytearray, dtype: str, count: int, offset: int) -> torch.Tensor:
    values = np.frombuffer(frame, dtype=dtype, count=count, offset=offset)
    if sys.byteorder == "big":
        values = values.astype(values.dtype.newbyteorder("="))  # a native copy
    return torch.from_numpy(values)
