#!/usr/bin/env bash
# One device run on the lent H200 (docs/gpu-workflow.md): carry .gpu-bundle, .artifacts, .variants.
#   bash bench/h200_run.sh tests variants ceilings     # any of: tests memcheck variants trace ceilings bench selftest per_layer_ab host_ab
#   VARIANTS="now lsu" bash bench/h200_run.sh variants  # time only these variants
# Logs and result files go to $OUT (at most 8 files come back).
set -uo pipefail
source .gpu-bundle/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-} MSA_JIT_CACHE_DIR=$PWD/.artifacts MSA_JIT_NO_COMPILE=1 \
       MSA_JIT_DSL_VERSION=4.8.1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    tests) (cd tests && python3 -m pytest test_kernel_gpu.py test_planner.py test_op_fast_path.py -m gpu -q -rA) > $OUT/gpu-tests.log 2>&1
           tail -n 1 $OUT/gpu-tests.log ;;
    memcheck) (cd tests && compute-sanitizer --tool memcheck --error-exitcode 9 python3 gpu_memcheck.py) \
               > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?" | tee -a $OUT/memcheck.log ;;
    variants) python3 bench/variants.py run --dir .variants --out $OUT ${VARIANTS:+--variants $VARIANTS} 2>&1 | tee $OUT/variants.log | tail -n 40 ;;
    trace) python3 bench/trace_ctas.py --dir .variants --out $OUT ${TRACES:+--variants $TRACES} 2>&1 | tee $OUT/trace.log | tail -n 8 ;;
    ceilings) python3 bench/ceilings.py --out $OUT --layers 2>&1 | tee $OUT/ceilings.log | tail -n 20 ;;
    bench) python3 -m msa_jit bench --out $OUT --baseline bench/results/bench-2026-12-03T1342.json 2>&1 \
             | tee $OUT/bench.log | tail -n 45 ;;
    selftest) python3 -m msa_jit selftest --no-bench --out $OUT 2>&1 | tee $OUT/selftest.log | tail -n 5 ;;
    per_layer_ab) python3 bench/per_layer_ab.py --out $OUT 2>&1 | tee $OUT/per-layer-ab.log | tail -n 26 ;;
    host_ab) python3 bench/host_ab.py --out $OUT 2>&1 | tee $OUT/host-ab.log | tail -n 46 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
