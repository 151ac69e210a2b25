"""End to end on a CUDA GPU with models made there (no network, no GGUF): scripts/gpu_check.sh's e2e step.

    python scripts/gpu_e2e.py --out DIR [--seconds 240] [--models smollm2,llama1b]

Steps, each named in its result line (a failure names its step, and the next steps still run):
  models   HF dirs with random weights: SmolLM2-135M's config, and a Llama-shaped ~1.1B config
           (TinyLlama's shape), each with the byte-level tokenizer of the `tiny` preset;
  build    trtpaged engines from each dir on the GPU: fp16, int4 (group 32) and int8 (per channel),
           backend torch, no verification (the test suite verifies builds);
  greedy   the CUDA torch runner's greedy tokens against HF transformers' generate on the same GPU
           (float32, SmolLM2 config; initializer_range 0.1 keeps random logits away from ties);
  profile  SmolLM2 fp16 at batch 1, per output token: wall ms, kernel launches and device-busy ms
           (torch.profiler): host-bound or device-bound;
  speed    output tokens/s in one run: trtpaged fp16 / int4 / int8 (continuous batching, LLM.generate)
           against HF transformers static batching (generate, fp16), at batch 1 and 64, prompt 64 and
           output 64 tokens, EOS ignored.
Results: DIR/e2e.json and one line per result on stdout (prefixed "e2e "); exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODELS: dict[str, dict[str, Any]] = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True,
                    max_position_embeddings=2048, rms_norm_eps=1e-5),
    "llama1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False,
                    max_position_embeddings=2048, rms_norm_eps=1e-5),
}
SCHEMES = {"fp16": None, "int4": {"weights": "int4", "group_size": 32, "lm_head": "int8"},
           "int8": {"weights": "int8", "lm_head": "int8"}}
PROMPT_LEN, OUTPUT_LEN = 64, 64
PROFILE_LINE = ("{wall_ms_per_token:.2f} ms wall, {launches_per_token:.0f} kernel launches, "
                "device busy {device_busy_ms_per_token:.2f} ms")


def make_model(name: str, out: Path, init: float = 0.02) -> Path:
    """An HF dir: LlamaForCausalLM of MODELS[name] with random weights (seed 0) and the tiny tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer

    path = out / f"{name}-hf"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], initializer_range=init, bos_token_id=256, eos_token_id=257,
                         pad_token_id=258)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.half().save_pretrained(str(path), safe_serialization=True)  # fp16 values: read exactly as fp32 too
    make_tiny_tokenizer().save_pretrained(str(path))
    return path


def build(hf_dir: Path, out: Path, scheme: str, dtype: str = "float16") -> Path:
    from trtpaged.builder import build_engine
    from trtpaged.config import parse_config

    data: dict[str, Any] = {"model": {"hf_dir": str(hf_dir)}, "dtype": dtype, "backend": "torch",
                            "max_batch_size": 64, "max_num_tokens": 4096, "max_seq_len": 512,
                            "kv_cache": {"memory": "8GiB"}}
    if SCHEMES[scheme]:
        data["quantization"] = SCHEMES[scheme]
    engine = out / f"{hf_dir.name.removesuffix('-hf')}-{scheme}-{dtype}"
    build_engine(parse_config(data), engine, skip_verify=True, force=True, echo=lambda _line: None)
    return engine


def greedy_check(hf_dir: Path, engine: Path, prompts: list[list[int]], new: int = 32) -> dict[str, Any]:
    """Token ids of the CUDA torch runner and of HF generate (same GPU, float32, TF32 off) per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    from trtpaged import LLM, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    llm = LLM(engine, backend="torch", device="cuda")
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0,
                                                                                 ignore_eos=True))]
    del llm
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).cuda().eval()
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=258)
            theirs.append(out[0, len(p):].tolist())
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, theirs)]
    return {"equal": [f is None and len(x) == len(y) for f, x, y in zip(first, ours, theirs)],
            "first_divergence": first}


def trtpaged_speed(engine: Path, prompts: list[list[int]]) -> float:
    import torch

    from trtpaged import LLM, SamplingParams

    llm = LLM(engine, backend="torch", device="cuda")
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    del llm
    torch.cuda.empty_cache()
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def step_profile(engine: Path, prompt: list[int], new: int = 32, device: str = "cuda") -> dict[str, float]:
    """Where a batch-1 generate's time goes, per output token: wall ms (no profiler), kernel launches and
    device-busy ms (torch.profiler, a second run). Launches x host cost per launch against the wall says
    whether the step is bound by the host (eager launches) or by the device."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from trtpaged import LLM, SamplingParams

    on_cuda = torch.device(device).type == "cuda"
    llm = LLM(engine, backend="torch", device=device)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    llm.generate([prompt], params)
    sync()
    wall = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        llm.generate([prompt], params)
        sync()
    del llm
    events = prof.key_averages()
    launches = sum(e.count for e in events if "LaunchKernel" in e.key)
    # device events only: the profiler also files each kernel's time under the CPU launch that queued it
    device_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                    for e in events if e.device_type == DeviceType.CUDA)
    return {"wall_ms_per_token": wall / new * 1e3, "launches_per_token": launches / new,
            "device_busy_ms_per_token": device_us / 1e3 / new}


