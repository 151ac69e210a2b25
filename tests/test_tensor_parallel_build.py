"""Tensor parallelism at build time: tensor_parallel validation, weight shards, rank graphs and their joint
verification."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_KV4
from trtpaged.builder import build_engine
from trtpaged.builder.onnx_allreduce import OP_TYPE as ALLREDUCE
from trtpaged.builder.onnx_allreduce import register_schema
from trtpaged.builder.onnx_node import DOMAIN
from trtpaged.builder.verify import VerificationError, verify_onnx
from trtpaged.config import ConfigError, parse_config
from trtpaged.manifest import ModelDims, read_manifest
from trtpaged.models.quant import QuantizedWeight, quantize
from trtpaged.models.tensor_parallel import check_tensor_parallel, shard_dims, shard_plan, shard_state

DIMS = ModelDims(architecture="LlamaForCausalLM", num_layers=1, hidden_size=128, intermediate_size=256, num_heads=8,
                 num_kv_heads=4, head_dim=16, vocab_size=320, rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.mark.parametrize("value", [0, -2, "2", True, 1.5])
def test_bad_tensor_parallel_names_the_key(value):
    with pytest.raises(ConfigError, match="tensor_parallel: got .*expected a positive integer"):
        parse_config({**TINY_KV4, "tensor_parallel": value})


def test_tensor_parallel_defaults_to_one():
    assert parse_config(TINY_KV4).tensor_parallel == 1
    assert parse_config({**TINY_KV4, "tensor_parallel": 4}).tensor_parallel == 4


@pytest.mark.parametrize("n, dims, name", [
    (3, DIMS, "num_attention_heads 8"),
    (8, DIMS, "num_key_value_heads 4"),
    (4, ModelDims(**{**DIMS.__dict__, "intermediate_size": 130}), "intermediate_size 130"),
])
def test_refuses_n_that_does_not_divide_naming_which(n, dims, name):
    reason = check_tensor_parallel(dims, n)
    assert reason.startswith(f"tensor_parallel: {n} does not divide") and name in reason


def test_refuses_row_parallel_split_off_the_group_boundaries():
    # o_proj has 8 * 16 = 128 inputs: 32 per rank of 4, which a group of 64 does not divide
    plan = {"layers.0.self_attn.o_proj": (4, 64), "layers.0.mlp.down_proj": (4, 64)}
    reason = check_tensor_parallel(DIMS, 4, plan)
    assert reason.startswith("quantization.group_size: 64") and "o_proj" in reason and "= 32" in reason
    assert check_tensor_parallel(DIMS, 2, {"layers.0.self_attn.o_proj": (4, 32)}) is None
    assert check_tensor_parallel(DIMS, 4, {"layers.0.self_attn.o_proj": (8, 128)}) is None  # per channel: any split
    wide = ModelDims(**{**DIMS.__dict__, "intermediate_size": 192})  # 48 down_proj inputs per rank of 4
    assert "need a multiple of 32" in check_tensor_parallel(wide, 4, {"layers.0.mlp.down_proj": (8, 192)})


def test_build_refuses_at_load_naming_the_limit(tmp_path):
    with pytest.raises(ConfigError, match="tensor_parallel: 3 does not divide the model's num_attention_heads 8"):
        build_engine(parse_config({**TINY_KV4, "tensor_parallel": 3}), tmp_path / "e", echo=lambda _: None)
    int4 = {**TINY_KV4, "tensor_parallel": 4, "quantization": {"weights": "int4", "group_size": 64}}
    with pytest.raises(ConfigError, match="quantization.group_size: 64 does not divide"):
        build_engine(parse_config(int4), tmp_path / "e", echo=lambda _: None)
    assert not (tmp_path / "e").exists()


def _full_state(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, kv, h, i = DIMS.num_heads * 16, DIMS.num_kv_heads * 16, DIMS.hidden_size, DIMS.intermediate_size
    shapes = {"layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, h), "layers.0.self_attn.qkv_proj.bias": (q + 2 * kv,),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.self_attn.o_proj.bias": (h,),
              "layers.0.mlp.gate_up_proj.weight": (2 * i, h), "layers.0.mlp.down_proj.weight": (h, i),
              "norm.weight": (h,), "embed_tokens.weight": (DIMS.vocab_size, h)}
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("n", [2, 4])
def test_float_shards_recompose_the_layers(n):
    """Sum over ranks of each rank's partial output == the whole layer (the plain math as truth)."""
    full = _full_state(dtype=torch.float64)  # float64: the sums' order does not show
    shards = [shard_state(full, DIMS, n, r) for r in range(n)]
    x = torch.randn(5, DIMS.hidden_size, dtype=torch.float64)
    # MLP: down(silu(gate x) * up x)
    gate, up = F.linear(x, full["layers.0.mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
    want = F.linear(F.silu(gate) * up, full["layers.0.mlp.down_proj.weight"])
    got = 0
    for s in shards:
        g_, u_ = F.linear(x, s["layers.0.mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
        got = got + F.linear(F.silu(g_) * u_, s["layers.0.mlp.down_proj.weight"])
    torch.testing.assert_close(got, want)
    # q/k/v: rank r's heads are the whole projection's heads [r*H/n, (r+1)*H/n) and KV heads likewise
    d = shard_dims(DIMS, n)
    qkv = F.linear(x, full["layers.0.self_attn.qkv_proj.weight"], full["layers.0.self_attn.qkv_proj.bias"])
    q, k, v = qkv.split((128, 64, 64), dim=-1)
    for r, s in enumerate(shards):
        qr, kr, vr = F.linear(x, s["layers.0.self_attn.qkv_proj.weight"], s["layers.0.self_attn.qkv_proj.bias"]).split(
            (d.num_heads * 16, d.num_kv_heads * 16, d.num_kv_heads * 16), dim=-1)
        torch.testing.assert_close(qr, q.view(5, 8, 16)[:, r * d.num_heads:(r + 1) * d.num_heads].reshape(5, -1))
        torch.testing.assert_close(kr, k.view(5, 4, 16)[:, r * d.num_kv_heads:(r + 1) * d.num_kv_heads].reshape(5, -1))
        torch.testing.assert_close(vr, v.view(5, 4, 16)[:, r * d.num_kv_heads:(r + 1) * d.num_kv_heads].reshape(5, -1))
    # o_proj: input rows split, bias added once
    attn = torch.randn(5, 128, dtype=torch.float64)
    want = F.linear(attn, full["layers.0.self_attn.o_proj.weight"], full["layers.0.self_attn.o_proj.bias"])
    got = sum(F.linear(a, s["layers.0.self_attn.o_proj.weight"], s["layers.0.self_attn.o_proj.bias"])
              for a, s in zip(attn.chunk(n, dim=-1), shards))
    torch.testing.assert_close(got, want)
    for s in shards:  # replicated
        assert torch.equal(s["embed_tokens.weight"], full["embed_tokens.weight"])


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 32), (8, None)])
def test_quantized_shards_dequantize_to_the_slices(bits, group):
    full = _full_state(1)
    state, plan = dict(full), {}
    for module in ("layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj",
                   "layers.0.mlp.down_proj"):
        w = quantize(state.pop(f"{module}.weight"), bits, group)
        state[f"{module}.codes"], state[f"{module}.scales"] = w.codes, w.scales
        if w.offsets is not None:
            state[f"{module}.offsets"] = w.offsets
        plan[module] = (bits, w.group_size)
        full[f"{module}.weight"] = w.dequantize()  # the de-quantized whole weight is the truth
    n = 2
    assert check_tensor_parallel(DIMS, n, plan) is None
    for r in range(n):
        s, p = shard_state(state, DIMS, n, r, plan), shard_plan(plan, DIMS, n)
        floats = shard_state({k: v for k, v in full.items() if k.endswith(("weight", "bias"))}, DIMS, n, r)
        for module, (b, g) in p.items():
            w = QuantizedWeight(b, g, s[f"{module}.codes"], s[f"{module}.scales"], s.get(f"{module}.offsets"))
            assert torch.equal(w.dequantize(), floats[f"{module}.weight"]), module


def test_engine_dir_has_one_shard_and_graph_per_rank(tiny_kv4_engines):
    engine = tiny_kv4_engines[2]
    m = read_manifest(engine)
    assert m.tensor_parallel == 2 and [s["weights_file"] for s in m.shards] == [
        "weights-rank0.safetensors", "weights-rank1.safetensors"]
    assert m.weights_file == "weights-rank0.safetensors" and m.onnx_file == "model-rank0.onnx"
    assert {s["onnx_file"] for s in m.shards} | {s["weights_file"] for s in m.shards} <= set(m.files)
    raw = json.loads((engine / "trtpaged.json").read_text())
    whole = read_manifest(tiny_kv4_engines[1])
    assert raw["kv_bytes_per_token"] == whole.kv_bytes_per_token
    assert raw["kv_bytes_per_token_per_rank"] == whole.kv_bytes_per_token // 2
    v = m.verification
    assert v["max_abs_diff"] <= v["tolerance"] and v["rows"] > 0


def test_rank_graphs_carry_the_all_reduce_and_pass_the_checker(tiny_kv4_engines):
    register_schema()
    m = read_manifest(tiny_kv4_engines[2])
    for rank, files in enumerate(m.shards):
        path = str(tiny_kv4_engines[2] / files["onnx_file"])
        onnx.checker.check_model(path, full_check=True)  # the path form: external data resolved next to it
        model = onnx.load(path, load_external_data=False)
        nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == ALLREDUCE]
        assert len(nodes) == 2 * m.dims.num_layers
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
        assert attrs["rank"] == rank and attrs["world_size"] == 2 and attrs["plugin_namespace"] == b"trtpaged"
        kv = next(i for i in model.graph.input if i.name == "kv_cache")
        assert kv.type.tensor_type.shape.dim[3].dim_value == m.dims.num_kv_heads // 2  # this rank's KV heads


