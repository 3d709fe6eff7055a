"""Thin wrapper over Hugging Face `tokenizers` (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


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
