"""Weight-only quantization: stored format, GGUF blocks carried exactly, config errors, quantized builds.

Independent truths: gguf-py's own de-quantizer for GGUF blocks; transformers'
GGUF loader for SmolLM2's weights; HF's forward with the same de-quantized
weights for the built engine; onnx.checker and onnx.reference for the graph.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml

from trtpaged.config import ConfigError, QuantizationConfig, parse_config
from trtpaged.models.quant import (
    QuantizedWeight,
    concat_rows,
    from_gguf_blocks,
    pack_int4,
    quantize,
    unpack_int4,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_int4_packing_is_onnx_order_and_round_trips():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 32)
    assert int(packed[2, 3]) == int(q[2, 6]) | (int(q[2, 7]) << 4)  # even element in the low nibble
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (4, 32), (4, 64), (4, 128)])
def test_quantize_error_within_half_a_step_and_scales_fp16_exact(bits, group):
    torch.manual_seed(0)
    w = torch.randn(24, 256) * 0.05
    w[3, 10] = 0.9  # an outlier widens only its own group (or row)
    qw = quantize(w, bits, group)
    g = qw.group_size
    assert g == (256 if group is None else group)
    assert torch.equal(qw.scales, qw.scales.half().float())
    if qw.offsets is not None:
        assert torch.equal(qw.offsets, qw.offsets.half().float())
    step = qw.scales.repeat_interleave(g, dim=1)
    err = (qw.dequantize(torch.float64) - w.double()).abs()
    # round-to-nearest: half a step, plus the fp16 rounding of the offset for int4
    slack = 0.5 * step.double() + (1e-3 * w.abs().max() if bits == 4 else 0)
    assert bool((err <= slack + 1e-7).all())
    codes = qw.int_codes()
    assert int(codes.min()) >= (0 if bits == 4 else -127) and int(codes.max()) <= (15 if bits == 4 else 127)


def test_int4_constant_group_is_exact():
    w = torch.full((2, 32), 0.3)  # the minimum (fp16) is the value, every code 0
    w = w.half().float()
    assert torch.equal(quantize(w, 4, 32).dequantize(), w)


def test_concat_rows_stacks_outputs():
    a, b = quantize(torch.randn(4, 64), 4, 32), quantize(torch.randn(6, 64), 4, 32)
    both = concat_rows([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="differ"):
        concat_rows([a, quantize(torch.randn(4, 64), 4, 64)])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_exactly_as_gguf_py(type_name):
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    w = np.random.default_rng(1).normal(0, 0.05, (7, 96)).astype(np.float32)
    raw = quants.quantize(w, qtype)
    truth = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
    weight = from_gguf_blocks(type_name, raw, 96)
    assert weight.group_size == 32 and weight.bits == (8 if type_name == "Q8_0" else 4)
    assert torch.equal(weight.dequantize(), truth)  # bit-exact: no second rounding


def test_a_q4_0_block_whose_offset_float16_cannot_hold_is_refused_at_build():
    """Q4_0 stores w = d * (q - 8): the kernels keep the offset -8d in float16, so a block with |d| > 8188 (weights
    near 1e5; gguf-py writes them) built an engine that every load refused."""
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(2).normal(0, 0.05, (3, 64)).astype(np.float32)
    w[1, 40] = 8300.0 * 8  # its block's |d| = max|w| / 8 (gguf's Q4_0): past the bound
    raw = quants.quantize(w, GGMLQuantizationType.Q4_0)
    with pytest.raises(ValueError, match="offset -8d past float16's range"):
        from_gguf_blocks("Q4_0", raw, 64)
    w[1, 40] = 8000.0 * 8  # inside: carried exactly as before
    raw = quants.quantize(w, GGMLQuantizationType.Q4_0)
    truth = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_0).astype(np.float32))
    assert torch.equal(from_gguf_blocks("Q4_0", raw, 64).dequantize(), truth)


def test_gguf_other_types_are_refused():
    with pytest.raises(ValueError, match="cannot be carried exactly"):
        from_gguf_blocks("Q6_K", np.zeros((1, 210), np.uint8), 256)


@pytest.mark.parametrize("spec,match", [
    ({"weights": "int3"}, "quantization.weights: got 'int3'"),
    ({"weights": "int4", "group_size": 48}, "quantization.group_size: got 48"),
    ({"weights": "int4", "group_size": None}, "quantization.group_size: int4 needs a group size"),
    ({"weight": "int4"}, "quantization.weight: unknown key; did you mean 'quantization.weights'"),
    ({"weights": "int8", "lm_head": "int4"}, "quantization.lm_head: got 'int4'"),
    ({"weights": "int4", "activations": "int4"}, "quantization.activations: got 'int4'"),
    ("int4", "quantization: got 'int4'"),
])
def test_bad_quantization_values_name_the_key(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"model": {"tiny": {}}, "quantization": spec})


def test_quantization_defaults():
    assert not parse_config({"model": {"tiny": {}}}).quantization.enabled
    assert parse_config({"model": {"tiny": {}}, "quantization": {"weights": "int4"}}).quantization == \
        QuantizationConfig("int4", 32, "int8", "float")
    assert parse_config({"model": {"tiny": {}}, "quantization": {"weights": "int8"}}).quantization.group_size is None


def _tiny_yaml(tmp_path: Path, quantization: dict, tensorrt: dict | None = None, **tiny) -> Path:
    data = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    data["model"]["tiny"].update(tiny)
    data["quantization"] = quantization
    if tensorrt:
        data["tensorrt"] = tensorrt
    data.pop("output")
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_build_refuses_dims_the_group_does_not_divide(tmp_path):
    from trtpaged.builder import build_engine
    from trtpaged.config import load_config

    path = _tiny_yaml(tmp_path, {"weights": "int4", "group_size": 64}, hidden_size=96, num_attention_heads=6,
                      num_key_value_heads=2)
    with pytest.raises(ConfigError, match="quantization.group_size: the model's hidden_size 96"):
        build_engine(load_config(path), tmp_path / "eng", echo=lambda s: None)
    assert not (tmp_path / "eng").exists()


@pytest.fixture(scope="module")
def tiny_int8_engine(tmp_path_factory) -> Path:
    from trtpaged.builder import build_engine
    from trtpaged.config import load_config

    tmp = tmp_path_factory.mktemp("q8")
    out = tmp / "eng"
    # backend torch: no compile stage; tensorrt.graph: always writes (and measures) the TensorRT graph anyway
    build_engine(load_config(_tiny_yaml(tmp, {"weights": "int8", "group_size": 32}, {"graph": "always"})), out,
                 echo=lambda s: None)
    return out


def test_a_quantized_build_without_a_compile_stage_writes_no_tensorrt_graph(tmp_path):
    """tensorrt.graph: auto (the default) where nothing compiles (backend torch here): weights.safetensors only,
    no model.onnx or model-tensorrt.safetensors, no graph accuracy; the torch engine's accuracy still measured."""
    from trtpaged.builder import build_engine
    from trtpaged.config import load_config

    lines: list[str] = []
    result = build_engine(load_config(_tiny_yaml(tmp_path, {"weights": "int8", "group_size": 32})), tmp_path / "e",
                          echo=lines.append)
    m = result.manifest
    names = {p.name for p in (tmp_path / "e").iterdir()}
    assert "weights.safetensors" in names and not names & {"model.onnx", "model-tensorrt.safetensors"}
    assert m.onnx_file is None and m.tensorrt["graph_written"] is False and m.tensorrt["graph"] == "auto"
    assert m.verification["skipped"] and "tensorrt_graph" not in m.verification["accuracy"]
    assert m.verification["accuracy"]["full_precision_activations"]["positions"] > 0
    assert any("no ONNX graph" in line and "backend: torch" in line for line in lines)


