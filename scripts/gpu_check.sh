#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (PyTorch, nvcc, cmake and ninja installed;
# no network, nothing is pip-installed). Budget: under 8 minutes on an H200.
# trtpaged's own Python dependencies must import (an image without pydantic, fastapi, starlette, uvicorn,
# httptools or gguf: install their wheels first, e.g. pip install --no-index --no-deps --target DIR *.whl and
# PYTHONPATH=DIR).
#   1. build the kernel library (sm_$ARCHS) and, when TensorRT headers are found, the plugin
#      library for their major (nm/readelf: only the two entry points, no libnvinfer);
#   2. ptxas register use and spills;
#   3. pytest -m gpu (CUDA kernels) and the tensorrt-marked tests when TensorRT is importable;
#   4. the GPU kernel benchmark (fraction of measured HBM copy bandwidth, paged vs contiguous), and
#      its int8 / fp8_e4m3 KV cache variant (`trtpaged bench kernel --device cuda --kv-cache-dtype ... --quick`:
#      bytes actually read, time against the fp16 cache);
#   5. end to end without TensorRT (scripts/gpu_e2e.py; TRTPAGED_GPU_E2E_MODELS picks the models): engines built
#      on the GPU from models made here
#      (SmolLM2's config and a ~1.1B Llama shape, random weights), greedy equality of the CUDA torch
#      runner with HF, output tok/s of trtpaged fp16 / int4 / int8 vs HF static batching at batch 1, 64, and
#      a batch-1 profile (kernel launches and device-busy time per token: host- or device-bound);
#   6. with TensorRT: build the SmolLM2 engine, check that the KV pool is updated in place
#      (no pool-sized copy per step, activation memory vs pool bytes), greedy equality vs torch;
#   7. with >= 2 GPUs: tensor parallelism on 2 ranks (NCCL through torch.distributed, greedy vs
#      one rank) and, with TensorRT and the plugin, the TrtpagedAllReduce plugin over NCCL.
# Logs and results go to $OUT when set (else /tmp/trtpaged_gpu_check); a one-screen summary ends it.
# TensorRT headers: $TENSORRT_ROOT (a dir with include/NvInfer.h), else /usr/include/x86_64-linux-gnu,
# /usr/local/tensorrt or /opt/tensorrt.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${OUT:-/tmp/trtpaged_gpu_check}"
BUILD="${TRTPAGED_GPU_BUILD_DIR:-/tmp/trtpaged_gpu_build}"
ARCHS="${TRTPAGED_CUDA_ARCHS:-90}"
JOBS="$(nproc 2>/dev/null || echo 4)"
mkdir -p "$RESULTS"
if ! command -v python >/dev/null 2>&1; then  # images with only python3 on the PATH
  mkdir -p "$BUILD.bin" && ln -sfn "$(command -v python3)" "$BUILD.bin/python" && export PATH="$BUILD.bin:$PATH"
fi
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
status=0