def test_joint_verification_fails_without_a_ranks_share(tiny_kv4_engines, tmp_path):
    """Rank 1's weights zeroed (its heads and MLP columns contribute nothing): the joint run must fail."""
    import shutil
    import struct

    from runtime_helpers import hf_from_engine_dir

    engine = tmp_path / "engine"
    shutil.copytree(tiny_kv4_engines[2], engine)
    m = read_manifest(engine)
    hf = hf_from_engine_dir(engine)
    paths = [engine / s["onnx_file"] for s in m.shards]
    assert verify_onnx(paths, hf.model, m.dims.vocab_size, 16, "float32", "float32").max_abs_diff < 1e-3
    weights = engine / m.shards[1]["weights_file"]
    data = bytearray(weights.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start:] = bytes(len(data) - start)
    weights.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="verification failed"):
        verify_onnx(paths, hf.model, m.dims.vocab_size, 16, "float32", "float32")


def test_inspect_shows_kv_bytes_per_rank(tiny_kv4_engines):
    from click.testing import CliRunner

    from trtpaged.cli import main

    whole = read_manifest(tiny_kv4_engines[1]).kv_bytes_per_token
    out = CliRunner().invoke(main, ["inspect", str(tiny_kv4_engines[2])])
    assert out.exit_code == 0, out.output
    assert f"KV bytes per token:   {whole:,} in all, {whole // 2:,} per rank (total / 2)" in out.output
    assert "tensor_parallel 2: per rank 4 heads (kv 2), intermediate 128" in out.output


def test_bench_memory_shows_n_ranks_with_n_times_the_memory(tiny_kv4_engines):
    from click.testing import CliRunner

    from trtpaged.cli import main

    out = CliRunner().invoke(main, ["bench", "memory", str(tiny_kv4_engines[2]), "--num-requests", "40",
                                    "--prompt-len", "32:200", "--output-len", "16:64", "--max-batch-size", "64",
                                    "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["tensor_parallel"]
    # the engine's 128 blocks per rank are one device's memory: 64 one-rank blocks
    assert [(r["ranks"], r["num_kv_blocks"]) for r in rows] == [(1, 64), (2, 128)]
    assert rows[1]["peak_running"] > rows[0]["peak_running"]