def test_quantized_graph_uses_dequantize_linear(tiny_int8_engine):
    """The TensorRT graph: int8 group 32 re-quantized per channel (1-D scales), DequantizeLinear -> MatMul,
    the embedding a float table (builder/tensorrt_graph.py; rules in tests/test_tensorrt_conformance.py)."""
    from trtpaged.builder.tensorrt_rules import check_graph

    onnx.checker.check_model(str(tiny_int8_engine / "model.onnx"), full_check=True)
    model = onnx.load(str(tiny_int8_engine / "model.onnx"), load_external_data=False)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    # per layer: qkv, o, gate_up, down; plus the LM head (the embedding is a float table)
    assert len(dq) == 2 * 4 + 1
    assert all(n.domain == "" for n in dq)
    assert {o.domain: o.version for o in model.opset_import}[""] >= 21
    inits = {i.name: i for i in model.graph.initializer}
    codes = [i for name, i in inits.items() if name.endswith(".tensorrt_codes")]
    assert codes and all(i.data_type == onnx.TensorProto.INT8 for i in codes)
    assert all(len(inits[n.input[1]].dims) == 1 for n in dq)
    floats = [name for name, i in inits.items()
              if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2 and i.dims[0] * i.dims[1] > 4096]
    assert floats == ["embed_tokens.weight"], "a float weight matrix survived quantization"
    assert check_graph(tiny_int8_engine / "model.onnx") == []


