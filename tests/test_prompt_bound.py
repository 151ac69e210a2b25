"""The fewest tokens a text can make, from its length alone (runtime/prompt_bound.py), on tokenizers built in memory
and the tiny engine's: never more than the tokenizer's own count (hypothesis texts, and the worst cases: runs of a
vocabulary's longest token); no bound where a part of the tokenizer may drop text. The server's use is in
tests/test_server_hostile.py."""

from __future__ import annotations

import pytest
import tokenizers
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import models, normalizers, pre_tokenizers

from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer
from trtpaged.runtime.prompt_bound import prompt_bound


def _fast(tok: tokenizers.Tokenizer) -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _byte_level_with_merges() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE whose longest tokens are runs of spaces and of "ab" (GPT-2's "Ġ" spells a space)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("ĠĠĠĠ", "ĠĠĠĠ"), ("a", "b"), ("ab", "ab"), ("abab", "abab")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return _fast(tok)


def _sentencepiece_style() -> transformers.PreTrainedTokenizerFast:
    """Llama 2 style: NFKC, "▁" for spaces, words merged, byte fallback for the rest."""
    vocab = {"<unk>": 0, "▁": 1, "h": 2, "▁h": 3, "é": 4, "▁hé": 5}
    vocab.update({f"<0x{b:02X}>": 6 + b for b in range(256)})
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "h"), ("▁h", "é")], byte_fallback=True,
                                          unk_token="<unk>"))  # fmt: skip
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])  # fmt: skip
    return _fast(tok)


TOKENIZERS = {"tiny": make_tiny_tokenizer, "byte_level": _byte_level_with_merges, "sentencepiece": _sentencepiece_style}
TEXT = st.text(alphabet=st.sampled_from(list("ab hé\u0301\u1100\u1161\u11a8😀世\n=")), max_size=300)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_the_bound_never_exceeds_the_tokenizers_count(name, text):
    fast = TOKENIZERS[name]()
    bound = prompt_bound(fast)
    assert bound is not None
    assert bound.fewest_tokens(len(text.encode())) <= len(fast.encode(text, add_special_tokens=False))


def test_the_worst_cases_are_close_to_the_bound():
    """Runs of the longest token (16 spaces, "abababab") come within a token of the bound; Hangul jamo that NFKC
    composes (9 bytes into 3) stay above it."""
    fast = _byte_level_with_merges()
    bound = prompt_bound(fast)
    assert bound.max_token_bytes == 8 and bound.shrink == 1
    for text in (" " * 800, "ab" * 400):
        assert len(fast.encode(text)) == bound.fewest_tokens(len(text.encode())) == 100
    piece = _sentencepiece_style()
    assert prompt_bound(piece).shrink == 4
    jamo = "\u1100\u1161\u11a8" * 50  # composes to 50 syllables
    assert prompt_bound(piece).fewest_tokens(len(jamo.encode())) <= len(piece.encode(jamo))


@pytest.mark.parametrize("change", ["whitespace_split", "strip", "replace_to_nothing", "word_level", "fused_unk"])
def test_no_bound_where_text_may_be_dropped(change):
    """A pre-tokenizer or normalizer that removes text, or a model that may cover any run with one token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<unk>"] = len(vocab)
    if change == "word_level":
        tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    else:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                              fuse_unk=change == "fused_unk"))  # fmt: skip
    if change == "whitespace_split":
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    elif change == "strip":
        tok.normalizer = normalizers.Strip()
    elif change == "replace_to_nothing":
        tok.normalizer = normalizers.Replace(" ", "")
    assert prompt_bound(_fast(tok)) is None
