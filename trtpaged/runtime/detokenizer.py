"""Incremental detokenisation that never emits half a multi-byte character."""

from __future__ import annotations

from typing import Any, Optional, Sequence

_CONTEXT_TOKENS = 6  # prompt tokens decoded with the output so leading spaces come out right
REPLACEMENT = "\ufffd"  # what a decode gives for the bytes of an incomplete character


def _decode_stream(tokenizer: Any, skip_special_tokens: bool, context: Sequence[int],
                   pending: Sequence[int]) -> Optional[tuple[Any, Any]]:  # fmt: skip
    """(the Rust tokenizer, a `tokenizers` DecodeStream whose window starts with `context`, then stepped through
    `pending`, tokens whose text is not complete yet) where the tokenizer has one and its decode adds no clean-up
    of its own; None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    stream = DecodeStream(ids=[int(t) for t in context], skip_special_tokens=skip_special_tokens)
    for token in pending:  # held back inside the stream until a later token completes their character
        stream.step(backend, int(token))
    return backend, stream


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window: `prefix` tokens already emitted and the new ones.
    The text of the new tokens is what the window decodes to beyond the
    prefix. While it ends in U+FFFD (a byte-level token that completes a UTF-8
    character has not arrived yet), nothing is emitted and the window grows.
    With a Hugging Face fast tokenizer, `tokenizers`' DecodeStream runs that
    window in Rust: about 1 us a token instead of ~40 us for two Python decodes.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(t) for t in prompt_token_ids[-_CONTEXT_TOKENS:]]
        self.prefix_offset = 0
        # a prompt that ends inside a character: its last bytes are not text yet, and the output token that
        # completes the character emits it whole (as vLLM does; was: the window's whole text came out again)
        self.read_offset = len(self.ids)
        while self.read_offset and self._decode(self.ids[: self.read_offset]).endswith(REPLACEMENT):
            self.read_offset -= 1
        self._stream = _decode_stream(tokenizer, skip_special_tokens, self.ids[: self.read_offset],
                                      self.ids[self.read_offset :])  # fmt: skip
        # those prompt bytes until the first text: theirs only if an output byte completes their character; known
        # by the prompt's text (U+FFFD at its end) being the start of the context's text and the first text
        self._prompt_text: Optional[str] = self._decode(self.ids) if self.read_offset < len(self.ids) else None
        self._context_text = self._decode(self.ids[: self.read_offset]) if self._prompt_text is not None else ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one token and returns the text that became final (possibly empty)."""
        self.ids.append(int(token_id))
        if self._stream is not None:
            backend, stream = self._stream
            try:
                text = stream.step(backend, int(token_id))
            except Exception:  # noqa: BLE001 - tokenizers raises a plain Exception
                # "Invalid prefix encountered": bytes that are no UTF-8 (a SentencePiece byte-fallback vocabulary's
                # <0xF3> <0x6E>) changed text the stream had emitted; the Python decodes below take it from here
                self._stream = None
            else:
                if not text:
                    return ""
                self.prefix_offset, self.read_offset = max(0, self.read_offset - _CONTEXT_TOKENS), len(self.ids)
                return self._first(text)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._first(full_text[len(prefix_text) :])

    def _first(self, text: str) -> str:
        """`text`, less the prompt's last bytes where they are its start and no output byte completed their
        character: they stay the prompt's (U+FFFD there), and the answer is its own tokens' text in context (was:
        "\ufffd-19" for "-19"). A word-start space the output's first token brings (SentencePiece's "▁") stays."""
        prompt_text = self._prompt_text
        if prompt_text is None:
            return text
        self._prompt_text = None
        whole = self._context_text + text
        return whole[len(prompt_text) :] if whole.startswith(prompt_text) else text

    def _held(self) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""

    def held_text(self) -> str:
        """The complete characters of the text held back so far (without its incomplete character at the end);
        nothing changes."""
        return self._held().rstrip(REPLACEMENT)

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character at the very end)."""
        text = self._held()
        self.prefix_offset = self.read_offset = len(self.ids)
        return self._first(text) if text else text
