#!/usr/bin/env bash
# One call on the GPU host: the GPU test suite, the sanitizers, selftest and the bench, each step
# under a timeout that ends it DEADLINE seconds after the start (the call's limit is 600 s), so the
# logs of the steps before it always come back. Run from the repository root there, with these
# git-ignored folders carried: .gpu-bundle (the DSL runtime: ../shared/gpu-host/make-bundle.sh) and
# .artifacts (a warmed cache: python bench/warm_device_cache.py --cache-dir .artifacts); host_path
# also needs vLLM 0.33.0's files in .engine-src (a copy of tests/vllm_files.py's cache folder); plan_ab
# times FlashInfer beside msa-jit's plans when .fi-bundle is carried (bench/peers/make_flashinfer_bundle.sh).
#   bash bench/device_run.sh tests union_tests cluster_tests memcheck racecheck selftest bench host_path peers plan_ab plan_ab_nvfp4
#   VARIANT=<name>[,<name>] bash bench/device_run.sh tree_ab   # variant trees against this one (bench/tree_ab.py)
#   bash bench/device_run.sh suite      # then, in a second call: memcheck racecheck selftest
# The six correctness steps do not fit one 600 s call even at once (on an H100, three concurrent streams
# got ~85% through in 430 s: they share one GPU), so `suite` runs the GPU tests beside the union and
# cluster tests, and the sanitizers and selftest (~250 s alone) take a call of their own.
# Files in $OUT (at most 8 come back): <step>.log, the bench's (and peers') bench-<date>.json / .png,
# host_path.json, plan_ab.json, plan_ab_nvfp4.json (PLAN_AB_ARGS, PLAN_AB_NVFP4_ARGS: their points; PLAN_AB_S:
# each one's cap, 560 s). peers needs .fi-bundle and .engine-src carried (PEERS_ARGS replaces its grid).
# tree_ab.tar.gz: tree_ab's runs (AB_GRID replaces its grid; AB_ROUNDS, AB_STEP_S, AB_ITERS), read by
# `python bench/tree_ab.py report`.
set -uo pipefail
source .gpu-bundle/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-} MSA_JIT_CACHE_DIR=$PWD/.artifacts MSA_JIT_NO_COMPILE=1 PYTHONUNBUFFERED=1
export MSA_JIT_DSL_VERSION=${MSA_JIT_DSL_VERSION:-4.8.1}  # the bundle has no DSL package metadata
[ -d .engine-src ] && export MSA_JIT_TEST_ENGINE_DIR=${MSA_JIT_TEST_ENGINE_DIR:-$PWD/.engine-src}
START=$(date +%s)
DEADLINE=${DEADLINE:-570}
FAILED=0  # exit 1 once a step failed: every step still runs
# the files with GPU tests that `tests` runs (union_tests and cluster_tests run their own file);
# tests/test_device_run.py checks that every file with GPU tests is run by some step
GPU_TESTS="test_kernel_gpu.py test_planner.py test_torch_op.py test_op_fast_path.py test_nvfp4*.py test_engine*.py
           test_vllm_plugin.py test_bench.py test_examples.py test_multi_gpu.py"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