def hf_speed(hf_dir: Path, prompts: list[list[int]]) -> float:
    """HF transformers generate over the prompts as one static batch (fp16, same lengths: no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        model.generate(input_ids=ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=4,
                       do_sample=False, pad_token_id=258)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
                             min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=258)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / wall


def random_prompts(n: int, length: int, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()  # byte tokens: every tokenizer id valid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=240.0, help="stop starting new steps after this")
    parser.add_argument("--models", default="smollm2,llama1b")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    report: dict[str, Any] = {"failures": [], "speed": {}, "build_s": {}}
    failed = False

    def say(line: str) -> None:
        print(f"e2e {line}", flush=True)

    def step(name: str, fn: Callable[[], Any]) -> Any:
        nonlocal failed
        left = args.seconds - (time.time() - start)
        if left <= 0:
            say(f"{name}: SKIPPED (out of time)")
            report["failures"].append(f"{name}: skipped, out of time")
            failed = True
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001  (every failure is reported under its step's name)
            say(f"{name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            (args.out / f"{name.replace(' ', '_')}.trace.txt").write_text(traceback.format_exc())
            report["failures"].append(f"{name}: {type(e).__name__}: {e}")
            failed = True
            return None

    names = [m for m in args.models.split(",") if m]
    dirs = {m: step(f"models {m}", lambda m=m: make_model(m, args.out)) for m in names}
    engines: dict[tuple[str, str], Path] = {}
    for m in names:
        if dirs.get(m) is None:
            continue
        for scheme in SCHEMES:
            t0 = time.time()
            engine = step(f"build {m} {scheme}", lambda m=m, s=scheme: build(dirs[m], args.out, s))
            if engine is not None:
                engines[(m, scheme)] = engine
                report["build_s"][f"{m} {scheme}"] = round(time.time() - t0, 1)
        say(f"build {m}: " + ", ".join(f"{s} {report['build_s'].get(f'{m} {s}', 'FAILED')} s" for s in SCHEMES))

    if "smollm2" in names:
        def greedy() -> dict:
            hf_dir = make_model("smollm2", args.out / "greedy", init=0.1)
            engine = build(hf_dir, args.out / "greedy", "fp16", dtype="float32")
            return greedy_check(hf_dir, engine, random_prompts(4, 24, seed=1))

        result = step("greedy smollm2 fp32 vs HF", greedy)
        if result is not None:
            report["greedy"] = result
            ok = all(result["equal"])
            failed = failed or not ok
            say(f"greedy smollm2 fp32 vs HF: {sum(result['equal'])}/{len(result['equal'])} prompts token-identical "
                f"(first divergence {result['first_divergence']})" + ("" if ok else " FAILED"))

    if ("smollm2", "fp16") in engines:
        prompt = random_prompts(1, PROMPT_LEN, seed=3)[0]
        prof = step("profile smollm2 fp16 batch 1", lambda: step_profile(engines[("smollm2", "fp16")], prompt))
        if prof is not None:
            report["profile"] = prof
            say("profile smollm2 fp16 batch 1 (per output token): " + PROFILE_LINE.format(**prof))

    for m in names:
        for batch in (1, 64):
            prompts = random_prompts(batch, PROMPT_LEN, seed=batch)
            row: dict[str, Any] = {}
            hf = (step(f"speed {m} hf batch {batch}", lambda m=m, p=prompts: hf_speed(dirs[m], p))
                  if dirs.get(m) else None)  # fmt: skip
            row["hf"] = hf
            for scheme in SCHEMES:
                engine = engines.get((m, scheme))
                row[scheme] = (step(f"speed {m} {scheme} batch {batch}",
                                    lambda e=engine, p=prompts: trtpaged_speed(e, p))
                               if engine is not None else None)
            report["speed"][f"{m} batch {batch}"] = row
            cells = [f"{k} {v:.0f}" + (f" ({v / hf:.2f}x)" if hf and k != "hf" else "") if v else f"{k} -"
                     for k, v in row.items()]
            say(f"speed {m} batch {batch} (output tok/s, vs HF static): " + ", ".join(cells))
    (args.out / "e2e.json").write_text(json.dumps(report, indent=2))
    say(f"done in {time.time() - start:.0f} s, {len(report['failures'])} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
