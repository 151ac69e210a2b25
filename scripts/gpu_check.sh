#!/usr/bin/env bash
# One-shot check of the CUDA kernels on a GPU machine (PyTorch, nvcc, cmake and ninja
# installed; no TensorRT, no network, nothing is pip-installed):
#   1. build the kernel library for sm_90 only (build dir under /tmp),
#   2. report ptxas register use and any spill stores/loads,
#   3. run the GPU tests (tests/test_kernels_gpu.py) and the gpu-marked CPU kernel tests,
#   4. run the GPU decode benchmark.
# Logs and results go to $OUT when set (else /tmp/trtpaged_gpu_check). Takes a few minutes.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${OUT:-/tmp/trtpaged_gpu_check}"
BUILD="${TRTPAGED_GPU_BUILD_DIR:-/tmp/trtpaged_gpu_build}"
ARCHS="${TRTPAGED_CUDA_ARCHS:-90}"
JOBS="$(nproc 2>/dev/null || echo 4)"
mkdir -p "$RESULTS"
status=0

step() { echo; echo "== $*"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$RESULTS/device.txt"
nvcc --version | tail -2 | tee -a "$RESULTS/device.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$RESULTS/device.txt"

step "build (sm_$ARCHS) in $BUILD"
rm -rf "$BUILD"
if ! timeout 120 cmake -S "$REPO" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRTPAGED_CUDA=ON \
      -DTRTPAGED_CUDA_ARCHS="$ARCHS" >"$RESULTS/cmake.log" 2>&1; then
  tail -30 "$RESULTS/cmake.log"; echo "cmake configure FAILED"; exit 1
fi
if ! timeout 200 cmake --build "$BUILD" -j "$JOBS" >"$RESULTS/build.log" 2>&1; then
  grep -E "error|Error" "$RESULTS/build.log" | head -40; echo "build FAILED"; exit 1
fi
LIB="$(find "$BUILD" -maxdepth 2 -name 'libtrtpaged_kernels*.so' | head -1)"
echo "library: $LIB"

step "ptxas: registers and spills per kernel"
python - "$RESULTS/build.log" <<'PY' | tee "$RESULTS/ptxas_summary.txt"
import re, sys
kernel = arch = None
rows, spills = [], []
for line in open(sys.argv[1]):
    m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
    if m:
        kernel, arch = m.groups()
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and kernel:
        if m.group(1) != "0" or m.group(2) != "0":
            spills.append(f"{arch} {kernel}: {line.strip()}")
    m = re.search(r"Used (\d+) registers", line)
    if m and kernel:
        rows.append((arch, int(m.group(1)), kernel))
        kernel = None
print(f"{len(rows)} kernels compiled; registers min {min(r[1] for r in rows)} max {max(r[1] for r in rows)}")
print("spills:" if spills else "spills: none (0 bytes spill stores/loads in every kernel)")
for s in spills:
    print("  " + s)
PY
grep -q "spills: none" "$RESULTS/ptxas_summary.txt" || status=1

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TRTPAGED_KERNELS_LIB="$LIB"
export TRTPAGED_EXPECT_CUDA_ARCHS="$ARCHS"

step "tests (pytest -m gpu)"
cd "$REPO"
timeout 170 python -m pytest -m gpu tests/test_kernels_gpu.py tests/test_kernels.py -q -rs \
  -p no:cacheprovider --junitxml="$RESULTS/pytest.xml" 2>&1 | tee "$RESULTS/pytest.log"
rc=${PIPESTATUS[0]}
echo "pytest exit code: $rc"
[ "$rc" -eq 0 ] || status=1

step "GPU decode benchmark"
timeout 90 python -m trtpaged.bench.kernel_bench_gpu --save "$RESULTS/bench.json" 2>&1 | tee "$RESULTS/bench.txt"
rc=${PIPESTATUS[0]}
echo "benchmark exit code: $rc"
[ "$rc" -eq 0 ] || status=1

step "done (status $status); results in $RESULTS"
exit $status
