"""Coalesced weight transfer (`trl_cb/serving/weight_buckets.py`): the bucket plan both sides derive, and a pack /
receive round trip without a network. The server round trip, with a non-finite tensor inside a bucket, is in
test_hardening.py."""

from __future__ import annotations

import pytest
import torch

from trl_cb.serving.weight_buckets import BucketPacker, plan_buckets, receive_buckets

F32, BF16 = torch.float32, torch.bfloat16
#: bytes: 24, 16, 16 (bf16), 400, 4, 8
LAYOUT = [(F32, [2, 3]), (F32, [4]), (BF16, [8]), (F32, [100]), (F32, []), (F32, [2])]


def test_plan_by_hand():
    # 24 + 16 fit in 40; a dtype change ends a bucket; 400 B > 40 travels alone; a scalar (4 B) joins the next.
    assert plan_buckets(LAYOUT, 40) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert plan_buckets(LAYOUT, 39) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert plan_buckets(LAYOUT, 0) == [range(i, i + 1) for i in range(len(LAYOUT))]  # one broadcast per tensor
    assert plan_buckets(LAYOUT, 1 << 20) == [range(0, 2), range(2, 3), range(3, 6)]
    assert plan_buckets([], 40) == []
    with pytest.raises(ValueError, match=">= 0"):
        plan_buckets(LAYOUT, -1)


@pytest.mark.parametrize("bucket_bytes", [0, 40, 1 << 20])
def test_round_trip_sends_one_buffer_per_bucket_and_copies_at_add(bucket_bytes):
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator).to(dtype) for dtype, shape in LAYOUT]
    expected = [t.clone() for t in tensors]
    packer, wire = BucketPacker(LAYOUT, bucket_bytes), []
    for tensor in tensors:
        flat = packer.add(tensor)
        if flat is not None:
            wire.append(flat.clone())  # what a broadcast sends: the buffer as it is now (a bucket of one: the tensor)
        tensor.fill_(float("nan"))  # the caller frees or overwrites it (a gathered ZeRO-3 parameter) right after:
        # a packer that kept references instead of copying would send NaN for every bucket of several
    assert len(wire) == len(plan_buckets(LAYOUT, bucket_bytes))

    def receive(flat: torch.Tensor) -> None:
        sent = wire.pop(0)
        assert sent.dtype == flat.dtype and sent.numel() == flat.numel()
        flat.copy_(sent.reshape(-1))

    received = receive_buckets(LAYOUT, bucket_bytes, receive)
    assert not wire
    for got, want, (dtype, shape) in zip(received, expected, LAYOUT, strict=True):
        assert got.dtype == dtype and list(got.shape) == shape
        assert torch.equal(got, want)


def test_packer_refuses_what_was_not_announced():
    packer = BucketPacker(LAYOUT[:2], 1 << 20)
    with pytest.raises(ValueError, match="announced"):
        packer.add(torch.zeros(3, 2))
    packer = BucketPacker(LAYOUT[:1], 1 << 20)
    packer.add(torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="more tensors"):
        packer.add(torch.zeros(4))
