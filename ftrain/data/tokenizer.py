"""The byte-level tokenizer: token = byte value, vocabulary 256, nothing to download."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256). Documents in a corpus are joined by ``eot`` (NUL).

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.decode(tok.encode("héllo"))
        'héllo'
    """

    id = "bytes-v1"
    vocab_size = 256
    eot = 0  # NUL never occurs in text files, so it marks a document boundary

    def encode(self, text: str | bytes) -> torch.Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not data:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)

    def decode(self, tokens: torch.Tensor | Iterable[int]) -> str:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.flatten().tolist()
        return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")
