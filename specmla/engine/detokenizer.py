"""Incremental detokenisation: a request's text grows by decoding a short window per new token.

Decoding the whole output after every token costs O(n) per token, O(n²) per request. Here each
step decodes only the tokens since the previous emission plus the new ones (vLLM's scheme):
text += decode(ids[prefix:]) − decode(ids[prefix:read]). Keeping the previous chunk in the window
lets byte-level merges and leading-space rules see their left context; a window that ends inside a
multi-byte UTF-8 character (U+FFFD) emits nothing until the character is complete. The stream's last update
(`final`) emits whatever is held back: a character that will never complete, or a genuine U+FFFD, which no
window can tell from an incomplete one.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = 0  # start of the decoded window (the previous chunk's first token)
        self.read = 0  # tokens already turned into text
        self.text = ""

    def update(self, ids: list[int], final: bool = False) -> str:
        """Text added by the tokens of `ids` beyond those already read (may be ""); `final`: no token follows, so a
        trailing U+FFFD is emitted too."""
        if len(ids) <= self.read:
            return ""
        decode = self.tokenizer.decode
        before = decode(ids[self.prefix : self.read])
        after = decode(ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # nothing printable yet, or a character still incomplete
        delta = after[len(before) :]
        self.text += delta
        self.prefix, self.read = self.read, len(ids)
        return delta
