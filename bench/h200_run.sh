#!/usr/bin/env bash
# One device run on the lent H200 (docs/gpu-workflow.md): carry .gpu-bundle, .artifacts (warmed for
# BOTH cache formats: python bench/warm_kv_formats.py), and .variants for variants / trace.
#   bash bench/h200_run.sh tests memcheck racecheck selftest bench ceilings    # the round's full run
#   any of: tests union_tests cluster_tests memcheck racecheck selftest bench bench_quick bench_union
#           bench_kernel_merge
#           ceilings host_ab host_ab_union variants trace
#           per_layer_ab union_k8 union_k8_small union_k8_trace union_skip union_qreg union_qreg_trace
#           union_lo union_ncu union_final push_merge push_trace union_lo_late small_floor small_w8 epilogue_ab
#           union_ex2 union_cv union_waves
#           split_count union_splits dims_ab
#   VARIANTS="now lsu" bash bench/h200_run.sh variants   # time only these variants
#   BASELINE=bench/results/bench-....json                # compare with (default: the newest unflagged file
#                                                        # in bench/results from a GPU of the same name)
# Every step runs under a timeout that ends it by DEADLINE seconds after the start (default 570:
# the device call's limit is 600 s), so the logs of the steps before it always come back.
# Files in $OUT (at most 8 come back): gpu-tests.log memcheck.log racecheck.log selftest.log
# bench.log bench-<date>.json bench-<date>.png ceilings-<date>.json (ceilings' log: its tail only).
# bench_union / bench_kernel_merge name theirs bench-<date>-union.json, bench-union.log (-kernel-merge likewise).
set -uo pipefail
source bench/device_env.sh
START=$(date +%s)
trap 'rm -f $OUT/.step-start' EXIT  # the flagged bench steps' marker (it would come back as a file)
DEADLINE=${DEADLINE:-570}
# globbed in tests/; tests/test_device_scripts.py checks that every file with GPU tests is run by a step here
GPU_TESTS="test_kernel_gpu.py test_planner.py test_torch_op.py test_op_fast_path.py test_nvfp4*.py test_engine*.py test_vllm_plugin.py test_bench.py test_examples.py test_multi_gpu.py"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

