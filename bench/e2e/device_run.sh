#!/usr/bin/env bash
# On the GPU host (Python 3.12, torch 2.11, no package index), from the repo root: MiniMax-M3 through
# msa-jit inside a real vLLM 0.33.0. What it needs comes from bench/e2e/prepare.sh in two calls on one
# warm machine (/tmp lasts while it stays warm, ~30 s after a call):
#
#   bash bench/e2e/device_run.sh unpack              call 1, carry [".e2e/a"]: vLLM into /tmp/site,
#                                                    msa-jit (this tree) into /tmp/msa-plugin
#   bash bench/e2e/device_run.sh run [ARGS...]       call 2, carry [".e2e/b"]: the rest, then
#                                                    bench/e2e/run_vllm_e2e.py run --out $OUT ARGS
#   bash bench/e2e/device_run.sh status              what /tmp holds
#
# Either command unpacks whatever .e2e/a or .e2e/b the call carried (once per machine). `run` fails
# with exit 3 if a piece is missing (the machine went cold between the calls: send call 1 again).
# DEADLINE_S (default 540) bounds the whole command; the runs share what is left after the setup.
# msa-jit is installed as vLLM would see it in production: `pip install --no-deps --target`, its
# entry point (group vllm.general_plugins) in the dist-info beside it, beside vLLM's tvm-ffi (0.1.11),
# with the kernels from the carried cache (MSA_JIT_NO_COMPILE=1: the host cannot compile).
set -u -o pipefail
T0=$SECONDS
CMD="${1:-status}"
[ $# -gt 0 ] && shift
SITE=/tmp/site PLUG=/tmp/msa-plugin RT=/tmp/msa-rt CACHE=/tmp/msa-cache
OUT="${OUT:-/tmp/e2e-out}"
DEADLINE_S="${DEADLINE_S:-540}"
mkdir -p "$OUT"
LOG="$OUT/device_run.log"
say() { printf '[device_run %3ds] %s\n' $((SECONDS - T0)) "$*" | tee -a "$LOG"; }

untar() {  # untar ARCHIVE DEST: tar's xz, else Python's tarfile
  tar -xJf "$1" -C "$2" 2>/dev/null ||
    python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$1" "$2"
}

unpack() {
  mkdir -p "$SITE" "$RT"
  local t m
  for t in .e2e/a/*.tar.xz .e2e/b/*.tar.xz; do
    [ -f "$t" ] || continue
    m="/tmp/.e2e-unpacked-$(basename "$t")"
    [ -f "$m" ] && continue
    say "unpacking $t"
    untar "$t" "$SITE" && touch "$m" || say "FAILED to unpack $t"
  done
  if [ -f .e2e/b/rt.xz ] && [ ! -f "$RT/libcute_dsl_runtime.so" ]; then
    say "unpacking the CuTe DSL runtime"
    xz -dc .e2e/b/rt.xz > "$RT/libcute_dsl_runtime.so.part" && chmod +x "$RT/libcute_dsl_runtime.so.part" &&
      mv "$RT/libcute_dsl_runtime.so.part" "$RT/libcute_dsl_runtime.so"
  fi
  if [ -d .e2e/b/msa-cache ]; then
    rm -rf "$CACHE" && cp -r .e2e/b/msa-cache "$CACHE" &&
      say "msa-jit cache: $(find "$CACHE" -name '*.so' | wc -l) kernels, $(find "$CACHE"/v1 -mindepth 3 -maxdepth 3 -name meta.json | wc -l) entries in $CACHE/v1 (top: $(ls -A "$CACHE" | tr '\n' ' '))"
  fi
  [ -f .e2e/b/BUILD.txt ] && cp .e2e/b/BUILD.txt /tmp/e2e-BUILD.txt
  if [ ! -f "$PLUG/.installed" ] || [ pyproject.toml -nt "$PLUG/.installed" ]; then
    say "installing msa-jit from this tree into $PLUG (pip --no-deps --no-build-isolation --target)"
    rm -rf "$PLUG"
    python3 -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --target "$PLUG" . \
      >>"$LOG" 2>&1 && touch "$PLUG/.installed" || say "FAILED: pip install of msa-jit (see $LOG)"
  fi
}

status() {  # prints each piece, returns 1 if one is missing
  local ok=0 p
  for p in "$SITE/vllm/__init__.py" "$SITE/tvm_ffi/__init__.py" "$SITE/flashinfer/__init__.py" \
           "$RT/libcute_dsl_runtime.so" "$CACHE" "$PLUG/msa_jit/__init__.py"; do
    if [ -e "$p" ]; then say "present: $p"; else say "MISSING: $p"; ok=1; fi
  done
  ls "$PLUG"/msa_jit-*.dist-info/entry_points.txt >/dev/null 2>&1 && say "entry point: $(tr '\n' ' ' < "$PLUG"/msa_jit-*.dist-info/entry_points.txt)"
  return $ok
}

environment() {
  export PYTHONPATH="$PLUG:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FLASHINFER_DISABLE_JIT=1
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-INFO}"
  export VLLM_CACHE_ROOT=/tmp/vllm-cache TRITON_CACHE_DIR=/tmp/triton-cache TOKENIZERS_PARALLELISM=false
  export MSA_JIT_CACHE_DIR="$CACHE" MSA_JIT_NO_COMPILE=1 MSA_JIT_DSL_RUNTIME="$RT/libcute_dsl_runtime.so"
  export MSA_JIT_DSL_VERSION="${MSA_JIT_DSL_VERSION:-4.8.1}"  # the runtime-only host has no DSL metadata
  [ -f /tmp/e2e-BUILD.txt ] && export MSA_JIT_COMMIT="$(head -1 /tmp/e2e-BUILD.txt | cut -d' ' -f2-)"
  return 0
}

case "$CMD" in
  unpack)
    unpack
    status
    exit 0 ;;
  status)
    status
    exit $? ;;
  run)
    unpack
    if ! status; then
      say "a piece is missing: the machine went cold after call 1, or a call was skipped; send call 1 again"
      exit 3
    fi
    environment
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
    left=$((DEADLINE_S - (SECONDS - T0)))
    say "running bench/e2e/run_vllm_e2e.py with ${left}s left: $*"
    python3 bench/e2e/run_vllm_e2e.py run --out "$OUT" --deadline-s "$((left - 15))" "$@" 2>&1 | tee -a "$LOG"
    rc=$?
    say "done (exit $rc)"
    exit $rc ;;
  *)
    echo "usage: bash bench/e2e/device_run.sh unpack|run [ARGS...]|status" >&2
    exit 2 ;;
esac
