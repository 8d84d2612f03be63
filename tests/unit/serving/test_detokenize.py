"""Incremental detokenization (`serving/detokenize.py`): the pieces of a sampled sequence, one token at a time,
concatenate to the tokenizer's decode of the whole sequence, also for ids that split multi-byte characters (random
ids of a byte-level BPE: most sequences hold such splits); a stop string is found where it completes. Control: the
naive per-token decode (each id alone) does not concatenate to the whole decode on the same sequences."""

from __future__ import annotations

import random

from trl_cb.serving.detokenize import TokenText, find_stop


def test_pieces_concatenate_to_the_whole_decode(tokenizer):
    rng = random.Random(0)
    naive_differs = 0
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 48))]
        for skip in (True, False):
            text = TokenText(tokenizer, skip)
            for token in ids:
                text.add(token)
            text.finish()
            assert text.text == "".join(text.pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
            assert text.offsets == [sum(map(len, text.pieces[:i])) for i in range(len(ids))]
        naive = "".join(tokenizer.decode([t], skip_special_tokens=True) for t in ids)
        naive_differs += naive != tokenizer.decode(ids, skip_special_tokens=True)
    assert naive_differs > 20  # the check above would catch a decoder that went token by token


def test_a_silent_eos_adds_no_text_and_stops_are_found_where_they_complete(tokenizer):
    ids = tokenizer.encode("Natalia sold 48 clips in April")
    text = TokenText(tokenizer, skip_special_tokens=False)
    for token in ids:
        text.add(token)
    text.add(tokenizer.eos_token_id, silent=True)
    assert text.text == "Natalia sold 48 clips in April" and text.pieces[-1] == ""
    match = find_stop(text.text, ["48", "April", "zz"])
    assert (match.stop, match.start, match.end) == ("48", 13, 15)
    assert find_stop(text.text, ["48"], searched=len(text.text)) is None  # already looked at: not found again
