"""The engine dir's tokenizer, checked to encode as the source model's does once reloaded.

transformers 5 rebuilds a family's own tokenizer class (GemmaTokenizer, LlamaTokenizer, ...) from that family's
usual pipeline, not from the saved tokenizer.json's. A source whose tokenizer is not its family's usual kind (a
GGUF with a BPE vocabulary in a gemma2 file) was saved as GemmaTokenizer and came back unable to encode any text
("Unk token `None` not found in the vocabulary"), though the build had passed. Such a tokenizer is saved as its
tokenizer.json alone (transformers' generic TokenizersBackend); one that still encodes otherwise refuses the build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

GENERIC_CLASS = "TokenizersBackend"
# spaces, tabs, blank lines, digits, punctuation, accents, CJK and an emoji: where tokenizer pipelines differ
PROBE = "Hello, world!  Two  spaces,\ttabs\n\nnew lines; 12345 x=f(y) Ünïcödé — 日本語 🤖"


class TokenizerRoundTripError(ValueError):
    """The saved tokenizer, reloaded, encodes text otherwise than the source model's."""


def _probe(tokenizer: Any) -> Union[list[int], str]:
    try:
        return list(tokenizer.encode(PROBE, add_special_tokens=True))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a plain Exception
        return f"{type(e).__name__}: {str(e).strip()[:160]}"


def _reloaded(out: Path) -> Any:
    from transformers import AutoTokenizer

    try:  # as the runtime loads it (trtpaged.runtime.llm.load_tokenizer)
        return AutoTokenizer.from_pretrained(str(out), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types
        return f"transformers cannot load it ({type(e).__name__}: {str(e).strip()[:160]})"


def check_saved_tokenizer(tokenizer: Any, out: Path) -> None:
    """`tokenizer`, saved in `out`, encodes as it does once reloaded; else it is saved as its tokenizer.json alone,
    or TokenizerRoundTripError names the class and what the reloaded one gives."""
    want = _probe(tokenizer)
    reloaded = _reloaded(out)
    if not isinstance(reloaded, str) and _probe(reloaded) == want:
        return
    config_file = out / "tokenizer_config.json"
    saved = json.loads(config_file.read_text()) if config_file.is_file() else {}
    saved_class = saved.get("tokenizer_class", type(tokenizer).__name__)
    config_file.write_text(json.dumps({**saved, "tokenizer_class": GENERIC_CLASS}, indent=2, ensure_ascii=False))
    generic = _reloaded(out)
    got = generic if isinstance(generic, str) else _probe(generic)
    if got != want:
        raise TokenizerRoundTripError(f"tokenizer: the source's {type(tokenizer).__name__}, saved as {saved_class} or "
                                      f"{GENERIC_CLASS} and reloaded, encodes {PROBE!r} otherwise: {str(got)[:200]} "
                                      f"(the source gives {str(want)[:200]})")  # fmt: skip
