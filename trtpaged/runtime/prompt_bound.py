"""How many tokens a text makes at least, from its length alone, without tokenizing it.

Tokenizing is linear in the text but not free (SmolLM2's tokenizer: about 1 s per MB): a megabytes-long prompt
that could never fit would hold the server's tokenizer thread (and a core) for seconds, every request queued
behind it, only to be refused after. With this bound such a prompt is refused before.

The bound: each token stands for at most `max_token_bytes` bytes of the text the tokenizer's model sees, so a
text of B bytes makes at least B / max_token_bytes tokens. It holds only where nothing drops text before the
model, and where the model cannot cover an unbounded run with one token, so it is given (`PromptBound`) only
for fast tokenizers made of parts known to keep every byte: a BPE model (no fused unknowns), pre-tokenizers that
split without removing, and normalizers that at most re-compose Unicode (which shrinks a text by at most 3x in
UTF-8: three Hangul jamo of 3 bytes each into one syllable; the bound takes 4x) or replace a literal with a
literal no shorter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

_UNICODE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}
_COMPOSITION_SHRINK = 4  # bytes of text per byte a Unicode normalizer leaves, at most (3, with margin)


@dataclass(frozen=True)
class PromptBound:
    """A lower bound on the tokens of a text from its UTF-8 length (special tokens the tokenizer adds aside)."""

    max_token_bytes: int  # the most bytes of the model's input one token stands for
    shrink: int  # the most the normalizer shrinks a text, as a factor on its UTF-8 bytes

    def fewest_tokens(self, nbytes: int) -> int:
        """At least this many tokens make `nbytes` bytes of UTF-8 text (or a text that holds them)."""
        return -(-nbytes // (self.max_token_bytes * self.shrink))


def _state(component: Any) -> Optional[dict]:
    if component is None:
        return None
    try:
        state = json.loads(component.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return {"type": "unknown"}
    return state if isinstance(state, dict) else {"type": "unknown"}


def _flatten(state: Optional[dict], key: str) -> list[dict]:
    if state is None:
        return []
    if state.get("type") == "Sequence":
        return [s for part in state.get(key, []) for s in _flatten(part, key)]
    return [state]


def _normalizer_shrink(state: Optional[dict]) -> Optional[int]:
    """The most the normalizer shrinks a text (1: never), or None when it may drop text."""
    shrink = 1
    for part in _flatten(state, "normalizers"):
        kind = part.get("type")
        if kind in _UNICODE_NORMALIZERS:
            shrink = _COMPOSITION_SHRINK
        elif kind == "Prepend":
            continue
        elif kind == "Replace":
            pattern, content = part.get("pattern", {}), part.get("content", "")
            literal = pattern.get("String") if isinstance(pattern, dict) else None
            if literal is None or len(content.encode()) < len(literal.encode()):
                return None
        else:
            return None
    return shrink


def _keeps_text(state: Optional[dict]) -> bool:
    """Whether the pre-tokenizer only splits (no part removes what it matches)."""
    for part in _flatten(state, "pretokenizers"):
        if part.get("type") not in _PRE_TOKENIZERS or str(part.get("behavior", "")).lower() == "removed":
            return False
    return True


def prompt_bound(tokenizer: Any) -> Optional[PromptBound]:
    """The bound for `tokenizer` (a transformers fast tokenizer), or None where none is known."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = _state(backend.model) or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")):
        return None
    shrink = _normalizer_shrink(_state(backend.normalizer))
    if shrink is None or not _keeps_text(_state(backend.pre_tokenizer)):
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in _flatten(_state(backend.pre_tokenizer), "pretokenizers"))
    added = {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    # A byte-level vocabulary spells each byte as one character (GPT-2's table); others are the text itself.
    longest = max((len(s) if byte_level and s not in added else len(s.encode("utf-8", errors="surrogatepass"))
                   for s in tokenizer.get_vocab()), default=0)  # fmt: skip
    # an unknown character (BPE without fusing) is one token of at most 4 bytes
    return PromptBound(max(longest, 4), shrink) if longest else None
