#!/usr/bin/env bash
# Builds, here on the CPU machine, everything bench/device_run.sh's steps carry to the GPU host, each in an
# ignored folder of the repo root, and prints what each kind of call carries and how much of its 64 MiB:
#
#   .gpu-bundle/       the CuTe DSL runtime (shared/gpu-host/make-bundle.sh)                 every step
#   .artifacts/        this checkout's kernels for sm_90a (bench/warm_device_cache.py)        every step
#   .engine-src/       vLLM 0.33.0's MiniMax-M3 files (tests/vllm_files.py's copy)             host_path, peers, the GPU tests
#   .fi-bundle/        FlashInfer's SM90 decode, prebuilt (bench/peers/make_flashinfer_bundle.sh)  peers, plan_ab, tree_ab
#   .variant-<name>/   each bench/variants/<name>.patch as a tree with its warmed cache (bench/tree_ab.py)  tree_ab
#
#   bash bench/prepare_device.sh [--no-variants]      (from the repo root; GPU_HOST_DIR defaults to ../shared/gpu-host)
#
# Bundles come from ~/.cache after their first build (FlashInfer's 22 programs take ~10 minutes of two cores
# the first time); the kernels are warmed from THIS checkout: rerun after any change to msa_jit/kernels.
set -euo pipefail
ROOT="$(git rev-parse --show-toplevel)"
cd "$ROOT"
GH="${GPU_HOST_DIR:-$ROOT/../shared/gpu-host}"
[ -f "$GH/make-bundle.sh" ] || GH=/work/shared/gpu-host
[ -f "$GH/make-bundle.sh" ] || { echo "no shared/gpu-host (set GPU_HOST_DIR)" >&2; exit 1; }
VARIANTS=1
[ "${1:-}" = "--no-variants" ] && VARIANTS=0
JOBS="${JOBS:-2}"
say() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

for d in .gpu-bundle .artifacts .engine-src .fi-bundle .variant-x; do
  git check-ignore -q "$d/x" || { echo "$d is not ignored by git: add it to .gitignore first" >&2; exit 1; }
done
say "DSL runtime bundle"
bash "$GH/make-bundle.sh" .gpu-bundle >/dev/null
say "FlashInfer bundle"
FI_BUNDLE_JOBS="$JOBS" bash bench/peers/make_flashinfer_bundle.sh .fi-bundle >/dev/null
say "vLLM 0.33.0's files"
src=$(python3 -c "
import sys; sys.path.insert(0, 'tests')
import vllm_files
if vllm_files.FILES is None: sys.exit(vllm_files.SKIP_REASON)
print(vllm_files.cache_dir())")
rm -rf .engine-src && cp -r "$src" .engine-src
say "kernels of this checkout (sm_90a)"
python3 bench/warm_device_cache.py --cache-dir .artifacts --jobs "$JOBS" 2>&1 | tail -n 1
if (( VARIANTS )); then
  for patch in bench/variants/*.patch; do
    [ -e "$patch" ] || continue
    name=$(basename "$patch" .patch)
    say "variant $name"
    python3 bench/tree_ab.py prepare "$name" --patch "$patch" --jobs "$JOBS" 2>&1 | tail -n 1
  done
fi

mib() { awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tree_bytes() { { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null; }
size() { { tree_bytes; find "$@" -type f -printf '%s\n' 2>/dev/null; } | mib; }  # the tree and these folders
tree=$(tree_bytes | mib)
echo "the tree itself: $tree MiB; each folder: $(for d in .gpu-bundle .artifacts .engine-src .fi-bundle .variant-*; do
  [ -d "$d" ] && printf '%s %s MiB, ' "$d" "$(find "$d" -type f -printf '%s\n' | mib)"; done)"
echo "carry, by step (64 MiB a call, the tree included):"
echo "  suite, memcheck, racecheck, selftest, bench: .gpu-bundle .artifacts .engine-src ($(size .gpu-bundle .artifacts .engine-src) MiB)"
echo "  peers, plan_ab, plan_ab_nvfp4: .gpu-bundle .artifacts .engine-src .fi-bundle ($(size .gpu-bundle .artifacts .engine-src .fi-bundle) MiB)"
variants=(); for d in .variant-*; do [ -d "$d" ] && variants+=("$d"); done
for d in "${variants[@]}"; do
  echo "  VARIANT=${d#.variant-} tree_ab: .gpu-bundle .artifacts .fi-bundle $d ($(size .gpu-bundle .artifacts .fi-bundle "$d") MiB)"
done
if (( ${#variants[@]} > 1 )); then
  names=$(printf '%s,' "${variants[@]#.variant-}")
  echo "  VARIANT=${names%,} tree_ab (one base for all): .gpu-bundle .artifacts .fi-bundle ${variants[*]}" \
       "($(size .gpu-bundle .artifacts .fi-bundle "${variants[@]}") MiB)"
fi