step() { echo; echo "== $*"; }
DEADLINE="${TRTPAGED_GPU_CHECK_SECONDS:-460}"  # the whole check stays under 8 minutes
budget() {  # budget N: N seconds, or what is left before the deadline if less (at least 1)
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$1" ] && set -- "$left"
  [ "$1" -lt 1 ] && set -- 1
  echo "$1"
}
note() { echo "$*" | tee -a "$SUMMARY"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$RESULTS/device.txt"
nvcc --version | tail -1 | tee -a "$RESULTS/device.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$RESULTS/device.txt"
TRT_VERSION="$(python -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null || true)"
note "device: $(head -1 "$RESULTS/device.txt"); TensorRT: ${TRT_VERSION:-not importable}"
# Host cost of one eager kernel launch: what bounds an eager decode step (one launch per op), ours and HF's.
timeout "$(budget 30)" python - <<'PY' 2>&1 | tail -1 | tee -a "$SUMMARY"
import time, torch
x = torch.zeros(16, device="cuda")
for _ in range(200):
    x.add_(1)
torch.cuda.synchronize()
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    torch.cuda.synchronize()
    best = min(best, (time.perf_counter() - t0) / 2000)
print(f"launch: {best * 1e6:.1f} us per eager launch of a tiny kernel (best of 5 x 2000)")
PY

TRT_ROOT=""
for root in "${TENSORRT_ROOT:-}" /usr/include/x86_64-linux-gnu /usr/local/tensorrt /opt/tensorrt; do
  [ -n "$root" ] || continue
  if [ -f "$root/include/NvInfer.h" ]; then TRT_ROOT="$root"; break; fi
  if [ -f "$root/NvInfer.h" ]; then  # Debian layout: headers straight in the include dir
    TRT_ROOT="$BUILD.trt_root"; mkdir -p "$TRT_ROOT"; ln -sfn "$root" "$TRT_ROOT/include"; break
  fi
done

step "build (sm_$ARCHS) in $BUILD${TRT_ROOT:+, plugin against $TRT_ROOT}"
rm -rf "$BUILD"
if ! timeout "$(budget 60)" cmake -S "$REPO" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRTPAGED_CUDA=ON \
      -DTRTPAGED_CUDA_ARCHS="$ARCHS" ${TRT_ROOT:+-DTENSORRT_ROOT="$TRT_ROOT"} >"$RESULTS/cmake.log" 2>&1; then
  tail -30 "$RESULTS/cmake.log"; note "cmake configure FAILED"; exit 1
fi
if ! timeout "$(budget 200)" cmake --build "$BUILD" -j "$JOBS" >"$RESULTS/build.log" 2>&1; then
  grep -E "error|Error" "$RESULTS/build.log" | head -40; note "build FAILED"; exit 1
fi
LIB="$(find "$BUILD" -maxdepth 2 -name 'libtrtpaged_kernels.so' | head -1)"
PLUGIN="$(find "$BUILD" -maxdepth 2 -name 'libtrtpaged_trt_plugin_trt*.so' | head -1)"
note "built: $(basename "$LIB")${PLUGIN:+, $(basename "$PLUGIN")}${TRT_ROOT:- (no TensorRT headers: no plugin)}"
if [ -n "$PLUGIN" ]; then
  exports="$(nm -D --defined-only "$PLUGIN" | awk '{print $NF}' | sort | tr '\n' ' ')"
  needed="$(readelf -d "$PLUGIN" | grep NEEDED | grep -o '\[.*\]' | tr '\n' ' ')"
  note "plugin exports: $exports; needs: $needed"
  [ "$exports" = "getCreators setLoggerFinder " ] || status=1
  case "$needed" in *nvinfer*) status=1 ;; esac
fi

step "ptxas: registers and spills per kernel"
python - "$RESULTS/build.log" <<'PY' | tee "$RESULTS/ptxas_summary.txt"
import re, sys
kernel = arch = None
rows, spills = {}, []
for line in open(sys.argv[1]):
    m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
    if m:
        kernel, arch = m.groups()
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and kernel and (m.group(1) != "0" or m.group(2) != "0"):
        spills.append(f"{arch} {kernel}: {line.strip()}")
    m = re.search(r"Used (\d+) registers", line)
    if m and kernel:
        rows[(arch, kernel)] = int(m.group(1))  # the plugin's static archive compiles the same kernels again
        kernel = None
regs = rows.values()
print(f"ptxas: {len(rows)} kernels; registers {min(regs)}-{max(regs)}; "
      + ("spills: none" if not spills else f"spills in {len(spills)}"))
for s in spills:
    print("  " + s)
PY
head -1 "$RESULTS/ptxas_summary.txt" >>"$SUMMARY"
grep -q "spills: none" "$RESULTS/ptxas_summary.txt" || status=1

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TRTPAGED_KERNELS_LIB="$LIB"
export TRTPAGED_EXPECT_CUDA_ARCHS="$ARCHS"
[ -n "$PLUGIN" ] && export TRTPAGED_PLUGIN_LIB="$PLUGIN"
unset TENSORRT_ROOT  # the header-only plugin build tests rebuild it: step 1 did that already
cd "$REPO"

step "tests (pytest -m gpu; tensorrt-marked tests when TensorRT is importable)"
tests=(tests/test_kernels_gpu.py tests/test_kernels.py tests/test_qlinear_cuda.py tests/test_block_staging.py)
marks="gpu"
if [ -n "$TRT_VERSION" ] && [ -n "$PLUGIN" ]; then tests+=(tests/test_tensorrt.py); marks="gpu or tensorrt"; fi
timeout "$(budget 90)" python -m pytest -m "$marks" "${tests[@]}" -q -rs -p no:cacheprovider \
  --junitxml="$RESULTS/pytest.xml" 2>&1 | tee "$RESULTS/pytest.log"
