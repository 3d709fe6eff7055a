"""Thin wrapper over Hugging Face `tokenizers` (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character that stands for each byte → the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = HFTokenizer.from_file(str(tj))
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            with open(path / "tokenizer_config.json") as f:
                cfg = json.load(f)
        self.config = cfg
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(bos) if bos else None
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self.add_bos = bool(cfg.get("add_bos_token", self.bos_token_id is not None))
        self.chat_template = cfg.get("chat_template")
        spec = json.loads(self._tok.to_str())
        self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self._normalizes = spec.get("normalizer") is not None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def check(self, vocab_size: int) -> None:
        """Raise ValueError (one line) where this tokenizer would fail every request to a model of `vocab_size`
        tokens: ids past the model's vocabulary, or a short text that does not come back from its tokens."""
        sample = "Hello, world! 123 — ünïcode"
        ids = self.encode(sample, add_bos=False)
        if not ids or max(ids) >= vocab_size:
            raise ValueError(f"the tokenizer's ids ({max(ids, default=-1)} for a short text) do not fit the model's "
                             f"vocabulary of {vocab_size}")
        back = self.decode(ids, skip_special_tokens=False)
        if back.strip() != self.normalized(sample):
            raise ValueError(f"the tokenizer does not round-trip a short text ({sample!r} came back as {back!r})")

    def normalized(self, text: str) -> str:
        """The text as the tokenizer's normalizer (if any) sees it: what decoding its tokens gives back."""
        norm = self._tok.normalizer
        return norm.normalize_str(text) if norm is not None else text

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """A bound on the characters of text one token covers: the most UTF-8 bytes a token stands for (special
        tokens included; a character is at least one byte), doubled where a normalizer may shorten the text first.
        A text of n characters encodes to at least n / max_chars_per_token tokens, which bounds a prompt before it
        is tokenised."""
        most = max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1)
        return max(1, most) * (2 if self._normalizes else 1)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long text does not stall the process's other threads
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's raw bytes (a byte-level token can hold part of a UTF-8 character, which decode
        turns into U+FFFD)."""
        tok = self._tok.id_to_token(token_id)
        if tok is not None and self._byte_level and all(c in _BYTE_DECODER for c in tok):
            return bytes(_BYTE_DECODER[c] for c in tok)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8", "replace")
