"""A token's own bytes (chat logprobs' `bytes`, server/token_bytes.py) on tokenizers built in memory: a byte-level
BPE with merges, a byte-fallback (Llama 2 style) BPE, and one without byte tokens; the truth is the UTF-8 of the
text the tokens spell. The server's end-to-end check is in tests/test_server_vllm_fields.py."""

from __future__ import annotations

import tokenizers
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from trtpaged.server.token_bytes import token_bytes_reader

TEXT = "hé 😀 世界"


def _fast(tok, **kw):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


def _joined(fast, ids) -> bytes:
    read = token_bytes_reader(fast)
    return b"".join(read(t, fast.decode([t], skip_special_tokens=False)) for t in ids)


def test_byte_level_bpe_pieces_map_through_the_byte_table():
    """Merged pieces ("Ã©" is é's two bytes as one token) and lone bytes of a 4-byte emoji: each token's bytes,
    where its decoded text alone would be U+FFFD; an added special token keeps its text."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["Ã©"] = len(vocab)
    vocab["<|end|>"] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("Ã", "©")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = _fast(tok, eos_token="<|end|>")
    ids = fast.encode(TEXT + "<|end|>", add_special_tokens=False)
    assert vocab["Ã©"] in ids and ids[-1] == vocab["<|end|>"]
    assert _joined(fast, ids) == (TEXT + "<|end|>").encode("utf-8")
    assert any("\ufffd" in fast.decode([t]) for t in ids)  # what the decoded text alone would have given


def test_byte_fallback_tokens_are_their_byte():
    """Characters outside the vocabulary fall back to <0xNN> tokens: each is its one byte."""
    vocab = {"<unk>": 0, "▁h": 1, "▁": 2, "h": 3}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "h")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # fmt: skip
    fast = _fast(tok, unk_token="<unk>")
    ids = fast.encode("h😀世", add_special_tokens=False)
    assert fast.convert_ids_to_tokens(ids)[0] == "▁h" and len(ids) == 1 + 4 + 3
    assert _joined(fast, ids[1:]) == "😀世".encode("utf-8")


def test_other_tokenizers_give_the_texts_utf8():
    tok = tokenizers.Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "世界": 1, "hé": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = _fast(tok, unk_token="[UNK]")
    ids = fast.encode("hé 世界", add_special_tokens=False)
    assert ids == [2, 1] and _joined(fast, ids) == "hé世界".encode("utf-8")
