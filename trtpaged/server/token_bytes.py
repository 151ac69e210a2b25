"""A token's own bytes, for chat log-probs' `bytes` field.

A token's decoded text cannot give them when the token holds part of a multi-byte UTF-8
character (an emoji, most CJK text in a byte-level BPE): decoded alone it is U+FFFD. OpenAI
sends the token's real bytes, so that a client joining every token's bytes gets the text's
UTF-8. They are read from the token's vocabulary string: a byte-level BPE (GPT-2, Llama 3,
SmolLM2) spells each byte as one character of the GPT-2 byte<->unicode table (transformers'
`bytes_to_unicode`), a byte-fallback tokenizer (Llama 2, Mistral) spells a lone byte `<0xNN>`.
Added tokens and any other tokenizer: the UTF-8 of the decoded text.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder and of the decoders a Sequence decoder holds."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    try:
        state = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return set()
    return {d.get("type") for d in [state, *state.get("decoders", [])] if isinstance(d, dict)}


def token_bytes_reader(tokenizer: Any) -> Callable[[int, str], bytes]:
    """`read(token_id, text)`: the token's bytes, `text` being its decoded text (the fallback)."""
    kinds = _decoder_types(tokenizer)
    table: dict[str, int] = {}
    if "ByteLevel" in kinds:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        table = {ch: b for b, ch in bytes_to_unicode().items()}
    fallback = "ByteFallback" in kinds
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def read(token_id: int, text: str) -> bytes:
        if token_id not in added and (table or fallback):
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if table and piece and all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
                match = _BYTE_FALLBACK.fullmatch(piece) if fallback else None
                if match:
                    return bytes([int(match.group(1), 16)])
        return text.encode("utf-8")

    return read
