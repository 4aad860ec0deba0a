#!/usr/bin/env bash
# GPU kernel tests and benchmarks in one go, for a machine with an NVIDIA GPU, nvcc, torch and triton.
#
#   OUT=/some/dir bash tests/gpu/run_on_device.sh      (from the repository root)
#
# Writes env.txt, tests.log, warm.log, bench.log and bench.json under $OUT (default ./gpu-out); with
# NCU=1 also ncu.txt (Nsight Compute on the native RMSNorm). Wheels in .whl/ (packages the machine
# lacks, e.g. zstandard for mgx.formats) are installed into /tmp/site first.
# The tests and a compile-only pass of the benchmark run side by side first (Triton's disk cache then
# holds every kernel the benchmark launches), then the benchmark runs alone on a quiet GPU.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
TESTS_T=${TESTS_T:-240}   # seconds for the tests (and the compile-only pass beside them)
BENCH_T=${BENCH_T:-300}   # seconds for the benchmark
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nvcc --version | tail -2
  $PY -m pip install -q --no-deps --no-build-isolation -e . && echo "installed mgx (editable)"
} > "$OUT/env.txt" 2>&1

(timeout "$TESTS_T" $PY -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_triton_*.py tests/gpu \
  > "$OUT/tests.log" 2>&1; echo "pytest exit $?" >> "$OUT/tests.log") &
for s in rmsnorm gemv decode,prefill lm_head; do
  timeout "$TESTS_T" $PY examples/bench_gpu_kernels.py --warm --only "$s" > "/tmp/mgx-warm-$s.log" 2>&1 &
done
wait
cat /tmp/mgx-warm-*.log > "$OUT/warm.log"
timeout "$BENCH_T" $PY examples/bench_gpu_kernels.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  timeout 120 ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section MemoryWorkloadAnalysis -k regex:mgx_rms_norm -c 3 $PY -c "
import torch
from mgx.kernels.cuda import build, rmsnorm as r
k = r.load_cuda_kernels(build.build_cuda_kernels('sm_90a'), 'sm_90a')
x = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16); w = torch.randn(4096, device='cuda', dtype=torch.bfloat16)
r.rms_norm(x, w, 1e-5, kernels=k); r.rms_norm(x, w, 1e-5, kernels=k, residual=x.clone())
r.rms_norm(torch.randn(16384, 8192, device='cuda', dtype=torch.bfloat16), torch.randn(8192, device='cuda', dtype=torch.bfloat16), 1e-5, kernels=k)
torch.cuda.synchronize()" > "$OUT/ncu.txt" 2>&1
fi
echo "=== tests ==="
grep -E "passed|failed|error|pytest exit" "$OUT/tests.log" | tail -n 5
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 40
