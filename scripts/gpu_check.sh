#!/usr/bin/env bash
# The GPU check, for one device call on the H200 (see README "GPU check"):
#   installs the carried wheels and jaxattn, runs the GPU-marked tests, then the benchmark if asked,
#   and writes logs and a summary under $OUT (default ./out).
# Usage: bash scripts/gpu_check.sh [pytest -k expression]    (BENCH="decode extend" to also benchmark,
#        STRESS=1000 to also run scripts/stress.py with that many batches per op (over STRESS_WORKERS processes,
#        with STRESS_ARGS added to its flags), BACKEND_STRESS=100 to run scripts/stress_backends.py (TritonBackend and
#        FlashInferBackend against ReferenceBackend, that many random batches per profile, BACKEND_STRESS_ARGS added),
#        SANITIZE=1 to run the hostile-input tests on compiled kernels under compute-sanitizer's memcheck,
#        PTXAS=1 to keep each Mosaic GPU kernel's ptxas report (registers, spills) in $OUT/ptxas.txt (jaxlib dumps every
#        kernel's passes to do it, gigabytes and minutes for a wide selection: use a narrow -k),
#        ALL=1 to run the whole suite
#        except interpreter-only cases instead of `-m gpu`: backends, end-to-end, checked mode and properties then
#        run on the compiled kernels too; with pytest-xdist among the carried wheels the tests run in 8 processes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if [ -n "${PTXAS:-}" ]; then  # jaxlib's Mosaic GPU compiler reads these (MOSAIC_GPU_DUMP_*)
  mkdir -p "$OUT/mosaic" && export MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/mosaic"
fi
source scripts/gpu_env.sh || exit 1
{
  echo "date: $(date -u +%FT%TZ)"
  # The device machine gets the working tree without .git: pass JAXATTN_COMMIT=<hash> in the device command.
  echo "commit: ${JAXATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax, triton, jax_triton; print('jax', jax.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
k_expr=${1:-}
parallel=""
python3 -c "import xdist" 2>/dev/null && parallel="-n 8"
if [ -n "${ALL:-}" ]; then
  selection=(-k "not interpret and not aot${k_expr:+ and ($k_expr)}")
else
  selection=(-m gpu ${k_expr:+-k "$k_expr"})
fi
python3 -m pytest -q $parallel "${selection[@]}" --durations=15 -rpfEs -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
if [ -n "${PTXAS:-}" ]; then  # the report lines only ($OUT brings back at most 8 files), named by their dump file
  grep -rH -E "ptxas (info|warning)|bytes stack frame" "$OUT/mosaic" > "$OUT/ptxas.txt"; rm -rf "$OUT/mosaic"
fi
for op in ${BENCH:-}; do
  python3 -m jaxattn.bench "$op" --json "$OUT/bench_$op.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$op.log"
done
# The reliability stress run (issue 8): STRESS=1000 runs that many random batches per op against the reference.
if [ -n "${STRESS:-}" ]; then
  # shellcheck disable=SC2086  # STRESS_ARGS: more stress.py flags, word-split on purpose (e.g. "--ops extend --profiles pages")
  python3 scripts/stress.py --batches "$STRESS" --workers "${STRESS_WORKERS:-1}" --json "$OUT/stress.json" ${STRESS_ARGS:-} \
    2>&1 | tee "$OUT/stress.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# The serving backends against ReferenceBackend on random batches: BACKEND_STRESS=100 runs that many per profile
# (scripts/stress_backends.py) for TritonBackend and FlashInferBackend.
if [ -n "${BACKEND_STRESS:-}" ]; then
  for backend in triton flashinfer; do
    # shellcheck disable=SC2086  # BACKEND_STRESS_ARGS: more flags, word-split on purpose (e.g. "--deterministic")
    python3 scripts/stress_backends.py --backend $backend --batches "$BACKEND_STRESS" --json "$OUT/stress_backends_$backend.json" \
      ${BACKEND_STRESS_ARGS:-} 2>&1 | tee "$OUT/stress_backends_$backend.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
# Out-of-range metadata of every class on the compiled kernels, under compute-sanitizer (issue 21): 0 errors expected.
# application-only: followed into the child processes the tests start, the sanitizer itself segfaulted within
# seconds (three calls, 2026-12-06; RESULTS, thirty-first session); the kernels run in the Python process.
if [ -n "${SANITIZE:-}" ]; then
  JAXATTN_HOSTILE_MODE=gpu compute-sanitizer --tool memcheck --target-processes application-only --error-exitcode 1 \
    --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider tests/test_hostile_inputs.py 2>&1 | tee "$OUT/sanitizer.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# Keep FlashInfer's build cache for the next run when it is small enough to bring back.
if [ -d ~/.cache/flashinfer ]; then
  tar czf "$OUT/flashinfer.tgz" -C ~/.cache flashinfer 2>/dev/null
  [ "$(stat -c %s "$OUT/flashinfer.tgz")" -le 16000000 ] || rm -f "$OUT/flashinfer.tgz"
fi
{
  echo "gpu tests exit status: $status"
  tail -1 "$OUT/gpu_tests.log"
} | tee "$OUT/summary.txt"
exit $status
