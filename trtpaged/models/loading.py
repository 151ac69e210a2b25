"""Building step models from HF models and from engine dirs."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from trtpaged.engine_files import TensorEntry, read_safetensors_header
from trtpaged.manifest import MANIFEST_NAME, EngineDirError, Manifest, ModelDims, engine_path, read_manifest
from trtpaged.models.all_reduce import RankReduce
from trtpaged.models.dims import CUDA_HEAD_DIMS
from trtpaged.models.llama import LlamaStepModel, QuantPlan, Rotary
from trtpaged.models.tensor_parallel import shard_dims, shard_plan
from trtpaged.models.qlinear import set_activations
from trtpaged.models.quant import fp16_exact

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# step-model module -> the HF modules stacked along its outputs, in order
FUSED_MODULES = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def hf_module_names(dims: ModelDims) -> dict[str, tuple[str, ...]]:
    """Every linear module of the step model -> the HF module names (without `model.`) it is made of."""
    out: dict[str, tuple[str, ...]] = {}
    for i in range(dims.num_layers):
        prefix = f"layers.{i}."
        for fused, parts in FUSED_MODULES.items():
            out[prefix + fused] = tuple(prefix + p for p in parts)
        out[prefix + "self_attn.o_proj"] = (prefix + "self_attn.o_proj",)
        out[prefix + "mlp.down_proj"] = (prefix + "mlp.down_proj",)
    return out


def hf_state_dict(hf_model: Any, dims: ModelDims) -> dict[str, torch.Tensor]:
    """The HF model's weights under the step model's names: prefix `model.` dropped, tied head dropped,
    q/k/v and gate/up stacked into the fused modules."""
    hf = {}
    for name, tensor in hf_model.state_dict().items():
        tied_head = dims.tie_word_embeddings and name == "lm_head.weight"
        if "rotary_emb" in name or name.endswith("embed_scale") or tied_head:
            continue
        hf[name.removeprefix("model.")] = tensor
    for module, parts in hf_module_names(dims).items():
        if len(parts) == 1:
            continue
        for kind in ("weight", "bias"):
            if f"{parts[0]}.{kind}" in hf:
                hf[f"{module}.{kind}"] = torch.cat([hf.pop(f"{p}.{kind}") for p in parts])
    return hf


def step_model_from_hf(hf_model: Any, dims: ModelDims, dtype: torch.dtype = torch.float32) -> LlamaStepModel:
    """A LlamaStepModel carrying the HF model's weights (cast to dtype)."""
    state = {k: v.detach().to(dtype) for k, v in hf_state_dict(hf_model, dims).items()}
    return with_weights(dims, dtype, state, "cpu")


