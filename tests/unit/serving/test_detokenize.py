"""Incremental detokenization (`serving/detokenize.py`): the pieces of a sampled sequence, one token at a time,
concatenate to the tokenizer's decode of the whole sequence, also for ids that split multi-byte characters (random
ids of a byte-level BPE: most sequences hold such splits); a stop string is found where it completes. Control: the
naive per-token decode (each id alone) does not concatenate to the whole decode on the same sequences."""

from __future__ import annotations

import random

from trl_cb.serving.detokenize import TokenBytes, TokenText, find_stop


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


#: Characters of 2, 3 and 4 UTF-8 bytes: the tiny byte-level BPE (trained on ASCII text) splits each into byte tokens.
MULTILINGUAL = "Café €5, naïve 日本語 😀 ok"


def test_token_bytes_are_each_tokens_own_and_concatenate_to_the_text(tokenizer):
    """Each token's bytes are its own from the byte-level vocabulary: they concatenate to the text's UTF-8 even where
    a token ends inside a character (its piece is ""). Control: the pieces' UTF-8, token by token (what chat logprobs'
    `bytes` were before), puts every byte of a split character on the token that completes it."""
    vocabulary = TokenBytes(tokenizer)
    assert vocabulary.byte_of is not None  # the tiny tokenizer is byte-level
    ids = tokenizer.encode(MULTILINGUAL)
    text = TokenText(tokenizer)
    for token in ids:
        text.add(token)
    own = [vocabulary.of(t, piece, skip_special_tokens=True) for t, piece in zip(ids, text.pieces)]
    assert b"".join(own) == MULTILINGUAL.encode("utf-8") and "".join(text.pieces) == MULTILINGUAL
    mid_character = [i for i, piece in enumerate(text.pieces) if piece == ""]
    assert len(mid_character) >= 8  # é, €, ï, 日, 本, 語, 😀 each end inside at least one token
    for i in mid_character:
        assert own[i] and len(own[i]) == 1 and own[i][0] >= 0x80  # a lone byte of a multi-byte character
    naive = [piece.encode("utf-8") for piece in text.pieces]
    assert b"".join(naive) == MULTILINGUAL.encode("utf-8") and naive != own  # the control differs per token

    rng = random.Random(1)
    ordinary = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    for _ in range(100):  # random ids (most split characters, many are invalid UTF-8): the lossy decode agrees
        ids = [rng.choice(ordinary) for _ in range(rng.randrange(1, 32))]
        joined = b"".join(vocabulary.of(t, "", skip_special_tokens=True) for t in ids)
        assert joined.decode("utf-8", errors="replace") == tokenizer.decode(ids)


def test_token_bytes_of_special_and_silent_tokens(tokenizer):
    """A token the text leaves out has no bytes (the silent EOS, a skipped special token); kept, a special token's
    bytes are its content's."""
    vocabulary = TokenBytes(tokenizer)
    eos = tokenizer.eos_token_id
    assert vocabulary.of(eos, "", skip_special_tokens=True) == b""
    assert vocabulary.of(eos, "<|eos|>", skip_special_tokens=False) == b"<|eos|>"
    assert vocabulary.of(eos, "", skip_special_tokens=False, silent=True) == b""