def test_quantized_engine_manifest_and_weights(tiny_int8_engine):
    from trtpaged.manifest import read_manifest

    m = read_manifest(tiny_int8_engine)
    q = m.quantization
    assert q["weights"] == "int8" and q["group_size"] == 32
    assert q["modules"]["layers.0.self_attn.qkv_proj"] == [8, 32]
    assert q["modules"]["embed_tokens"][0] == 8 and "lm_head" in q["modules"]
    v = m.verification
    assert v["max_abs_diff"] <= v["tolerance"]
    assert v["accuracy"]["full_precision_activations"]["positions"] > 0
    # int8 group 32 has no TensorRT form: the graph's per-channel re-quantization was measured too
    graph = v["accuracy"]["tensorrt_graph"]
    assert graph["positions"] == v["accuracy"]["full_precision_activations"]["positions"]
    assert graph["agreement_away_from_ties"] >= 0.95 and graph["max_abs_diff"] > 0


def test_quantized_engine_logits_match_hf_with_the_same_weights(tiny_int8_engine):
    """The runtime's step (eager, the torch backend) against HF's forward on the de-quantized weights."""
    from trtpaged.builder.quantize import QuantizedState, dequantized_hf_model
    from trtpaged.manifest import read_manifest
    from trtpaged.models import load_hf, load_step_model, spec_from_manifest

    manifest = read_manifest(tiny_int8_engine)
    model, _ = load_step_model(tiny_int8_engine)
    hf = load_hf(spec_from_manifest(manifest)).model
    plan = {k: tuple(v) for k, v in manifest.quantization["modules"].items()}
    state = {k: v for k, v in model.state_dict().items()}
    ref = dequantized_hf_model(hf, manifest.dims, QuantizedState(state, plan, {k: "q" for k in plan}))
    assert ref is not hf
    tokens = [5, 17, 200, 33, 9, 120, 64, 3, 250, 77, 18]
    n = len(tokens)
    i32 = torch.int32
    with torch.inference_mode():
        got, _ = model(torch.tensor(tokens, dtype=i32), torch.arange(n, dtype=i32), torch.tensor([0, n], dtype=i32),
                       torch.tensor([n], dtype=i32), torch.tensor([[0]], dtype=i32), torch.arange(n, dtype=i32),
                       model.new_kv_cache(1, 16))
        want = ref(torch.tensor([tokens])).logits[0]
        unquantized = hf(torch.tensor([tokens])).logits[0]
    scale = float(want.abs().max())
    assert manifest.quantization["activations"] == "float"  # the default: weight-only proper
    assert float((got - want).abs().max()) <= 1e-4 * scale
    # int8 activations (per 32 inputs) add at most a few percent of the logit range, measurably more
    from trtpaged.models.qlinear import set_activations

    set_activations(model, "int8")
    with torch.inference_mode():
        got8, _ = model(torch.tensor(tokens, dtype=i32), torch.arange(n, dtype=i32), torch.tensor([0, n], dtype=i32),
                        torch.tensor([n], dtype=i32), torch.tensor([[0]], dtype=i32), torch.arange(n, dtype=i32),
                        model.new_kv_cache(1, 16))
    err8 = float((got8 - want).abs().max())
    assert float((got - want).abs().max()) < err8 <= 0.02 * scale
    # and the checks can fail: the unquantized model's logits are measurably elsewhere
    assert float((unquantized - want).abs().max()) > err8 / 10