# torch.nn.init's fillers, which nn.Linear / nn.Embedding call when built
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def _skipping_init() -> Iterator[None]:
    """torch.nn.init's fillers do nothing inside: a model built on the meta device has no values to fill, and on
    meta tensors they run torch's Python references, whose first use imports torch._dynamo and sympy (about 2 s
    of an engine's load)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def meta_step_model(dims: ModelDims, dtype: torch.dtype, **kwargs: Any) -> LlamaStepModel:
    """LlamaStepModel(dims, dtype, **kwargs) on the meta device: shapes, no values."""
    with torch.device("meta"), _skipping_init():
        return LlamaStepModel(dims, dtype, **kwargs)


def with_weights(dims: ModelDims, dtype: torch.dtype, state: dict[str, torch.Tensor], device,
                 quant: Optional[QuantPlan] = None, reduce: Optional[RankReduce] = None) -> LlamaStepModel:
    """Builds the model on the meta device (no random init) and adopts `state` as its parameters and buffers.

    `reduce`: one tensor-parallel rank's all-reduce (dims, state and plan are then that rank's)."""
    model = meta_step_model(dims, dtype, quant=quant, reduce=reduce)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(dims).to(device)  # non-persistent buffers are not in the state dict
    if model.local_rotary is not None:
        model.local_rotary = Rotary(dims, local=True).to(device)
    return model.eval()


def nonfinite_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """(name, NaN/inf count, numel) of every floating-point tensor with a non-finite value."""
    out = []
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.device.type != "meta" and not _all_finite(tensor):
            out.append((name, int((~torch.isfinite(tensor)).sum()), tensor.numel()))
    return out


def _all_finite(tensor: torch.Tensor) -> bool:
    # numpy, single-threaded: ~300 small torch.isfinite calls each open an OpenMP region, which took
    # 0.4-3.8 s for the int4 SmolLM2's tensors on a busy 2-core machine (numpy: 13 ms)
    if tensor.dtype in (torch.float32, torch.float16, torch.float64):
        return bool(np.isfinite(tensor.detach().cpu().numpy()).all())
    return bool(torch.isfinite(tensor).all())


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                       torch.bool: "BOOL"}


def quant_plan(engine_dir: Path, manifest: Manifest) -> QuantPlan:
    """manifest.quantization.modules as {module: (bits, group_size)}, each checked; raises EngineDirError."""
    from trtpaged.config import GROUP_SIZES

    modules = manifest.quantization.get("modules", {})
    where = engine_dir / MANIFEST_NAME
    if not isinstance(modules, dict):
        raise EngineDirError(where, "quantization.modules", f"expected an object, got {type(modules).__name__}")
    plan = {}
    for name, spec in modules.items():
        ok = (isinstance(spec, list) and len(spec) == 2 and spec[0] in (4, 8)
              and isinstance(spec[1], int) and not isinstance(spec[1], bool) and 0 < spec[1] <= 1 << 20)
        if not ok:
            raise EngineDirError(where, f"quantization.modules[{name!r}]", f"got {spec!r}; expected [bits 4 or 8, "
                                 f"group size such as {', '.join(map(str, GROUP_SIZES))}]")
        plan[name] = (int(spec[0]), int(spec[1]))
    return plan


def check_weights(engine_dir: Path, manifest: Manifest, rank: int = 0) -> dict[str, TensorEntry]:
    """Rank `rank`'s weights file against the model the manifest describes, from the safetensors header only
    (no weights read): every tensor the step model has, of its shape and dtype, and no other. Raises
    EngineDirError naming the file and the tensor."""
    n = manifest.tensor_parallel
    field = "weights_file" if n == 1 else f"shards[{rank}].weights_file"
    rel = manifest.rank_files(rank)["weights_file"]
    path = engine_path(engine_dir, rel, field)
    if not path.is_file():
        raise EngineDirError(path, field, "missing; rebuild the engine")
    header = read_safetensors_header(path, field)
    plan = shard_plan(quant_plan(engine_dir, manifest), manifest.dims, n)
    try:
        model = meta_step_model(shard_dims(manifest.dims, n), TORCH_DTYPES[manifest.dtype], quant=plan)
    except (ValueError, RuntimeError, KeyError) as e:
        raise EngineDirError(engine_dir / MANIFEST_NAME, "dims", f"no step model has these dims ({e})") from None
    expected = model.state_dict()
    for name, tensor in expected.items():
        if name not in header:
            raise EngineDirError(path, name, "missing from the weights, which the manifest's dims and quantization "
                                 "need; rebuild the engine")
        entry, want = header[name], (tuple(tensor.shape), _SAFETENSORS_DTYPES.get(tensor.dtype))
        if (entry.shape, entry.dtype) != want:
            raise EngineDirError(path, name, f"{entry.dtype} {list(entry.shape)} in the weights, the manifest's dims "
                                 f"need {want[1]} {list(want[0])} (dims or weights changed after the build)")
    extra = sorted(set(header) - set(expected))
    if extra:
        raise EngineDirError(path, extra[0], f"a tensor the step model does not have ({len(extra)} such)")
    return header


def checked_weights(engine_dir: Path, manifest: Manifest, rank: int = 0) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights (on the CPU, in the process's own memory) once `check_weights` passed and no float
    tensor holds NaN/inf; raises EngineDirError."""
    from safetensors.torch import load_file

    check_weights(engine_dir, manifest, rank)
    weights = Path(engine_dir) / manifest.rank_files(rank)["weights_file"]
    try:
        mapped = load_file(str(weights), device="cpu")
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error type)
        raise EngineDirError(weights, "weights_file", f"safetensors cannot read it ({type(e).__name__}: {e})") from None
    # copied out of the file's mapping, one tensor at a time: a mapped tensor reads the file for as long as the
    # model runs, so a weights file truncated in place killed the server (SIGBUS) and one rewritten in place
    # changed its answers to weights no check had read
    state = {name: mapped.pop(name).clone() for name in list(mapped)}
    broken = nonfinite_tensors(state)
    if broken:
        name, bad, numel = broken[0]
        raise EngineDirError(weights, name, f"{bad} of its {numel} values are NaN/inf (in {len(broken)} "
                             "tensor(s) in all); the weights are corrupt, rebuild the engine")
    for name, tensor in state.items():
        if name.endswith((".scales", ".offsets")) and tensor.dtype == torch.float32:
            inexact = _not_float16(tensor)
            if inexact is not None:
                raise EngineDirError(weights, name, f"value {inexact:g} is not a float16 value; quantization scales "
                                     "and offsets are float16 values stored as float32 (models/quant.py)")
    return state