# limit STEP_SECONDS: the step's own cap, cut to what is left before DEADLINE
limit() { local left=$(( DEADLINE - ($(date +%s) - START) )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
# checked_union_builds BUILD...: bench/union_check.py on each .kv-variants build (log union-check-BUILD.log);
# the builds that pass go into CHECKED, for the timing that follows
checked_union_builds() {
  CHECKED=()
  local v rc
  for v in "$@"; do
    timeout "$(limit 40)" python3 bench/union_check.py --dir .kv-variants --variants "$v" \
      > $OUT/union-check-$v.log 2>&1; rc=$?; echo "union check $v: rc=$rc"; tail -n 1 $OUT/union-check-$v.log
    (( rc == 0 )) && CHECKED+=("$v")
  done
}

for step in "$@"; do
  t0=$(date +%s); touch $OUT/.step-start
  case $step in
    tests) (cd tests && timeout "$(limit 240)" python3 -m pytest $GPU_TESTS -m gpu -q -rA) > $OUT/gpu-tests.log 2>&1
           tail -n 1 $OUT/gpu-tests.log ;;
    memcheck) (cd tests && timeout "$(limit 180)" compute-sanitizer --tool memcheck --error-exitcode 9 python3 gpu_memcheck.py) \
               > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?" | tee -a $OUT/memcheck.log ;;
    racecheck) (cd tests && timeout "$(limit 240)" compute-sanitizer --tool racecheck --error-exitcode 9 python3 gpu_memcheck.py) \
                > $OUT/racecheck.log 2>&1; echo "racecheck rc=$?" | tee -a $OUT/racecheck.log; tail -n 3 $OUT/racecheck.log ;;
    selftest) timeout "$(limit 240)" python3 -m msa_jit selftest --no-bench --out $OUT > $OUT/selftest.log 2>&1
              echo "selftest rc=$?" | tee -a $OUT/selftest.log; tail -n 2 $OUT/selftest.log ;;
    union_tests) # the union kernel, the planner pinned to it (tests/test_union_gpu.py); needs its builds in
                 # .artifacts (bench/warm_kv_formats.py makes them)
           # after union_k8 in the same run: only if a probe build (the same PTX) passed its own check
           if [[ -n ${UNION_RAN:-} && ${#UNION_OK[@]} -eq 0 ]]; then
             echo "union_tests skipped: no union build passed union_check" | tee $OUT/union-tests.log
           else
             (cd tests && timeout "$(limit 240)" python3 -m pytest test_union_gpu.py -m gpu -q -rA) > $OUT/union-tests.log 2>&1
             tail -n 1 $OUT/union-tests.log
           fi ;;
    cluster_tests) # the cluster split merge, the planner pinned to it (tests/test_cluster_merge_gpu.py); its builds
           # in .artifacts (bench/warm_kv_formats.py makes them)
           (cd tests && timeout "$(limit 200)" python3 -m pytest test_cluster_merge_gpu.py -m gpu -q -rA) > $OUT/cluster-tests.log 2>&1
           tail -n 1 $OUT/cluster-tests.log ;;
    bench|bench_quick|bench_union|bench_kernel_merge) # the baseline: the newest default bench of this GPU's name
           # (an H100's timings do not compare with an H200's); a flagged run's file is renamed *-union* /
           # *-kernel-merge* when committed (*-cluster* / *-opt-in*: session 20-21's, flags on before the default
           # changed), so the flagged runs' regression rows compare with the default kernels
           BASELINE=${BASELINE:-$(python3 -c 'import shutil, tempfile, glob, torch
from msa_jit.tools.bench import latest_result
d = tempfile.mkdtemp()
for f in glob.glob("bench/results/bench-*.json"):
    any(t in f for t in ("-union", "-cluster", "-opt-in", "-kernel-merge")) or shutil.copy(f, d)
b = latest_result(d, torch.cuda.get_device_name())
print("bench/results/" + b.name if b else "none")')}
           # bench_union: the planner may give the union kernel every draft length (MSA_JIT_ENABLE_SM90_UNION=1;
           # rows say "kernel"); the other steps leave it unset: the planner's rule, the op as shipped
           UNION=$([ "$step" = bench_union ] && echo 1 || echo "")
           # bench_kernel_merge: the default before session 21, every split merged by the second kernel
           # (MSA_JIT_ENABLE_CLUSTER_MERGE=0; rows say "split_merge")
           CLUSTER=$([ "$step" = bench_kernel_merge ] && echo 0 || echo 1)
           # a flagged run's files take its flag's suffix, so several bench steps fit one call:
           # bench-<date>-union.json / .png and bench-union.log (bench_kernel_merge: -kernel-merge); the
           # log is named before the run, so a later bench step cannot overwrite an earlier one's log
           sfx=""; [[ $step == bench_union || $step == bench_kernel_merge ]] && { sfx=${step#bench_}; sfx=-${sfx//_/-}; }
           log=$OUT/bench$sfx.log
           env -u MSA_JIT_ENABLE_SM90_UNION ${UNION:+MSA_JIT_ENABLE_SM90_UNION=$UNION} MSA_JIT_ENABLE_CLUSTER_MERGE=$CLUSTER \
             timeout "$(limit 330)" python3 -m msa_jit bench --out $OUT --baseline "$BASELINE" \
             $([ "$step" = bench_quick ] && echo --quick) > $log 2>&1
           echo "bench rc=$?" | tee -a $log; grep -E "^REGRESSION|FAILED" $log | head -n 20
           sed -n '/^| issue | target/,$p' $log
           if [[ -n $sfx ]]; then
             for f in $(find $OUT -maxdepth 1 -newer $OUT/.step-start -name 'bench-*' \( -name '*.json' -o -name '*.png' \)); do
               mv "$f" "${f%.*}$sfx.${f##*.}"
             done
           fi ;;
    ceilings) timeout "$(limit 90)" python3 bench/ceilings.py --out $OUT 2>&1 | tail -n 12 ;;
    variants) python3 bench/variants.py run --dir .variants --out $OUT ${VARIANTS:+--variants $VARIANTS} 2>&1 | tee $OUT/variants.log | tail -n 40 ;;
    trace) python3 bench/trace_ctas.py --dir .variants --out $OUT ${TRACES:+--variants $TRACES} 2>&1 | tee $OUT/trace.log | tail -n 8 ;;
    per_layer_ab) python3 bench/per_layer_ab.py --out $OUT 2>&1 | tee $OUT/per-layer-ab.log | tail -n 26 ;;
    host_ab|host_ab_union) timeout "$(limit 60)" python3 bench/host_ab.py --out $OUT \
               $([ "$step" = host_ab_union ] && echo --union) 2>&1 | tail -n 50 ;;
    union_k8) # bench/union_fp8.py (carry .kv-variants built by: python bench/kv_format_ab.py build --variants
              # f_c3 f_union_k8 f_union_k8_cv f_union_k8_w1 f_union_k8_noconv q8_f_c3 q8_union q8_union_cv q8_union_w1
              # q8_union_noconv). One union_check process per build, so a build that hangs or faults costs only
              # its own check; only the builds that pass are timed (and union_k8_small after it times those)
              UNION_OK=(); UNION_RAN=1
              for v in f_union_k8 f_union_k8_cv f_union_k8_w1 q8_union q8_union_cv q8_union_w1; do
                timeout "$(limit 60)" python3 bench/union_check.py --dir .kv-variants --variants "$v" \
                  >> $OUT/union-k8-check.log 2>&1
                rc=$?; (( rc == 0 )) && UNION_OK+=("$v"); echo "union check $v: rc=$rc"
              done
              tail -n 2 $OUT/union-k8-check.log
              probes=()
              [[ " ${UNION_OK[*]} " == *" f_union_k8 "* ]] && probes+=(f_union_k8_noconv)
              [[ " ${UNION_OK[*]} " == *" q8_union "* ]] && probes+=(q8_union_noconv)
              keep=(); (( ${#probes[@]} )) && keep=(--keep "${probes[@]}")
              if (( ${#UNION_OK[@]} )); then
                timeout "$(limit 330)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 5 \
                  --variants f_c3 q8_f_c3 "${UNION_OK[@]}" "${probes[@]}" "${keep[@]}" \
                  --points 64/4:64:4:12 64/4:64:4:0 64/4:64:2:12 64/4:64:8:12 8/1:256:4:12 2>&1 | grep -v "^{" | tail -n 12
              fi ;;
    union_skip) # rows 71-73: the 2-CTA union builds (warps skip the softmax of rows that did not select a
              # block; row 72's softmax; row 73's V half) against session 16's (s16_*, from 7d847e8), row 71's alone
              # (s17a_*, from 59db2ff), row 72's bf16 build (s17b_*, from ac1fc60) and the stream-and-MMA probes
              # (build: python bench/kv_format_ab.py build --variants f_c3 f_union_k8_w1 q8_union_w1
              # f_union_k8_w1_noconv q8_union_w1_noconv f_union_k8_w1_trace q8_union_w1_trace)
              ok=()
              for v in f_union_k8_w1 q8_union_w1; do
                timeout "$(limit 60)" python3 bench/union_check.py --dir .kv-variants --variants "$v" \
                  >> $OUT/union-skip-check.log 2>&1
                rc=$?; (( rc == 0 )) && ok+=("$v"); echo "union check $v: rc=$rc"
              done
              tail -n 2 $OUT/union-skip-check.log
              timeout "$(limit 330)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 5 \
                --variants f_c3 s16_f_union_k8_w1 s16_q8_union_w1 s17a_f_union_k8_w1 s17a_q8_union_w1 s17b_f_union_k8_w1 "${ok[@]}" f_union_k8_w1_noconv q8_union_w1_noconv \
                --keep f_union_k8_w1_noconv q8_union_w1_noconv \
                --points 64/4:64:4:12 64/4:64:4:0 64/4:64:2:12 64/4:64:8:12 8/1:256:4:12 8/1:256:4:0 2>&1 \
                | grep -v "^{" | tail -n 12
              for v in ${TRACES:-f_union_k8_w1_trace:bfloat16 q8_union_w1_trace:float8_e4m3fn}; do  # where a block's time goes
                timeout "$(limit 60)" python3 bench/union_trace.py --out $OUT --warpgroups 1 --q-dtype ${v#*:} \
                  --so .kv-variants/${v%:*}/64x4/sparse_decode.so > $OUT/${v%:*}.log 2>&1; tail -n 10 $OUT/${v%:*}.log
              done ;;
    union_qreg) # row 74: the bf16 2-CTA build with Q's lo tile in registers and a whole V tile against row 73's
              # (v_halves) and the fp8 query's (build: python bench/kv_format_ab.py build --variants f_c3
              # f_union_k8_w1 q8_union_w1 f_union_k8_w1_qreg f_union_k8_w1_qreg_noconv)
              timeout "$(limit 60)" python3 bench/union_check.py --dir .kv-variants --variants f_union_k8_w1_qreg \
                > $OUT/union-qreg-check.log 2>&1; echo "union check f_union_k8_w1_qreg: rc=$?"; tail -n 1 $OUT/union-qreg-check.log
              timeout "$(limit 200)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 5 \
                --variants f_c3 f_union_k8_w1 q8_union_w1 f_union_k8_w1_qreg f_union_k8_w1_qreg_noconv \
                --keep f_union_k8_w1_qreg_noconv \
                --points 64/4:64:4:12 64/4:64:4:0 64/4:64:2:12 64/4:64:8:12 8/1:256:4:12 8/1:256:4:0 2>&1 \
                | grep -v "^{" | tail -n 3 ;;
    union_qreg_trace) # row 74's build traced beside the fp8 query's (why its V conversion costs 4.6 us per
              # layer against 1.3; build: f_union_k8_w1_qreg_trace q8_union_w1_trace)
              for v in f_union_k8_w1_qreg_trace:bfloat16 q8_union_w1_trace:float8_e4m3fn; do
                timeout "$(limit 60)" python3 bench/union_trace.py --out $OUT --warpgroups 1 --q-dtype ${v#*:} \
                  --so .kv-variants/${v%:*}/64x4/sparse_decode.so > $OUT/${v%:*}.log 2>&1; tail -n 10 $OUT/${v%:*}.log
              done ;;
    union_lo) # what the bf16 build's second K read (the lo tile's QGMMA chain) costs beside V's conversion
              # (timing probes, wrong results), and V's conversion by the bit trick / half each way (exact; build:
              # f_c3 f_union_k8_w1_qreg f_union_k8_w1_qreg_noconv f_union_k8_w1_qreg_nolo f_union_k8_w1_qreg_nolo_noconv
              # f_union_k8_w1_qreg_trick f_union_k8_w1_qreg_mixed q8_union_w1 q8_union_w1_noconv q8_union_w1_mixed)
              timeout "$(limit 220)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 5 \
                --variants f_c3 f_union_k8_w1_qreg f_union_k8_w1_qreg_noconv f_union_k8_w1_qreg_nolo \
                f_union_k8_w1_qreg_nolo_noconv f_union_k8_w1_qreg_trick f_union_k8_w1_qreg_mixed \
                q8_union_w1 q8_union_w1_noconv q8_union_w1_mixed \
                --keep f_union_k8_w1_qreg_noconv f_union_k8_w1_qreg_nolo f_union_k8_w1_qreg_nolo_noconv q8_union_w1_noconv \
                --points 64/4:64:4:12 64/4:64:4:0 2>&1 | grep -v "^{" | tail -n 3 ;;
    union_lo_late) # session 25: the bf16 2-CTA union build with S's lo QGMMA chain issued after r of V's 8 converted
              # rows (lo_at r: 0, 4, 8; bench/union_fp8.py) instead of beside the hi chain, checked, then timed
              # against main's build then (s26_f_union_k8_w1_qreg since row 84 shipped lo 0), the fp8-query build and the
              # token kernel (build: f_c3 s26_f_union_k8_w1_qreg
              # f_union_k8_w1_qreg_lo0 f_union_k8_w1_qreg_lo4 f_union_k8_w1_qreg_lo8 q8_union_w1)
              checked_union_builds f_union_k8_w1_qreg_lo0 f_union_k8_w1_qreg_lo4 f_union_k8_w1_qreg_lo8
              timeout "$(limit 200)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 5 \
                --variants f_c3 s26_f_union_k8_w1_qreg q8_union_w1 "${CHECKED[@]}" \
                --points 64/4:64:4:12 64/4:64:4:0 8/1:256:4:12 64/4:64:2:12 2>&1 | grep -v "^{" | tail -n 4
              # where each block's time goes, main's build and lo_at 8 (f_union_k8_w1_qreg_trace, ..._lo8_trace; since
              # row 84 the first is lo 0's)
              for v in f_union_k8_w1_qreg_trace f_union_k8_w1_qreg_lo8_trace; do
                timeout "$(limit 45)" python3 bench/union_trace.py --out $OUT --warpgroups 1 \
                  --so .kv-variants/$v/64x4/sparse_decode.so > $OUT/$v.log 2>&1; echo "trace $v: rc=$?"; tail -n 9 $OUT/$v.log
              done ;;
    union_ex2) # session 27: row 84's A/B (the shipped bf16 2-CTA union build, lo chain behind V's loads, against
              # s26_f_union_k8_w1_qreg, the build before it) and row 85 (ex2_poly n: n of every 16 P elements' 2**x
              # on the FMA pipe; slower on the H200, session 29), every build checked first, then timed with the token kernel
              # (build: f_c3 f_union_k8_w1_qreg f_union_k8_w1_qreg_ex2p2 f_union_k8_w1_qreg_ex2p3 f_union_k8_w1_qreg_ex2p4
              # f_union_k8_w1_qreg_ex2p6 q8_union_w1 q8_union_w1_ex2p3; s26_f_union_k8_w1_qreg from a checkout of 8871a82)
              checked_union_builds f_union_k8_w1_qreg f_union_k8_w1_qreg_ex2p2 f_union_k8_w1_qreg_ex2p3 f_union_k8_w1_qreg_ex2p4 \
                       f_union_k8_w1_qreg_ex2p6 q8_union_w1_ex2p3
              timeout "$(limit 300)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds ${ROUNDS:-5} \
                --variants f_c3 s26_f_union_k8_w1_qreg q8_union_w1 "${CHECKED[@]}" \
                --points 64/4:64:4:12 64/4:64:4:0 8/1:256:4:12 64/4:64:2:12 2>&1 | grep -v "^{" | tail -n 4 ;;
    union_cv) # session 30 (row 86): V converted by a second warpgroup of the 2-CTA union build (v_converter), checked,
              # then timed against the shipped builds and the token kernel, then traced
              # (build: f_c3 f_union_k8_w1_qreg q8_union_w1 f_union_k8_w1_qreg_cv q8_union_w1_cv f_union_k8_w1_qreg_cv_trace;
              # f_union_k8_w1_qreg in a checkout of 5986f3e since session 31)
              checked_union_builds f_union_k8_w1_qreg_cv q8_union_w1_cv
              timeout "$(limit 200)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds ${ROUNDS:-5} \
                --variants f_c3 f_union_k8_w1_qreg q8_union_w1 "${CHECKED[@]}" \
                --points 64/4:64:4:12 64/4:64:4:0 8/1:256:4:12 64/4:64:2:12 64/4:64:8:12 2>&1 | grep -v "^{" | tail -n 4
              for v in f_union_k8_w1_qreg_cv_trace; do
                timeout "$(limit 45)" python3 bench/union_trace.py --out $OUT --warpgroups 1 \
                  --so .kv-variants/$v/64x4/sparse_decode.so > $OUT/$v.log 2>&1; echo "trace $v: rc=$?"; tail -n 9 $OUT/$v.log
              done ;;
    union_waves) # session 31: the union against the token kernel by the union grid's share of a wave, no block
              # shared (the data of planner.choose_kernel's rule): one union-waves-<date>-<gpu>.json
              timeout "$(limit 200)" python3 bench/union_waves.py run --out $OUT 2>&1 | tail -n 62 ;;
    small_floor) # session 25: row 65's decomposition of today's small-batch build (2 CTAs per SM, the cluster merge):
              # full / stream alone (no math) / math alone (no copy) / chain and bytes alone (probe "stream": no math,
              # no epilogue), the merge kernel's build and its stream alone, and #19's floor probe (--floor), one
              # process; the no-math epilogue cut after the reduction / after the pushes and the merging CTA's wait
              # (build: f_c2_cm f_c2_cm_nomath f_c2_cm_nocopy f_c2_cm_stream f_c2 f_c2_stream f_c2_cm_reduce f_c2_cm_push f_c2_cm_bars f_c2_cm_alu_unrolled f_c2_cm_alu_loop)
              timeout "$(limit 220)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 7 --floor \
                --variants f_c2_cm f_c2_cm_nomath f_c2_cm_nocopy f_c2_cm_stream f_c2 f_c2_stream f_c2_cm_reduce f_c2_cm_push f_c2_cm_bars f_c2_cm_alu_unrolled f_c2_cm_alu_loop \
                --keep f_c2_cm_nomath f_c2_cm_nocopy f_c2_cm_stream f_c2_stream f_c2_cm_reduce f_c2_cm_push f_c2_cm_bars f_c2_cm_alu_unrolled f_c2_cm_alu_loop \
                --points 64/4:1:1 8/1:1:1 8/1:4:1 64/4:4:1 2>&1 | grep -v "^{" | tail -n 3 ;;
    dims_ab) # session 33 (row 89, bench/dims_split.py): P V split by head dims (no 4-warp reduction) against today's
              # cluster build at the points the planner gives it, and at two it does not (64/4 B=4: merge kernel path;
              # qlen 2), each checked first, with #19's floor probe (build: f_c2_cm f_c2_cm_dims f_c2_cm_dims_pad
              # f_c2_cm_dims_pad32 q8_c2_cm q8_c2_cm_dims_pad q8_c2_cm_dims_pad32); DIMS_VARIANTS / DIMS_POINTS override them
              timeout "$(limit 260)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 7 --floor \
                --variants ${DIMS_VARIANTS:-f_c2_cm f_c2_cm_dims f_c2_cm_dims_pad f_c2_cm_dims_pad32 q8_c2_cm \
                q8_c2_cm_dims_pad q8_c2_cm_dims_pad32} --points ${DIMS_POINTS:-64/4:1:1 8/1:1:1 8/1:4:1 64/4:1:2 64/4:4:1} 2>&1 \
                | python3 -c "import sys,json
for l in sys.stdin:
    if l.startswith('{'):
        r=json.loads(l); print(r['variant'], r['geometry'], r['batch'], r['qlen'], r['num_splits'], r['step_us'], r['marginal_us'])
    else: print(l.rstrip())" | tail -n 45 ;;
    small_w8) # session 25: row 50's 8 consumer warps (1 CTA per SM) with the cluster merge against today's 2-CTA build,
              # and both without math, at the points the cluster merge serves (build: f_c2_cm f_w8_cm f_c2_cm_nomath
              # f_w8_cm_nomath)
              timeout "$(limit 150)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 9 \
                --variants f_c2_cm f_w8_cm f_c2_cm_nomath f_w8_cm_nomath --keep f_c2_cm_nomath f_w8_cm_nomath \
                --points 64/4:1:1 8/1:1:1 8/1:4:1 64/4:1:2 2>&1 | grep -v "^{" | grep -v "^check .*_nomath" | tail -n 6 ;;
    epilogue_ab) # session 25 (row 82): the epilogue without the row max before the O rows' stores, and the cluster
              # merge's routing by shift and mask, against session 24's kernels (s24_*, built at a09cf24), checked and
              # timed at the small-batch points and one one-split point (build: f_c2_cm f_c3 n_c2_cm n_c3s3 q8_c2_cm,
              # and s24_* of each in a checkout of a09cf24)
              timeout "$(limit 240)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 7 \
                --variants s24_f_c2_cm f_c2_cm s24_f_c3 f_c3 s24_n_c2_cm n_c2_cm s24_n_c3s3 n_c3s3 s24_q8_c2_cm q8_c2_cm \
                --points 64/4:1:1 8/1:1:1 8/1:4:1 64/4:4:1 8/1:16:1 64/4:16:1 64/4:1:4 64/4:64:1 2>&1 | grep -v "^{" | tail -n 12 ;;
    union_final) # session 18's candidate (branch wip/union-s18, b251ec4: Q's loads first, P V under the next S,
              # V's loads 8 rows ahead; s18d) checked and timed against each step before it: s18a (58c756b, main's
              # build), s18b (+ Q first, c8f3b16; _ahead8: + V's loads ahead), s18c (+ P V overlap, 0f5e99e).
              # Build: f_c3, then each s18* in a checkout of its commit (docs/gpu-workflow.md "The next run")
              mkdir -p $OUT/final
              for v in s18d_f_union_k8_w1_qreg s18d_q8_union_w1 s18b_f_union_k8_w1_qreg_ahead8 s18c_f_union_k8_w1_qreg; do
                timeout "$(limit 60)" python3 bench/union_check.py --dir .kv-variants --variants "$v" \
                  >> $OUT/final/union-check.log 2>&1; echo "union check $v: rc=$?"
              done
              timeout "$(limit 150)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 5 \
                --variants f_c3 s18a_f_union_k8_w1_qreg s18a_q8_union_w1 s18b_f_union_k8_w1_qreg s18b_q8_union_w1 \
                s18b_f_union_k8_w1_qreg_ahead8 s18b_q8_union_w1_ahead8 s18c_f_union_k8_w1_qreg s18c_q8_union_w1 \
                s18d_f_union_k8_w1_qreg s18d_q8_union_w1 --points 64/4:64:4:12 64/4:64:4:0 8/1:256:4:12 2>&1 \
                | grep -v "^{" | tail -n 3
              for v in s18d_f_union_k8_w1_qreg_trace:bfloat16 s18d_q8_union_w1_trace:float8_e4m3fn; do
                timeout "$(limit 60)" python3 bench/union_trace.py --out $OUT/final --warpgroups 1 --q-dtype ${v#*:} \
                  --so .kv-variants/${v%:*}/64x4/sparse_decode.so > $OUT/final/${v%:*}.log 2>&1; tail -n 10 $OUT/final/${v%:*}.log
              done
              tar czf $OUT/union-final.tgz -C $OUT final && rm -rf $OUT/final ;;
    push_merge) # row 79: the split merge inside the decode launch (branch wip/push-merge, acaabd9: s19p_*, built there
              # as f_c2_cm / n_c2_cm / q8_c2_cm), checked at every split factor beside the merge kernel's build, timed
              # against the 2-CTA builds at the split shapes (64/4 B=64: one split, the same path), and the op call's
              # CPU with it (host_ab's op_fused, its GPU time gpu_us_op_fused)
              mkdir -p $OUT/push
              timeout "$(limit 90)" python3 bench/split_check.py --dir .kv-variants --out $OUT/push \
                --variants s19p_f_c2_cm s19p_q8_c2_cm s19p_n_c2_cm f_c2 > $OUT/push/split-check.log 2>&1
              echo "split check: rc=$?"; tail -n 1 $OUT/push/split-check.log
              # f_c3: the build the planner gives the split grids above T*Hkv = 8 (does a 2-CTA cluster build beat it?);
              # the rows also go to the tarball as they come, so a timeout keeps the points done
              timeout "$(limit 260)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 5 \
                --variants f_c2 s19p_f_c2_cm f_c3 q8_c2 s19p_q8_c2_cm n_c2 s19p_n_c2_cm \
                --points 64/4:1:1 8/1:1:1 8/1:4:1 64/4:4:1 64/4:1:4 8/1:16:1 64/4:16:1 64/4:64:1 2>&1 \
                | tee $OUT/push/kv-format-ab.log | grep -v "^{" | tail -n 3
              timeout "$(limit 120)" python3 bench/host_ab.py --out $OUT/push --rounds 9 \
                --fused-so .kv-variants/s19p_f_c2_cm/64x4/sparse_decode.so > $OUT/push/host-ab.log 2>&1
              echo "host_ab: rc=$?"; grep -E "^64/4|op_new |op_fused|torch_add|ffi_floor" $OUT/push/host-ab.log
              tar czf $OUT/push-merge.tgz -C $OUT push && rm -rf $OUT/push ;;
    push_trace) # row 79's per-CTA timelines: the cluster-merge build (s20_trace_cm, variants.py trace_cm built on
              # wip/push-merge 872d03b) against the 2-CTA build with the merge kernel (trace, built on main) at the
              # split shapes the planner gives 2 CTAs per SM (and 64/4 B=4 pinned there): when the CTAs of a
              # cluster enter, how long the merging ranks wait for their peers (epilogue_by_rank_us)
              timeout "$(limit 150)" python3 bench/trace_ctas.py --dir .kv-variants --out $OUT --replays 9 \
                --variants s20_trace_cm trace --points 64/4:1:1 8/1:1:1 8/1:4:1 64/4:4:1 2>&1 \
                | tee $OUT/push-trace.log | cut -c1-400 | tail -n 9 ;;
    union_ncu) # Nsight Compute of the bf16 (q_lo_regs) and fp8-query 2-CTA union builds at the spec-decode point:
              # pipes, shared-memory wavefronts and bank conflicts, stall reasons, per-instruction samples
              for v in f_union_k8_w1_qreg:bfloat16 q8_union_w1:float8_e4m3fn; do
                n=ncu-${v%:*}
                PROFILE_Q=${v#*:} timeout "$(limit 120)" ncu --clock-control none -k regex:kernel_cutlass_kernel -c 1 \
                  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
                  --section WarpStateStats --section SchedulerStats --section SourceCounters \
                  --metrics "regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*.avg.pct_of_peak_sustained_active" \
                  -o $OUT/$n python3 bench/profile_point.py 64/4 64 4 12 .kv-variants/${v%:*}/64x4/sparse_decode.so \
                  > $OUT/$n.log 2>&1; echo "ncu ${v%:*}: rc=$?"; tail -n 2 $OUT/$n.log
                ncu -i $OUT/$n.ncu-rep --page details > $OUT/$n-details.txt 2>&1
                ncu -i $OUT/$n.ncu-rep --page source --csv --print-source sass > $OUT/$n-source.csv 2>&1
                gzip -f $OUT/$n-source.csv; ls -la $OUT/$n*
              done ;;
    union_k8_trace) # where the fp8-K kernel's MMA warpgroups wait, per block (built: f_union_k8_trace)
              timeout "$(limit 90)" python3 bench/union_trace.py --out $OUT \
                --so .kv-variants/f_union_k8_trace/64x4/sparse_decode.so 2>&1 | tail -n 11 ;;
    union_k8_small) # the same kernels at qlen 1: the split shapes (batch 1-16: a tile of one token, the plan's
              # splits over its blocks, then the split merge) and the T*Hkv = 256 points (one token per CTA,
              # two waves at 1 CTA per SM, one at 2: the _w1 builds), against the planner's 2- and 3-CTA builds
              small=(f_union_k8 f_union_k8_cv f_union_k8_w1)  # after union_k8 in the same run: those that passed
              [[ -n ${UNION_RAN:-} ]] && small=($(printf '%s\n' "${UNION_OK[@]}" | grep -x -e f_union_k8 -e f_union_k8_cv \
                                                    -e f_union_k8_w1))
              (( ${#small[@]} )) || { echo "union_k8_small skipped: no bf16 union build passed its check"; continue; }
              timeout "$(limit 330)" python3 bench/kv_format_ab.py run --dir .kv-variants --out $OUT --rounds 5 \
                --variants f_c2 f_c3 "${small[@]}" \
                --points 64/4:1:1 8/1:1:1 64/4:4:1 8/1:4:1 64/4:16:1 8/1:16:1 64/4:64:1 8/1:256:1 2>&1 | grep -v "^{" | tail -n 8 ;;
    split_count) # session 26: fewer, longer splits at the small-batch split shapes (T*Hkv = 16-128), against the
              # planner's plans and the floor probe (SPLIT_SET: bench/split_count_ab.py's point sets)
              timeout "$(limit 300)" python3 bench/split_count_ab.py --out $OUT --rounds ${ROUNDS:-5} ${SPLIT_KV:+--kv $SPLIT_KV} \
                ${SPLIT_SET:+--set $SPLIT_SET} \
                2>&1 | tee $OUT/split-count-ab.log | grep -v "^{" | tail -n 30 ;;
    union_splits) # session 32: the union kernel in 1-8 splits where its unsplit grid is a partial wave, against the
              # token kernel, no block shared and 12/16 (docs/open-targets.md item 1; bench/split_count_ab.py --set union)
              timeout "$(limit 300)" python3 bench/split_count_ab.py --out $OUT --rounds ${ROUNDS:-5} --set union --shared 0 12 \
                2>&1 | tee $OUT/union-splits.log | grep -v "^{" | tail -n 40 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s (total $(( $(date +%s) - START )) s)"
done