rc=${PIPESTATUS[0]}
note "pytest -m '$marks': $(tail -1 "$RESULTS/pytest.log") (exit $rc)"
[ "$rc" -eq 0 ] || status=1

step "GPU kernel benchmark"
timeout "$(budget 45)" python -m trtpaged.bench.kernel_bench_gpu --save "$RESULTS/bench.json" 2>&1 | tee "$RESULTS/bench.txt"
rc=${PIPESTATUS[0]}
grep -E "^(long contexts|paged vs contiguous)" "$RESULTS/bench.txt" | sed 's/^/bench: /' >>"$SUMMARY"
note "bench exit $rc"
[ "$rc" -eq 0 ] || status=1

step "GPU kernel benchmark, quantized KV cache (vs the fp16 cache)"
for kv in int8 fp8_e4m3; do
  timeout "$(budget 30)" python -c 'from trtpaged.cli import main; main()' bench kernel --device cuda \
    --kv-cache-dtype "$kv" --quick 2>&1 | tee "$RESULTS/bench_$kv.txt"
  rc=${PIPESTATUS[0]}
  grep -E "^(long contexts|$kv cache vs fp16)" "$RESULTS/bench_$kv.txt" | sed "s/^/bench $kv: /" >>"$SUMMARY"
  note "bench $kv exit $rc"
  [ "$rc" -eq 0 ] || status=1
done

step "end to end: engines built here from random-weight models, greedy vs HF, tok/s vs HF static batching"
E2E_SECONDS="$(budget 240)"
timeout "$E2E_SECONDS" python scripts/gpu_e2e.py --out "$BUILD/e2e" --seconds "$((E2E_SECONDS - 30))" \
  --models "${TRTPAGED_GPU_E2E_MODELS:-smollm2,llama1b}" 2>&1 \
  | tee "$RESULTS/e2e.log"
