"""Coalesced weight transfer: the announced tensors travel in a few flat buffers instead of one broadcast each.

Why: a weight push is latency-bound on small tensors. Each gloo broadcast is a round trip (~0.2 ms on a quiet
loopback, ~1 ms on a busy machine), and a model has many small tensors (norms, biases): the tiny benchmark model's 27
tensors (0.56 MB) took 0.006 s to send one by one and 0.0007 s in one bucket (0.024-0.027 s against 0.0008 s beside
two busy processes); a training step's push, during which the trainer is blocked, went from 0.016-0.028 s to
0.008-0.010 s (docs/benchmark-log.md, "Weight push in buckets").

Invariant: the trainer and the server derive the same buckets from the same announcement (`plan_buckets`: the
announced order, dtypes and shapes, and the `bucket_bytes` the trainer announces with them), so the flat buffers need
no header. A bucket holds consecutive tensors of one dtype whose bytes add up to at most `bucket_bytes`; a tensor
larger than that travels alone, and `bucket_bytes == 0` sends every tensor alone (the protocol before buckets). The
sender copies each tensor into its bucket as it arrives, so it never keeps a reference to a tensor the caller may
free or overwrite (a gathered ZeRO-3 parameter) and holds at most one bucket.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "BucketPacker", "plan_buckets", "receive_buckets"]

#: Bucket size the trainer announces by default: large enough that small tensors cost one round trip together, small
#: enough that the extra copy held on the trainer is negligible next to the model.
DEFAULT_BUCKET_BYTES = 32 << 20


def plan_buckets(tensors: Sequence[tuple[torch.dtype, Sequence[int]]], bucket_bytes: int) -> list[range]:
    """The buckets of `tensors` (dtype, shape), in order, as ranges of their indices (see the module's invariant)."""
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    buckets: list[range] = []
    start, size, dtype = 0, 0, None
    for index, (tensor_dtype, shape) in enumerate(tensors):
        nbytes = math.prod(shape) * tensor_dtype.itemsize
        if index > start and (tensor_dtype != dtype or size + nbytes > bucket_bytes):
            buckets.append(range(start, index))
            start, size = index, 0
        dtype, size = tensor_dtype, size + nbytes
    if start < len(tensors):
        buckets.append(range(start, len(tensors)))
    return buckets


class BucketPacker:
    """The sender's side: `add` each announced tensor in order; it returns the buffer to broadcast once a bucket is
    complete (the tensor itself for a bucket of one, which is not copied), else None."""

    def __init__(self, tensors: Sequence[tuple[torch.dtype, Sequence[int]]], bucket_bytes: int) -> None:
        self._tensors = list(tensors)
        self._bucket_of = {i: bucket for bucket in plan_buckets(self._tensors, bucket_bytes) for i in bucket}
        self._index = 0
        self._buffer = torch.empty(0)
        self._offset = 0

    def add(self, tensor: torch.Tensor) -> torch.Tensor | None:
        index = self._index
        if index >= len(self._tensors):
            raise RuntimeError(f"more tensors sent than the {len(self._tensors)} announced")
        dtype, shape = self._tensors[index]
        if tensor.dtype != dtype or list(tensor.shape) != list(shape):
            raise ValueError(f"tensor {index} is {tensor.dtype} {list(tensor.shape)}, announced {dtype} {list(shape)}")
        self._index += 1
        bucket = self._bucket_of[index]
        if len(bucket) == 1:
            return tensor
        if index == bucket[0]:
            total = sum(math.prod(self._tensors[i][1]) for i in bucket)
            self._buffer, self._offset = torch.empty(total, dtype=dtype), 0
        numel = tensor.numel()
        self._buffer[self._offset : self._offset + numel].copy_(tensor.reshape(-1))
        self._offset += numel
        return self._buffer if index == bucket[-1] else None


def receive_buckets(
    tensors: Sequence[tuple[torch.dtype, Sequence[int]]],
    bucket_bytes: int,
    receive: Callable[[torch.Tensor], None],
) -> list[torch.Tensor]:
    """The receiver's side: fill one flat buffer per bucket with `receive` (a broadcast from the sender) and return
    every announced tensor, in order, as a view of its bucket."""
    received: list[torch.Tensor] = []
    for bucket in plan_buckets(tensors, bucket_bytes):
        shapes = [list(tensors[i][1]) for i in bucket]
        sizes = [math.prod(shape) for shape in shapes]
        flat = torch.empty(sum(sizes), dtype=tensors[bucket[0]][0])
        receive(flat)
        received += [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]
    return received
