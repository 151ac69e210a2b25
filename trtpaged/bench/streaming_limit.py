"""The weight-streaming limit of single-stream decode: a decode step of one sequence reads every weight of the model
once (each linear, the norms, the LM head; the embedding one row), so it cannot take less than those bytes over the
machine's read bandwidth. `bench throughput` measures both in the trtpaged row's own process, after its rounds, and
states the decode time (TPOT p50) as a fraction of that limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # only for hints: throughput_bench imports this module, and `bench serve` needs no torch
    import torch
    from torch import nn

# The read-bandwidth buffer: at least this large, so that the last-level cache does not serve it, and at most this
# large (a large float model's weights again would double the row's memory; past the caches the figure is the same)
MIN_READ_BYTES = 64 << 20
MAX_READ_BYTES = 1 << 30


def _compute_form(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a forward call of `module` reads in full: a quantized linear's packed CPU weight where it has one
    (else its codes, scales and offsets, or its de-quantized copy where it runs as a float linear), and its bias;
    any other module's own parameters."""
    from trtpaged.models.qlinear import QuantizedLinear

    if isinstance(module, QuantizedLinear):
        op = module._op
        if op is not None:
            weight = [op.packed]
        elif module._dense is not None:
            weight = [module._dense]
        else:
            weight = [t for t in (module.codes, module.scales, module.offsets) if t is not None]
        return weight + ([module.bias] if module.bias is not None else [])
    return list(module.parameters(recurse=False))


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step of `model` (a LlamaStepModel) reads: every module's compute form
    (`_compute_form`), each storage once, with the token embedding counted only where it is also the LM head (tied
    embeddings); a lookup reads one row of it per token."""
    tied = getattr(model, "lm_head", None) is None
    # untied, the table is only looked up; tied, it is read as the head (a QuantizedEmbedding's QuantizedLinear)
    skip = set() if tied else {id(m) for m in model.embed_tokens.modules()}
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if id(module) in skip:
            continue
        for tensor in _compute_form(module):
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.nbytes
    return total


def read_bandwidth_gbs(num_bytes: int, repeats: int = 7) -> float:
    """The machine's read bandwidth in GB/s over a buffer of num_bytes, within [MIN_READ_BYTES, MAX_READ_BYTES]:
    torch's multithreaded sum over float32, the best of `repeats`."""
    from trtpaged.bench.qlinear_bench import read_bandwidth_gbs as sum_bandwidth

    return sum_bandwidth(buffer_bytes(num_bytes), repeats)


def buffer_bytes(weight_bytes: int) -> int:
    """The read-bandwidth buffer's size for weights of `weight_bytes`."""
    return min(max(weight_bytes, MIN_READ_BYTES), MAX_READ_BYTES)


@dataclass(frozen=True)
class StreamingLimit:
    """A row's weights per decode step and the read bandwidth measured in its process."""

    weight_bytes: int
    read_gbs: float

    @property
    def limit_s(self) -> float:
        """The least time a decode step can take: the weights over the read bandwidth."""
        return self.weight_bytes / (self.read_gbs * 1e9)

    def describe(self, tpot_s: float) -> str:
        """One line: the decode time per token against the limit."""
        return (f"single-stream decode against the weight-streaming limit: {self.weight_bytes / 1e6:.1f} MB of "
                f"weights a step / {self.read_gbs:.1f} GB/s read bandwidth (measured after the run) = "
                f"{self.limit_s * 1e3:.2f} ms; TPOT p50 {tpot_s * 1e3:.2f} ms: {self.limit_s / tpot_s:.2f} of the "
                "limit")


def measure(runner: object, say: Callable[[str], None] = lambda _m: None) -> Optional[StreamingLimit]:
    """The limit of the decode steps of an engine's `runner` on this machine, or None where there is no single CPU
    model to read (tensor-parallel ranks, whose rank-0 runner holds its shard only; a CUDA device; a TensorRT
    engine)."""
    from trtpaged.runtime.runners.torch_runner import TorchRunner

    model = runner.model if isinstance(runner, TorchRunner) else None
    if model is None or not hasattr(model, "embed_tokens"):
        return None
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None
    weight_bytes = decode_weight_bytes(model)
    say(f"measuring the read bandwidth over {buffer_bytes(weight_bytes) / 1e6:.0f} MB (the weight-streaming limit)")
    return StreamingLimit(weight_bytes, read_bandwidth_gbs(weight_bytes))
