"""Tokenizers, chosen by ``tokenizer.kind`` in the config."""

from __future__ import annotations

import numpy as np

from .config import TokenizerConfig

__all__ = ["ByteTokenizer", "make_tokenizer", "EOD", "PAD"]

EOD = 256
PAD = 257


class ByteTokenizer:
    """UTF-8 bytes as token ids: 0-255 are bytes, 256 ends a document, 257 pads."""

    vocab_size = 258
    eod_id = EOD
    pad_id = PAD

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` followed by the end-of-document id, as int32."""
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        out = np.empty(raw.size + 1, dtype=np.int32)
        out[:-1] = raw
        out[-1] = EOD
        return out

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of ``ids``; end-of-document and padding ids are dropped."""
        arr = np.asarray(ids)
        return bytes(arr[arr < 256].astype(np.uint8)).decode("utf-8")


def make_tokenizer(cfg: TokenizerConfig) -> ByteTokenizer:
    """Build the tokenizer a config names."""
    if cfg.kind == "bytes":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer kind {cfg.kind!r}")
