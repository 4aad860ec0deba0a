#!/usr/bin/env bash
# The CUDA backend on a GPU machine: its tests, then (BENCH=1) the whole-model benchmark.
#
#   OUT=/some/dir bash tests/gpu/run_backend_on_device.sh      (from the repository root)
#
# Writes env.txt, backend_tests.log and (BENCH=1) model.log / model.json under $OUT. Wheels in .whl/
# (packages the machine lacks, e.g. zstandard) are installed into /tmp/site first.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/env.txt" 2>&1 && echo "installed mgx" >> "$OUT/env.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_T:-300}" $PY -m pytest -q -x -p no:cacheprovider -m "gpu and not slow" ${TEST_ARGS:-tests/e2e/test_cuda_backend.py tests/e2e/test_cuda_kernels.py} \
    > "$OUT/backend_tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/backend_tests.log"
  tail -5 "$OUT/backend_tests.log"
fi
if [ "${BENCH:-0}" = 1 ]; then
  timeout "${BENCH_T:-400}" $PY examples/bench_gpu_model.py ${BENCH_ARGS:-} --json "$OUT/model.json" 2>&1 | tee "$OUT/model.log" | tail -40
fi
