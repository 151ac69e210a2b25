"""Weight-only quantized linears on a CUDA device (models/qlinear_cuda.py) against the de-quantized reference.

The GPU tests (marked gpu) run where CUDA is, and skip with the reason elsewhere: int4 through
torch._weight_int4pack_mm within bf16 rounding of F.linear on the de-quantized weight (float64), int8
de-quantized per call, the engine loaded on the GPU with its weights still quantized there. On the CPU:
the per-call de-quantizing op's math, the int4 kernel's shape rules and the byte count `inspect` shows.
"""

from __future__ import annotations

import pytest
import torch

from trtpaged.models.qlinear import QuantizedLinear
from trtpaged.models.qlinear_cuda import DequantizingOp, cuda_weight_bytes, int4_kernel_reason
from trtpaged.models.quant import quantize

NO_CUDA = not torch.cuda.is_available()
gpu = pytest.mark.skipif(NO_CUDA, reason="no CUDA device: the GPU path of the quantized linears cannot run here")


def _reference(x: torch.Tensor, weight, bias) -> torch.Tensor:
    w = weight.dequantize(torch.float64)
    return torch.nn.functional.linear(x.double(), w.to(x.device), None if bias is None else bias.double().to(x.device))


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, None), (8, 32)])
def test_dequantizing_op_is_the_dequantized_linear(bits, group):
    torch.manual_seed(0)
    weight = quantize(torch.randn(48, 256) * 0.05, bits, group)
    bias = torch.randn(48)
    op = DequantizingOp(weight, bias, torch.device("cpu"), torch.float32)
    x = torch.randn(5, 256)
    assert float((op(x).double() - _reference(x, weight, bias)).abs().max()) <= 1e-4
    assert op.codes is weight.codes  # the codes are the module's, still quantized (no float copy kept)


def test_int4_kernel_takes_groups_and_shapes_it_has():
    def w(n, k, g):
        return quantize(torch.randn(n, k) * 0.05, 4, g)

    have = hasattr(torch, "_weight_int4pack_mm")
    for g in (32, 64, 128):
        assert int4_kernel_reason(w(64, 256, g)) == (None if have else "this torch has no _weight_int4pack_mm")
    if have:
        assert "out_features 44" in int4_kernel_reason(w(44, 256, 32))


def test_cuda_weight_bytes_fold_int4_offsets_into_bf16_pairs(tmp_path):
    from safetensors.torch import save_file

    from trtpaged.engine_files import read_safetensors_header

    w4 = quantize(torch.randn(64, 256) * 0.05, 4, 32)
    w8 = quantize(torch.randn(320, 256) * 0.05, 8, 32)
    tensors = {"q.codes": w4.codes, "q.scales": w4.scales, "q.offsets": w4.offsets, "norm.weight": torch.ones(256),
               "embed_tokens.head.codes": w8.codes, "embed_tokens.head.scales": w8.scales}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    header = read_safetensors_header(tmp_path / "w.safetensors")
    got = cuda_weight_bytes(header, {"q": (4, 32), "embed_tokens": (8, 32)})
    want = 64 * 128 + 64 * 8 * 2 * 2 + 256 * 4 + 320 * 256 + 320 * 8 * 4
    assert got == want


# --- on a GPU -----------------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 64])
def test_int4_on_cuda_uses_torch_int4_gemm_within_bf16_of_the_reference(group, rows):
    from trtpaged.models.qlinear_cuda import Int4TinyGemmOp

    torch.manual_seed(group + rows)
    weight = quantize(torch.randn(512, 1024) * 0.05, 4, group)
    bias = torch.randn(512)
    linear = QuantizedLinear.from_weight(weight, bias, torch.float16).cuda()
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.float16)
    y = linear(x)
    assert isinstance(linear.cuda_op, Int4TinyGemmOp), linear.cuda_op.reason
    assert linear.codes.device.type == "cpu"  # the engine layout left the device; the packed copy is there
    want = _reference(x, weight, bias)
    err = float((y.double() - want).abs().max())
    assert err <= 2e-2 * float(want.abs().max()), err  # bf16 x, scales and zeros: ~2^-8 relative per term


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("group", [None, 32])
def test_int8_on_cuda_keeps_int8_codes_on_the_device(group):
    torch.manual_seed(3)
    weight = quantize(torch.randn(384, 512) * 0.05, 8, group)
    linear = QuantizedLinear.from_weight(weight, None, torch.float16).cuda()
    x = torch.randn(64, 512, device="cuda", dtype=torch.float16)
    y = linear(x)
    assert linear.codes.is_cuda and linear.codes.dtype == torch.int8 and linear._dense is None
    want = _reference(x, weight, None)
    assert float((y.double() - want).abs().max()) <= 1e-2 * float(want.abs().max())


@gpu
@pytest.mark.gpu
def test_quantized_engine_on_cuda_holds_quantized_weights_and_matches_the_cpu_logits(tmp_path):
    """A tiny int4 engine loaded on the GPU: device weight bytes well under the float model's, logits as the CPU
    engine's (the exact layout) within bf16 rounding."""
    from tests.conftest import TINY_KV4
    from trtpaged.builder import build_engine
    from trtpaged.config import parse_config
    from trtpaged.models import load_step_model
    from trtpaged.models.qlinear import prepare_cuda

    # No build verification: its int4 accuracy gate (80% top-1 against the float model) is for real models;
    # this random tiny model's logits are too close for it (63% on an H200). The test compares logits itself.
    tiny = {**TINY_KV4["model"]["tiny"], "num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 64 (CUDA)
    engine = tmp_path / "e"
    build_engine(parse_config({**TINY_KV4, "model": {"tiny": tiny}, "dtype": "float16",
                               "quantization": {"weights": "int4", "group_size": 32, "lm_head": "int8"}}),
                 engine, skip_verify=True, echo=lambda _line: None)
    gpu_model, manifest = load_step_model(engine, device="cuda")
    cpu_model, _ = load_step_model(engine, device="cpu")
    d = manifest.dims
    float_bytes = 2 * (d.vocab_size * d.hidden_size + d.num_layers * d.hidden_size *
                       (d.hidden_size * 2 + 2 * d.num_kv_heads * d.head_dim + 3 * d.intermediate_size))
    assert prepare_cuda(gpu_model) < 0.5 * float_bytes
    n = 11
    i32 = torch.int32
    args = (torch.arange(5, 5 + n, dtype=i32), torch.arange(n, dtype=i32), torch.tensor([0, n], dtype=i32),
            torch.tensor([n], dtype=i32), torch.tensor([[0]], dtype=i32), torch.arange(n, dtype=i32))
    with torch.inference_mode():
        pool_gpu = gpu_model.new_kv_cache(4, 16, None, device="cuda")
        pool_cpu = cpu_model.new_kv_cache(4, 16, None)
        got, _ = gpu_model(*(a.cuda() for a in args), pool_gpu)
        want, _ = cpu_model(*args, pool_cpu)
    scale = float(want.abs().max())
    assert float((got.float().cpu() - want.float()).abs().max()) <= 5e-2 * scale
