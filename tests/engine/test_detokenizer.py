"""Incremental detokenisation gives the full decode's text, one token at a time."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specmla.engine.detokenizer import IncrementalDetokenizer
from specmla.model.default import ASSETS
from specmla.tokenizer import Tokenizer


@pytest.fixture(scope="module", params=["bpe", "bytes"])
def tokenizer(request, tiny_model_dir):
    return Tokenizer(ASSETS if request.param == "bpe" else tiny_model_dir)


def feed(tok, ids, chunks=None):
    d = IncrementalDetokenizer(tok)
    pieces, i = [], 0
    for n in chunks or [1] * len(ids):
        i = min(len(ids), i + n)
        pieces.append(d.update(ids[:i]))
        if i == len(ids):
            break
    pieces.append(d.update(ids, final=True))  # whatever the chunking left: the stream ends here
    return d, "".join(pieces)


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=120)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, chunks=st.lists(st.integers(1, 5), max_size=60))
def test_incremental_equals_full_decode(tokenizer, text, chunks):
    ids = tokenizer.encode(text, add_bos=False)
    d, streamed = feed(tokenizer, ids, chunks)
    full = tokenizer.decode(ids)
    assert d.text == streamed
    assert d.text == full


def test_code_with_multibyte_characters_and_partial_bytes(tokenizer):
    text = "def grüß(x):\n    return '→ 日本語 🐍' * x  # ok\n"
    ids = tokenizer.encode(text, add_bos=False)
    d = IncrementalDetokenizer(tokenizer)
    seen = []
    for i in range(1, len(ids) + 1):
        delta = d.update(ids[:i])
        assert "\ufffd" not in delta  # a split character is held back, never printed half
        seen.append(delta)
        assert tokenizer.decode(ids[:i]).startswith(d.text)
    assert "".join(seen) == text == d.text


def test_no_new_tokens_adds_nothing(tokenizer):
    ids = tokenizer.encode("x = 1", add_bos=False)
    d = IncrementalDetokenizer(tokenizer)
    assert d.update(ids) == "x = 1"
    assert d.update(ids) == "" and d.update(ids[:1]) == ""
    assert d.text == "x = 1"


def test_a_held_back_replacement_character_comes_out_at_the_end(tokenizer):
    """A stream that ends inside a multi-byte character (here: cut after the first byte of '日'), or with a genuine
    U+FFFD, holds it back while more tokens may follow, and emits it with the final update, as the full decode."""
    for text in ("ok \ufffd", "ok 日"):
        ids = tokenizer.encode(text, add_bos=False)
        if text.endswith("日"):  # keep only the tokens up to the character's first byte, if the tokenizer splits it
            ids = next((ids[:i] for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd")), ids)
        d = IncrementalDetokenizer(tokenizer)
        streamed = "".join(d.update(ids[:i]) for i in range(1, len(ids) + 1))
        full = tokenizer.decode(ids)
        if full.endswith("\ufffd"):
            assert d.text == streamed == full[:-1]  # held back: another token could complete it
        held = full[len(d.text):]
        assert held.endswith("\ufffd")
        assert d.update(ids, final=True) == held
        assert d.text == full
