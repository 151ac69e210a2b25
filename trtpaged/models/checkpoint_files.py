"""An HF dir's safetensors and tokenizer files checked before transformers reads them, each fault named by its
file.

transformers (safetensors' reader) reports a truncated shard, or a weights file that is no safetensors file
(a link to another file), as "Error while deserializing header: ..." naming no file, and an index entry whose
shard lacks the tensor as a tensor missing from the checkpoint. The files transformers would read (model.safetensors,
else those model.safetensors.index.json names) are checked here from their headers: present, a valid safetensors
file whose tensors tile its data, and holding each tensor the index places in it. Links are followed (a Hugging Face
cache's snapshot files are links into its blobs/), and a link's target is named beside the file.

A .bin checkpoint is read by transformers with torch.load(weights_only=True), which refuses a pickle of anything
but tensors before any of it runs; `refused_pickle` words that refusal as one line naming the files.
"""

from __future__ import annotations

import json
from pathlib import Path

from trtpaged.config import ConfigError
from trtpaged.engine_files import read_safetensors_header
from trtpaged.manifest import EngineDirError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
KEY = "model.hf_dir"


def _shown(path: Path) -> str:
    """The path, and where it leads when it is a link."""
    return f"{path} (a link to {path.resolve()})" if path.is_symlink() else str(path)


def _header(path: Path, named_by: str = "") -> set[str]:
    """The tensor names of a safetensors file (`named_by`: the index that names it); raises ConfigError."""
    if not path.is_file():
        where = f", named by {named_by}," if named_by else ""
        missing = (f"{path}{where} is a link to {path.resolve()}, which does not exist" if path.is_symlink()
                   else f"{path}{where} is missing")
        raise ConfigError(f"{KEY}: {missing}", field=KEY)
    try:
        return set(read_safetensors_header(path, "weights"))
    except EngineDirError as e:
        reason = str(e).removeprefix(f"{e.path}: {e.field}: ")
        raise ConfigError(f"{KEY}: {_shown(path)}: {reason}", field=KEY) from None


def _json_object(path: Path) -> dict:
    """The JSON object a file of the HF dir holds; raises ConfigError naming the file (transformers' JSONDecodeError
    names none)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{KEY}: {_shown(path)} is not readable JSON ({str(e)[:120]})", field=KEY) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{KEY}: {_shown(path)} holds a JSON {type(value).__name__}; expected an object", field=KEY)
    return value


def _weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map (tensor -> shard file name); raises ConfigError naming the index."""
    content = _json_object(index)
    weight_map = content.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{KEY}: {_shown(index)}: weight_map is not an object of tensor -> shard file names",
                          field=KEY)
    if not weight_map:
        raise ConfigError(f"{KEY}: {_shown(index)}: weight_map names no tensors", field=KEY)
    if not isinstance(content.get("metadata"), dict):  # transformers reads it (a KeyError without)
        raise ConfigError(f"{KEY}: {_shown(index)} has no \"metadata\" object beside its weight_map, which "
                          "transformers reads (save_pretrained writes {\"metadata\": {\"total_size\": ...}})",
                          field=KEY)
    return weight_map


def check_safetensors_files(hf_dir: Path) -> None:
    """The safetensors files transformers would load from `hf_dir` are whole and hold what the index says; raises
    ConfigError naming the file (and the tensor). A dir without safetensors files is left to transformers."""
    single, index = hf_dir / SINGLE_FILE, hf_dir / INDEX_FILE
    if single.exists() or single.is_symlink():  # transformers takes model.safetensors before an index
        _header(single)
        return
    if not index.is_file():
        return
    weight_map = _weight_map(index)
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor)
    for shard, tensors in sorted(by_shard.items()):
        path = hf_dir / shard
        held = _header(path, INDEX_FILE)
        absent = [t for t in tensors if t not in held]
        if absent:
            raise ConfigError(f"{KEY}: {INDEX_FILE} places {absent[0]} in {_shown(path)}, which does not hold it "
                              f"({len(absent)} such tensor(s))", field=KEY)


def refused_pickle(hf_dir: Path, error: Exception) -> ConfigError:
    """torch.load(weights_only=True)'s refusal of a .bin checkpoint (a pickle of more than tensors, which could
    run code once unpickled), as one line naming the files; torch's own message runs over several lines."""
    files = ", ".join(sorted(p.name for p in hf_dir.glob("*.bin"))) or "its .bin files"
    lines = [line.strip() for line in str(error).split("WeightsUnpickler error:")[-1].splitlines() if line.strip()]
    why = lines[0] if lines else "not tensors only"
    return ConfigError(f"{KEY}: {hf_dir}: {files}: torch.load(weights_only=True) refuses it ({why}): a pickle of "
                       "other objects could run code when loaded, and nothing in it was run; give the model's "
                       "safetensors weights instead", field=KEY)


# what transformers builds a tokenizer from: the fast tokenizer's file, a sentencepiece or tiktoken model, a BPE pair
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("tiktoken.model",), ("vocab.json", "merges.txt"),
                   ("vocab.txt",))  # fmt: skip
# the tokenizer's JSON files transformers parses (a broken one failed the load with a JSONDecodeError naming no file)
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "chat_template.json")


def check_tokenizer_files(hf_dir: Path) -> None:
    """`hf_dir` has a tokenizer (else ValueError naming the files: transformers' own message speaks of slow
    tokenizers and sentencepiece), and each of its JSON files is a JSON object (else ConfigError naming the file)."""
    if not any(all((hf_dir / name).is_file() for name in group) for group in TOKENIZER_FILES):
        names = ", ".join(" + ".join(group) for group in TOKENIZER_FILES)
        raise ValueError(f"no tokenizer in {hf_dir}: it needs one of {names} (copy the model's tokenizer files "
                         "beside its config.json)")
    for name in TOKENIZER_JSON_FILES:
        if (hf_dir / name).exists():
            _json_object(hf_dir / name)
