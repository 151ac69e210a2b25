"""vLLM's `LLM(...)` engine arguments, read onto a built engine.

A script written for vLLM passes some of these; each is taken for what it means here, or refused naming it:
- renamed limits: max_model_len (max_seq_len), max_num_seqs (max_batch_size), max_num_batched_tokens
  (max_num_tokens), tensor_parallel_size (tensor_parallel); given twice under both names with two values: refused;
- seed: seeds the global RNGs once, as vLLM does, so that requests without their own seed draw the same tokens
  run after run; as in vLLM (V1) it defaults to 0, and `seed=None` leaves the RNGs as they are;
- swap_space (GiB of host memory for swapped-out blocks): num_host_blocks;
- settled when the engine was built, so only "auto" / None / the engine's own value is taken: dtype,
  kv_cache_dtype, quantization, block_size, tokenizer (the engine dir carries its tokenizer);
- without an effect on a compiled engine (no CUDA graphs to skip, no remote code, no stats logger):
  enforce_eager, trust_remote_code, disable_log_stats; gpu_memory_utilization is checked, and the KV pool
  stays the engine's kv_cache budget (num_kv_blocks changes it), with a warning.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Optional

from trtpaged.manifest import Manifest

log = logging.getLogger("trtpaged")

RENAMED = {"max_model_len": "max_seq_len", "max_num_seqs": "max_batch_size",
           "max_num_batched_tokens": "max_num_tokens", "tensor_parallel_size": "tensor_parallel"}  # fmt: skip
BUILT_IN = ("dtype", "kv_cache_dtype", "quantization", "block_size", "tokenizer")
NO_EFFECT = ("enforce_eager", "trust_remote_code", "disable_log_stats")
OTHERS = ("seed", "swap_space", "gpu_memory_utilization")
ACCEPTED = (*RENAMED, *BUILT_IN, *NO_EFFECT, *OTHERS)
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings of dtype


def apply_vllm_args(args: dict[str, Any], ours: dict[str, Any], manifest: Manifest, model: Any, device: str) -> None:
    """Checks vLLM's engine arguments `args` against the engine and writes what they set into `ours` (LLM's own
    keyword values, None where not given). Raises TypeError for a name vLLM's LLM does not take here, ValueError
    naming the argument for a value this engine cannot honour."""
    unknown = sorted(set(args) - set(ACCEPTED))
    if unknown:
        raise TypeError(f"LLM got unexpected keyword arguments {unknown}; of vLLM's engine arguments it takes "
                        f"{', '.join(ACCEPTED)}")
    bounds = {"max_model_len": manifest.limits.max_seq_len, "max_num_seqs": manifest.limits.max_batch_size,
              "max_num_batched_tokens": manifest.limits.max_num_tokens, "tensor_parallel_size": 64}  # fmt: skip
    for name, own in RENAMED.items():
        if args.get(name) is None:
            continue
        value, high = args[name], bounds[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise ValueError(f"{name}: must be an integer in [1, {high}] (the engine's build limit), got {value!r:.40}")
        if ours.get(own) is not None and ours[own] != args[name]:
            raise ValueError(f"{name}: {args[name]!r} and {own} (its name here) {ours[own]!r} disagree; give one")
        ours[own] = args[name]
    _check_built_in(args, manifest, model)
    for name in NO_EFFECT:
        if name in args and not isinstance(args[name], bool):
            raise ValueError(f"{name}: expected true or false, got {args[name]!r}")
    utilization = args.get("gpu_memory_utilization")
    if utilization is not None:
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: expected a fraction in (0, 1], got {utilization!r}")
        log.warning("gpu_memory_utilization=%s has no effect: the KV pool is the engine's kv_cache budget (on %s "
                    "too); num_kv_blocks sets its size", utilization, device)  # fmt: skip
    swap = args.get("swap_space")
    if swap is not None:
        if isinstance(swap, bool) or not isinstance(swap, (int, float)) or not 0 <= swap < 1 << 20:
            raise ValueError(f"swap_space: expected GiB of host memory (>= 0), got {swap!r}")
        if ours.get("num_host_blocks"):
            raise ValueError("swap_space: num_host_blocks (its form here) is given too; give one")
        ours["num_host_blocks"] = int(swap * (1 << 30)) // manifest.kv_bytes_per_block_per_rank
    seed = args.get("seed", 0)  # vLLM V1's default: unseeded sampling repeats from run to run
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed: expected an integer in [0, 2**63), got {seed!r}")
        import numpy as np
        import torch

        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)


def _check_built_in(args: dict[str, Any], manifest: Manifest, model: Any) -> None:
    engine = {"dtype": manifest.dtype, "kv_cache_dtype": manifest.kv_cache_dtype,
              "block_size": manifest.limits.block_size, "quantization": _quantization(manifest)}  # fmt: skip
    for name in ("dtype", "kv_cache_dtype", "block_size", "quantization"):
        value = args.get(name)
        if name == "dtype" and isinstance(value, str):
            value = DTYPE_ALIASES.get(value, value)
        if value is None or value == "auto" or value == engine[name] or str(value) == f"torch.{engine[name]}":
            continue
        raise ValueError(f"{name}: {value!r}, but the engine was built with {engine[name]!r}; it is fixed at build "
                         "time (model.yaml), so build an engine with it")
    tokenizer = args.get("tokenizer")
    if tokenizer is not None and Path(str(tokenizer)).resolve() != Path(str(model)).resolve():
        raise ValueError(f"tokenizer: {str(tokenizer)[:120]!r}; an engine dir carries its own tokenizer (the one it "
                         "was built with), so only the engine dir itself may be given")


def _quantization(manifest: Manifest) -> Optional[str]:
    q = manifest.quantization
    return None if not q else str(q.get("weights"))