def _not_float16(tensor: torch.Tensor) -> Optional[float]:
    """The first value of a float32 tensor that float16 does not hold exactly (None: all of them)."""
    exact = fp16_exact(tensor) == tensor
    return None if bool(exact.all()) else float(tensor[~exact].flatten()[0])


def load_step_model(engine_dir: str | Path, device: str | torch.device = "cpu",
                    reduce: Optional[RankReduce] = None) -> tuple[LlamaStepModel, Manifest]:
    """Reads `trtpaged.json` and the weights file of an engine dir; returns (eager step model, manifest).

    The weights are checked before use: names, shapes and dtypes against the manifest's dims (from the
    header, before any tensor is read), then every float tensor for NaN/inf. Raises EngineDirError.
    A tensor-parallel engine (manifest.tensor_parallel > 1) needs `reduce`, whose rank picks the shard.
    On a CUDA device, a head_dim the CUDA kernels lack is a ValueError here, not a failed first step."""
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    head_dim = manifest.dims.head_dim
    if torch.device(device).type == "cuda" and head_dim not in CUDA_HEAD_DIMS:
        raise ValueError(f"head_dim: {engine_dir} has head_dim {head_dim}; the CUDA kernels support "
                         f"{', '.join(map(str, CUDA_HEAD_DIMS))}; run it on the CPU (--device cpu, or device=\"cpu\")")
    n = manifest.tensor_parallel
    if (reduce.world_size if reduce is not None else 1) != n:
        got = reduce.world_size if reduce is not None else 1
        raise ValueError(f"tensor_parallel: {engine_dir} is split over {n} ranks; got {got} "
                         f"(use LLM(..., tensor_parallel={n}) or serve --tensor-parallel-size {n})")
    rank = reduce.rank if reduce is not None else 0
    state = checked_weights(engine_dir, manifest, rank)
    state = {k: v.to(device) for k, v in state.items()} if str(device) != "cpu" else state
    plan = shard_plan(quant_plan(engine_dir, manifest), manifest.dims, n)
    model = with_weights(shard_dims(manifest.dims, n), TORCH_DTYPES[manifest.dtype], state, device, plan,
                         reduce if n > 1 else None)
    if plan:
        set_activations(model, manifest.quantization.get("activations", "int8"))
        if torch.device(device).type == "cuda":  # weights stay quantized on the GPU (models/qlinear_cuda.py)
            from trtpaged.models.qlinear import prepare_cuda

            prepare_cuda(model)
    return model, manifest
