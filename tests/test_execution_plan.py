"""The execution plan: decided once, by one function, from what the model and the machine have; each
plan's logits agree with the others' and with HF's forward."""

from __future__ import annotations

import pytest
import torch

from tests.test_fused_ops import _probe_logits, _tiny
from trtpaged import kernels
from trtpaged.builder.probe import hf_logits, standard_probe
from trtpaged.config import parse_config
from trtpaged.models import load_hf, step_model_from_hf
from trtpaged.models.execution_plan import ExecutionPlan, decide_execution_plan

pytestmark = pytest.mark.skipif(not (kernels.available() and kernels.has_fused_ops() and kernels.has_llama_layers()),
                                reason="kernel library with the fused ops and the layer runner not built")


def _quantized(weights: str = "int4"):
    from trtpaged.builder.quantize import quantized_step_model
    from trtpaged.models import dims_from_hf_config

    config = parse_config({"model": {"tiny": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96}},
                           "quantization": {"weights": weights, "group_size": 32}})
    hf = load_hf(config.model)
    dims = dims_from_hf_config(hf.config)
    return quantized_step_model(hf.model, config.model, dims, config.quantization, torch.float32)[0], dims


def test_the_plan_follows_dtype_weights_and_ranks():
    hf, dims = _tiny()
    model = step_model_from_hf(hf.model, dims)
    assert decide_execution_plan(model).layers == "fused"
    assert "float linears" in decide_execution_plan(model).reason
    plan = decide_execution_plan(model.to(torch.bfloat16))
    assert plan.layers == "torch" and "bfloat16" in plan.reason
    quantized, _ = _quantized()
    assert decide_execution_plan(quantized).layers == "c_layers"
    quantized.reduce = lambda y: y  # what a tensor-parallel rank has: its all-reduces sit between the kernels
    plan = decide_execution_plan(quantized)
    assert plan.layers == "fused" and "tensor-parallel" in plan.reason


def test_c_layers_is_refused_where_it_cannot_run():
    hf, dims = _tiny()
    model = step_model_from_hf(hf.model, dims)
    with pytest.raises(ValueError, match="c_layers: float linears"):
        model.set_execution_plan(ExecutionPlan("c_layers", "forced"))
    quantized, _ = _quantized()
    with pytest.raises(ValueError, match="needs the kernels' attention"):
        quantized.set_execution_plan(ExecutionPlan("c_layers", "forced", attention="reference"))
    with pytest.raises(ValueError, match="layers: got 'fast'"):
        ExecutionPlan("fast", "no such mode")


@pytest.mark.parametrize("plan", [ExecutionPlan("fused", "test"), ExecutionPlan("torch", "test"),
                                  ExecutionPlan("torch", "test", attention="reference")], ids=str)
def test_every_plan_matches_hf_forward(plan):
    hf, dims = _tiny()
    model = step_model_from_hf(hf.model, dims)
    model.set_execution_plan(plan)
    seqs, steps, num_kv_blocks = standard_probe(dims.vocab_size, 8, seed=5, all_rows=True)
    cache = model.new_kv_cache(num_kv_blocks, 8)
    with torch.no_grad():
        for step in steps:
            ours = model(*step.args(cache))[0]
            torch.testing.assert_close(ours, hf_logits(hf.model, seqs, step.rows), rtol=1e-4, atol=1e-4)


def test_quantized_plans_agree_bit_for_bit():
    model, dims = _quantized("int8")
    one_call = _probe_logits(model, dims)
    assert model.execution_plan.layers == "c_layers"  # decided at the first step
    model.set_execution_plan(ExecutionPlan("fused", "test"))
    for a, b in zip(one_call, _probe_logits(model, dims)):
        assert torch.equal(a, b)


def test_the_runner_decides_and_reports_the_plan(tiny_engine_dir):
    from trtpaged import LLM

    llm = LLM(tiny_engine_dir, device="cpu")
    assert llm.execution_plan.startswith("torch: fused (")  # examples/tiny.yaml: float32 weights
    assert llm.engine.runner.model.execution_plan.layers == "fused"
    stats = llm.engine.stats()
    assert {k: v for k, v in stats.items() if k.startswith("execution_plan_")} == {
        "execution_plan_c_layers": 0.0, "execution_plan_fused": 1.0, "execution_plan_torch": 0.0}


def test_inspect_shows_the_plan_the_runner_decides(tiny_engine_dir):
    """`trtpaged inspect --plan` prints the plan that loading the engine decides on this machine."""
    from click.testing import CliRunner

    from trtpaged import LLM
    from trtpaged.cli import main

    result = CliRunner().invoke(main, ["inspect", str(tiny_engine_dir), "--plan"])
    assert result.exit_code == 0, result.output
    line = [x for x in result.output.splitlines() if x.startswith("execution plan on this machine's CPU: ")]
    assert len(line) == 1
    runner_plan = LLM(tiny_engine_dir, device="cpu").engine.runner.model.execution_plan
    assert line[0].split(": ", 1)[1] == str(runner_plan)