rc=${PIPESTATUS[0]}
grep '^e2e ' "$RESULTS/e2e.log" | grep -v ': FAILED' >>"$SUMMARY"
grep '^e2e .*: FAILED' "$RESULTS/e2e.log" | head -5 >>"$SUMMARY"
cp "$BUILD/e2e/e2e.json" "$BUILD"/e2e/*.trace.txt "$RESULTS/" 2>/dev/null
note "e2e exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out: see e2e.log for the step)')"
[ "$rc" -eq 0 ] || status=1

if [ -n "$TRT_VERSION" ] && [ -n "$PLUGIN" ]; then
  step "TensorRT: SmolLM2 engine, KV pool aliasing, greedy equality vs torch"
  timeout "$(budget 300)" python - "$REPO" "$BUILD/smollm2" "$RESULTS" <<'PY' 2>&1 | tee "$RESULTS/tensorrt.log"
import json, sys, time
from pathlib import Path

import torch
import yaml

repo, engine_dir, results = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
report: dict = {}
summary = open(results / "summary.txt", "a")


def say(line: str) -> None:
    print(line)
    summary.write(line + "\n")
    summary.flush()


from trtpaged.builder import build_engine
from trtpaged.config import load_config

data = yaml.safe_load((repo / "examples/smollm2.yaml").read_text())
data.update(backend="tensorrt", max_num_tokens=512, kv_cache={"memory": "256MiB"})
data.pop("output", None)
yaml_path = results / "smollm2_tensorrt.yaml"
yaml_path.write_text(yaml.safe_dump(data))
t0 = time.time()
build_engine(load_config(yaml_path), engine_dir, skip_verify=True, echo=print)
report["build_s"] = round(time.time() - t0, 1)
say(f"trt build: SmolLM2 engine with TensorRT in {report['build_s']} s")

# --- the open question: is the aliased KV pool updated in place, or copied? ---
from trtpaged.builder.probe import standard_probe
from trtpaged.manifest import read_manifest
from trtpaged.runtime.runners import StepBatch
from trtpaged.runtime.runners.tensorrt_runner import TensorRTRunner

manifest = read_manifest(engine_dir)
_, steps, num_kv_blocks = standard_probe(manifest.dims.vocab_size, manifest.limits.block_size)
engine = TensorRTRunner.from_engine_dir(engine_dir, num_kv_blocks=max(num_kv_blocks, 1024))
pool_bytes = engine.kv_cache.numel() * engine.kv_cache.element_size()
cuda_engine = engine._engine
activation = getattr(cuda_engine, "device_memory_size_v2", None) or cuda_engine.device_memory_size
pointer = engine.kv_cache.data_ptr()
batches = [StepBatch(**s.inputs) for s in steps]
engine.step(batches[0])
torch.cuda.synchronize()
written = bool(engine.kv_cache.abs().sum().item() > 0)
trace = results / "trt_step_trace.json"
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    engine.step(batches[1])
    torch.cuda.synchronize()
prof.export_chrome_trace(str(trace))
events = json.loads(trace.read_text()).get("traceEvents", [])
copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
big = [e for e in copies if int(e.get("args", {}).get("bytes", 0)) >= pool_bytes // 2]
report.update(pool_bytes=pool_bytes, device_memory_size_v2=int(activation), pool_written_in_place=written,
              pool_pointer_kept=engine.kv_cache.data_ptr() == pointer, copies_per_step=len(copies),
              pool_sized_copies_per_step=len(big))
in_place = written and not big and activation < pool_bytes
say(f"aliasing: pool {pool_bytes / 2**20:.0f} MiB, TensorRT activation memory {activation / 2**20:.1f} MiB, "
    f"{len(copies)} copies/step ({len(big)} pool-sized), written in place: {written} -> "
    + ("IN PLACE (keep the aliased pool)" if in_place else
       "COPIED: fall back to the pool address as an int64 host input (TensorRT-LLM pattern)"))
del engine
torch.cuda.empty_cache()

# --- greedy equality, TensorRT vs torch, with a prompt longer than max_num_tokens (empty logits steps) ---
from trtpaged import LLM, SamplingParams

prompts = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers: ", " ".join(["The quick brown fox jumps over the lazy dog."] * 30)]
params = SamplingParams(max_tokens=32, temperature=0.0)
outs = {}
for backend in ("tensorrt", "torch"):
    llm = LLM(engine_dir, backend=backend, device="cuda", max_num_tokens=64)
    t0 = time.time()
    # One prompt at a time: the long one's first chunks are steps where nobody samples.
    outs[backend] = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    report[f"{backend}_generate_s"] = round(time.time() - t0, 2)
    del llm
    torch.cuda.empty_cache()
same = []
for a, b in zip(outs["tensorrt"], outs["torch"]):
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    same.append(first is None and len(a) == len(b))
    report.setdefault("first_divergence", []).append(first)
report["greedy_equal"] = same
say(f"greedy: {sum(same)}/{len(same)} prompts token-identical to torch (first divergence per prompt: "
    f"{report['first_divergence']}); tensorrt {report['tensorrt_generate_s']} s, torch {report['torch_generate_s']} s")
(results / "tensorrt.json").write_text(json.dumps(report, indent=2))
sys.exit(0 if all(same) else 3)
PY
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { status=1; note "TensorRT check exit $rc (see tensorrt.log)"; }
else
  note "TensorRT checks skipped: ${TRT_VERSION:+plugin not built (no TensorRT headers)}${TRT_VERSION:-TensorRT not importable}"
fi

NGPUS="$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if [ "$NGPUS" -ge 2 ]; then
  step "tensor parallelism on 2 GPUs (torch.distributed NCCL; TensorRT all-reduce plugin)"
  timeout "$(budget 90)" python -m pytest -m gpu tests/test_tensor_parallel_runtime.py -q -rs -p no:cacheprovider \
    2>&1 | tee "$RESULTS/tp_pytest.log"
  rc=${PIPESTATUS[0]}
  note "tp pytest -m gpu: $(tail -1 "$RESULTS/tp_pytest.log") (exit $rc)"
  [ "$rc" -eq 0 ] || status=1
  if [ -n "$TRT_VERSION" ] && [ -n "$PLUGIN" ]; then
    timeout "$(budget 120)" python scripts/tp_allreduce_check.py 2>&1 | tee "$RESULTS/tp_allreduce.log"
    rc=${PIPESTATUS[0]}
    sed 's/^/tp all-reduce plugin: /' "$RESULTS/tp_allreduce.log" | tail -3 >>"$SUMMARY"
    [ "$rc" -eq 0 ] || status=1
  else
    note "tp all-reduce plugin skipped: ${TRT_VERSION:+plugin not built (no TensorRT headers)}${TRT_VERSION:-TensorRT not importable}"
  fi
else
  note "tensor parallelism on GPUs skipped: $NGPUS GPU(s), needs 2"
fi

echo
echo "================ summary (status $status; results in $RESULTS) ================"
cat "$SUMMARY"
exit $status