@pytest.mark.slow
def test_smollm2_gguf_blocks_are_the_weights_transformers_loads():
    """Every Q4_1 / Q8_0 tensor of the SmolLM2 GGUF, de-quantized from the carried codes, equals HF's weight."""
    from trtpaged.builder.quantize import read_gguf_exact
    from trtpaged.config import load_config
    from runtime_helpers import shared_hf
    from trtpaged.models import dims_from_hf_config

    cfg = load_config(EXAMPLES / "smollm2-int4.yaml")
    hf = shared_hf(cfg.model)
    dims = dims_from_hf_config(hf.config, 2048)
    carried = read_gguf_exact(cfg.model.path, dims, hf.config.model_type)
    weights = {k.removeprefix("model."): v for k, v in hf.model.state_dict().items()}
    assert len(carried) == 7 * dims.num_layers + 1
    for module, (type_name, weight) in carried.items():
        assert torch.equal(weight.dequantize(), weights[f"{module}.weight"]), (module, type_name)
    # q/k rows are un-permuted as transformers does: a wrong order would not be equal
    q = carried["layers.0.self_attn.q_proj"][1]
    assert not torch.equal(QuantizedWeight(4, 32, q.codes.flip(0), q.scales.flip(0), q.offsets.flip(0)).dequantize(),
                           weights["layers.0.self_attn.q_proj.weight"])


@pytest.mark.slow
def test_smollm2_int4_engine_matches_hf_gguf_model(smollm2_int4_engine_dir):
    """The int4 engine built from the GGUF's own blocks, on the CPU kernels with float activations (the
    default): its greedy output is HF's (the GGUF model transformers loads) token for token; its build
    recorded the accuracy figures."""
    from trtpaged import LLM, SamplingParams
    from trtpaged.manifest import read_manifest
    from runtime_helpers import shared_hf
    from trtpaged.models import spec_from_manifest

    manifest = read_manifest(smollm2_int4_engine_dir)
    q = manifest.quantization
    assert q["origin"] == {"gguf Q4_1 exact": 120, "gguf Q8_0 exact": 1}
    accuracy = manifest.verification["accuracy"]
    assert accuracy["scheme"] == "exact"
    assert accuracy["full_precision_activations"]["agreement"] == 1.0
    assert accuracy["torch_backend"]["activations"] == "float" and accuracy["torch_backend"]["agreement"] == 1.0
    # no TensorRT here, so no TensorRT graph was written and the graph verification is skipped; the engine that
    # runs (the torch backend, the exact layout) was measured against HF above
    assert manifest.onnx_file is None and manifest.verification["skipped"]

    hf = shared_hf(spec_from_manifest(manifest))
    llm = LLM(smollm2_int4_engine_dir)
    conversation = [{"role": "user", "content": "Explain how a transformer neural network works."}]
    ids = hf.tokenizer.encode(hf.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                               add_generation_prompt=True))
    with torch.inference_mode():
        ref = hf.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=48, min_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref


def test_inspect_shows_the_weight_bytes_on_a_cuda_gpu(tiny_int8_engine):
    """`trtpaged inspect` names what the torch backend holds on a CUDA GPU, counted from the weights' header."""
    from click.testing import CliRunner

    from trtpaged.cli import main
    from trtpaged.engine_files import read_safetensors_header
    from trtpaged.manifest import read_manifest
    from trtpaged.memory_plan import format_bytes
    from trtpaged.models.loading import quant_plan
    from trtpaged.models.qlinear_cuda import cuda_weight_bytes

    r = CliRunner().invoke(main, ["inspect", str(tiny_int8_engine)])
    assert r.exit_code == 0, r.output
    m = read_manifest(tiny_int8_engine)
    header = read_safetensors_header(tiny_int8_engine / m.weights_file)
    want = cuda_weight_bytes(header, quant_plan(tiny_int8_engine, m))
    assert f"weights on a CUDA GPU (torch backend, still quantized): {format_bytes(want)}" in r.output
    assert want == (tiny_int8_engine / m.weights_file).stat().st_size - 8 - int.from_bytes(
        (tiny_int8_engine / m.weights_file).read_bytes()[:8], "little")  # int8: every tensor as stored


def test_phi3_gguf_fused_blocks_are_carried_exactly(tmp_path):
    """A Phi-3 GGUF holds q/k/v fused (attn_qkv) and gate/up fused (ffn_up), as Phi-3's checkpoints do: their Q4_0
    blocks are carried bit for bit, each equal to the weight transformers loads from the file (was: re-quantized
    from the de-quantized floats), and the build's engine records them so."""
    from click.testing import CliRunner

    from gguf_writer import write_phi3_gguf
    from trtpaged.builder.quantize import read_gguf_exact
    from trtpaged.cli import main
    from trtpaged.config import ModelSpec
    from trtpaged.manifest import read_manifest
    from trtpaged.models import dims_from_hf_config, load_hf

    path = write_phi3_gguf(tmp_path / "phi3.gguf")
    hf = load_hf(ModelSpec(kind="gguf", path=path))
    dims = dims_from_hf_config(hf.config, 256)
    carried = read_gguf_exact(path, dims, hf.config.model_type)
    weights = {k.removeprefix("model."): v for k, v in hf.model.state_dict().items()}
    for layer in range(dims.num_layers):
        for module in ("self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj", "mlp.down_proj"):
            type_name, weight = carried[f"layers.{layer}.{module}"]
            assert type_name == "Q4_0" and torch.equal(weight.dequantize(), weights[f"layers.{layer}.{module}.weight"])
    data = {"model": {"gguf": str(path)}, "max_seq_len": 256, "kv_cache": {"num_kv_blocks": 32}, "backend": "torch",
            "quantization": {"weights": "int4", "group_size": 32, "lm_head": "int8"}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    r = CliRunner().invoke(main, ["build", str(tmp_path / "m.yaml"), "-o", str(tmp_path / "engine")])
    assert r.exit_code == 0, r.output
    assert read_manifest(tmp_path / "engine").quantization["origin"]["gguf Q4_0 exact"] == 4 * dims.num_layers


@pytest.mark.parametrize("value", [1e5, 0.1, 1e-30])
def test_quantization_scales_that_are_not_float16_values_are_refused_naming_the_tensor(tiny_int8_engine, tmp_path,
                                                                                      value):
    """Scales are float16 values stored as float32 (the kernels keep them as float16): a hostile dir's 1e5 (past
    float16), 0.1 or 1e-30 (rounded by float16) was refused by the kernel's packing without the tensor's name, or,
    for the embedding head's, not at all."""
    from safetensors.torch import load_file, save_file

    from conftest import save_manifest
    from trtpaged import LLM
    from trtpaged.engine_files import sha256_file
    from trtpaged.manifest import EngineDirError

    for name in ("layers.0.self_attn.qkv_proj.scales", "embed_tokens.head.scales"):
        engine = tmp_path / name
        shutil.copytree(tiny_int8_engine, engine)
        weights = load_file(engine / "weights.safetensors")
        weights[name].view(-1)[3] = value
        save_file(weights, engine / "weights.safetensors")
        manifest = json.loads((engine / "trtpaged.json").read_text())
        manifest["files"] = {rel: sha256_file(engine / rel) for rel in manifest["files"]}
        save_manifest(engine, manifest)
        with pytest.raises(EngineDirError) as info:
            LLM(engine, device="cpu")
        assert info.value.field == name and "not a float16 value" in str(info.value), info.value
