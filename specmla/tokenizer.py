"""Thin wrapper over Hugging Face `tokenizers` (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

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
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

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