# limit SECONDS: the step's own cap, cut to what is left before DEADLINE
limit() { local left=$(( DEADLINE - ($(date +%s) - START) )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
done_step() { echo "$1: rc=$2"; (( $2 == 0 )) || FAILED=1; }
gpu_pytest() {  # gpu_pytest LOG SECONDS PATTERNS...: the GPU cases of the test files PATTERNS name
  local log=$1 secs=$2; shift 2
  # the patterns are globbed inside tests/ (unquoted $* on purpose)
  (cd tests && timeout "$(limit "$secs")" python3 -m pytest $* -m gpu -q -rA) > "$OUT/$log" 2>&1
  done_step "$log" $?; tail -n 1 "$OUT/$log"
}
sanitize() {  # sanitize TOOL: adversarial inputs under compute-sanitizer (tests/gpu_memcheck.py)
  (cd tests && timeout "$(limit 200)" compute-sanitizer --tool "$1" --error-exitcode 9 python3 gpu_memcheck.py) \
    > "$OUT/$1.log" 2>&1
  local rc=$?; echo "$1: rc=$rc" >> "$OUT/$1.log"; done_step "$1" $rc; tail -n 3 "$OUT/$1.log"
}

plan_ab() {  # plan_ab NAME ARGS...: bench/plan_ab.py into $OUT/NAME.json and NAME.log, at most PLAN_AB_S seconds
  local name=$1; shift
  # FlashInfer's setup only in this step's subshell (its PYTHONPATH stays out of the others); the
  # script's own deadline (counted after the setup) ends it before the timeout, so its table and JSON
  # are written
  ( set +u; [ -f .fi-bundle/setup.sh ] && source .fi-bundle/setup.sh >/dev/null
    left=$(limit "${PLAN_AB_S:-560}")
    timeout "$left" python3 bench/plan_ab.py --json "$OUT/$name.json" \
      --deadline-s $(( left > 40 ? left - 20 : left / 2 )) "$@" ) > "$OUT/$name.log" 2>&1
  done_step "$name" $?; tail -n 70 "$OUT/$name.log"
}

tree_ab() {  # bench/tree_ab.py's runs: this tree and each carried .variant-<name> of VARIANT (a comma list) in
  # turn, AB_ROUNDS times, FlashInfer beside every run; each run capped at AB_STEP_S seconds (a run cut short keeps
  # the rows it finished), all of them in $OUT/tree_ab.tar.gz
  local dir=$OUT/tree_ab rc bad=0 trees=(base) v
  local names=${VARIANT:-}
  for v in ${names//,/ }; do trees+=("$v"); done
  for v in "${trees[@]:1}"; do
    [ -d ".variant-$v" ] || { echo "tree_ab: .variant-$v not carried (python bench/tree_ab.py prepare $v ...)"
                              done_step tree_ab 2; return; }
  done
  if (( ${#trees[@]} < 2 )); then
    echo "tree_ab: VARIANT=<name>[,<name>...] and each .variant-<name> carried (python bench/tree_ab.py prepare ...)"
    done_step tree_ab 2; return
  fi
  mkdir -p "$dir"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$dir/gpu.txt"
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for tree in "${trees[@]}"; do
      local src=$PWD cache=$PWD/.artifacts
      [ "$tree" = base ] || { src=$PWD/.variant-$tree; cache=$src/.artifacts; }
      ( set +u; [ -f .fi-bundle/setup.sh ] && source .fi-bundle/setup.sh >/dev/null
        cd "$src" && PYTHONPATH=$src:$PYTHONPATH MSA_JIT_CACHE_DIR=$cache timeout "$(limit "${AB_STEP_S:-120}")" \
          python3 -m msa_jit bench --out "$dir/$tree-$round" --baseline none --compare flashinfer --no-host \
          --floor-batch '' --iters "${AB_ITERS:-20}" ${AB_GRID:---heads 64/4,16/1 --batch 4,16,128,256 \
          --decode-query-len 1,4 --kv-dtype fp8} ) > "$dir/$tree-$round.log" 2>&1
      rc=$?; echo "tree_ab $tree-$round: rc=$rc"
      (( rc == 0 || rc == 124 )) || bad=1  # 124: the cap ended it; its finished rows are written
    done
  done
  (cd "$OUT" && tar czf tree_ab.tar.gz tree_ab && rm -rf tree_ab)
  done_step tree_ab $bad
}

run_step() {  # run_step STEP
  local step=$1
  case $step in
    tests) gpu_pytest gpu-tests.log 540 $GPU_TESTS ;;
    union_tests) gpu_pytest union-tests.log 240 test_union_gpu.py ;;
    cluster_tests) gpu_pytest cluster-tests.log 200 test_cluster_merge_gpu.py ;;
    memcheck|racecheck) sanitize "$step" ;;
    selftest) timeout "$(limit 240)" python3 -m msa_jit selftest --no-bench --out "$OUT" > "$OUT/selftest.log" 2>&1
              done_step selftest $?; tail -n 2 "$OUT/selftest.log" ;;
    bench) timeout "$(limit 330)" python3 -m msa_jit bench --out "$OUT" --baseline none ${BENCH_ARGS:-} \
             > "$OUT/bench.log" 2>&1
           done_step bench $?; grep -E "FAILED|Error" "$OUT/bench.log" | head -n 20 ;;
    host_path) timeout "$(limit 300)" python3 bench/host_path.py --modes msa,msa_merge_kernel,msa_op,triton \
                 --json "$OUT/host_path.json" > "$OUT/host_path.log" 2>&1
               done_step host_path $?; grep -v "scale buffers" "$OUT/host_path.log" | tail -n 20 ;;
    peers) # the peer bench of docs/performance.md: FlashInfer (.fi-bundle) and vLLM's Triton decode from its
           # one file (bench/peers/vllm_decode_file.py, vLLM's file in .engine-src) beside msa-jit, in one process
           ( set +u; [ -f .fi-bundle/setup.sh ] && source .fi-bundle/setup.sh >/dev/null
             timeout "$(limit 560)" python3 bench/peers/vllm_decode_file.py bench --compare flashinfer,vllm \
               --out "$OUT" --baseline none ${PEERS_ARGS:---heads 64/4,32/2,16/1,8/1 --batch 1,2,4,8,16,32,64,128,256 \
               --decode-query-len 1,2,4,8 --kv-dtype fp8,nvfp4 --floor-batch '' --iters 20} ) > "$OUT/peers.log" 2>&1
           done_step peers $?; grep -E "geomean|FAILED|Error|missing" "$OUT/peers.log" | tail -n 20 ;;
    plan_ab) plan_ab plan_ab ${PLAN_AB_ARGS:-} ;;
    plan_ab_nvfp4) plan_ab plan_ab_nvfp4 --kv-dtype nvfp4 ${PLAN_AB_NVFP4_ARGS:-} ;;
    tree_ab) tree_ab ;;
    suite) # the GPU tests beside the union and cluster tests, as two streams sharing the GPU (none of them
           # times anything): about the longer stream's time instead of the sum
           local tmp; tmp=$(mktemp -d); local pids=()
           for stream in "tests" "union_tests cluster_tests"; do
             ( FAILED=0; for s in $stream; do run_step "$s"; done; exit $FAILED ) > "$tmp/${#pids[@]}.txt" 2>&1 &
             pids+=($!)
           done
           for i in "${!pids[@]}"; do wait "${pids[$i]}" || FAILED=1; cat "$tmp/$i.txt"; done
           rm -rf "$tmp" ;;
    *) echo "unknown step $step (suite tests union_tests cluster_tests memcheck racecheck selftest bench host_path peers plan_ab plan_ab_nvfp4 tree_ab)"; exit 2 ;;
  esac
}

for step in "$@"; do run_step "$step"; done
exit $FAILED
