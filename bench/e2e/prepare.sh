#!/usr/bin/env bash
# Builds, here on the CPU machine, what bench/e2e/device_run.sh needs on the GPU host, in the ignored
# folder .e2e/ of the repo root, split in two parts that travel in two calls on one warm machine:
#
#   .e2e/a/  vllm033_sm90.tar.xz                           (vLLM 0.33.0, trimmed to SM90)
#   .e2e/b/  site_extra.tar.xz flashinfer_trim.tar.xz     (the wheels vLLM needs; FlashInfer's norm)
#            rt.xz                                         (libcute_dsl_runtime.so, the CuTe DSL runtime)
#            msa-cache/                                    (msa-jit's kernels for the tiny model, sm_90a)
#            BUILD.txt                                     (commit, versions, sizes)
#
#   bash bench/e2e/prepare.sh            (from the repo root; GPU_HOST_DIR defaults to ../shared/gpu-host)
#
# One call cannot hold the tree, the vLLM bundle (~45 MiB) and the runtime (~13 MiB) together (64 MiB
# a call): call 1 carries .e2e/a, call 2 (right after, the host keeps /tmp while warm) .e2e/b. The
# kernels are warmed from THIS checkout's kernels (their hash is in every cache key): rerun after any
# change to the kernels. The bundles come from ~/.cache (seconds after the first build).
set -euo pipefail
ROOT="$(git rev-parse --show-toplevel)"
cd "$ROOT"
GH="${GPU_HOST_DIR:-$ROOT/../shared/gpu-host}"
[ -f "$GH/vllm-bundle/make.sh" ] || GH=/work/shared/gpu-host
[ -f "$GH/vllm-bundle/make.sh" ] || { echo "no shared/gpu-host (set GPU_HOST_DIR)" >&2; exit 1; }
LIMIT_MIB=64
say() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

git check-ignore -q .e2e/x || { echo "add /.e2e/ to .git/info/exclude first" >&2; exit 1; }
say "vLLM bundle (shared/gpu-host/vllm-bundle/make.sh, cached after the first build)"
bash "$GH/vllm-bundle/make.sh" .vllm-bundle >/dev/null
say "DSL runtime bundle (shared/gpu-host/make-bundle.sh)"
bash "$GH/make-bundle.sh" .gpu-bundle >/dev/null

rm -rf .e2e/a .e2e/b
mkdir -p .e2e/a .e2e/b .e2e/cache
ln .vllm-bundle/vllm033_sm90.tar.xz .e2e/a/ 2>/dev/null || cp .vllm-bundle/vllm033_sm90.tar.xz .e2e/a/
for f in site_extra.tar.xz flashinfer_trim.tar.xz; do
  ln ".vllm-bundle/$f" .e2e/b/ 2>/dev/null || cp ".vllm-bundle/$f" .e2e/b/
done
ln .gpu-bundle/rt.xz .e2e/b/ 2>/dev/null || cp .gpu-bundle/rt.xz .e2e/b/

say "msa-jit kernels: 64/4, q bf16+fp8, kv fp8+nvfp4, sm_90a (.e2e/cache keeps them: a minute or two the first time)"
MSA_JIT_ARCH=sm_90a python3 -m msa_jit warmup --heads 64/4 --q-dtype bf16,fp8 --kv-dtype fp8,nvfp4 \
  --arch sm_90a --cache-dir .e2e/cache --jobs "${JOBS:-2}" -q --json .e2e/b/warmup.json
python3 - <<'EOF'
# only this warmup's entries travel (.e2e/cache also holds those of earlier kernel sources)
import json, shutil
from pathlib import Path
rows = json.load(open(".e2e/b/warmup.json"))["rows"]
bad = [r for r in rows if r.get("status") not in ("compiled", "cached")]
for r in rows:
    if r.get("key"):
        src = Path(".e2e/cache/v1") / r["key"][:2] / r["key"]
        shutil.copytree(src, Path(".e2e/b/msa-cache/v1") / r["key"][:2] / r["key"])
print(f"  {len(rows)} kernels warmed, {len(bad)} failed, copied to .e2e/b/msa-cache")
raise SystemExit(1 if bad or not rows else 0)
EOF

mib() { awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null | mib)
a=$(find .e2e/a -type f -printf '%s\n' | mib)
b=$(find .e2e/b -type f -printf '%s\n' | mib)
{
  echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- msa_jit kernels bench/e2e 2>/dev/null || echo ' (msa_jit/, kernels/ or bench/e2e/ modified)')"
  echo "made $(date -u +%FT%TZ) by bench/e2e/prepare.sh"
  head -2 .vllm-bundle/BUILD.txt
  python3 -c "from msa_jit.jit import compiler as c; print('dsl', c.dsl_version(), 'tvm_ffi_abi', c.tvm_ffi_abi())"
  echo "sizes MiB: tree $tree, .e2e/a $a, .e2e/b $b"
} > .e2e/b/BUILD.txt
cat .e2e/b/BUILD.txt
call1=$(echo "$tree + $a" | bc)
call2=$(echo "$tree + $b" | bc)
echo "call 1 (carry .e2e/a): $call1 MiB of $LIMIT_MIB;  call 2 (carry .e2e/b): $call2 MiB of $LIMIT_MIB"
for c in "$call1" "$call2"; do
  if [ "$(echo "$c > $LIMIT_MIB - 2" | bc)" = 1 ]; then
    echo "WARNING: a call would carry $c MiB, over $LIMIT_MIB MiB less a 2 MiB margin" >&2
    exit 2
  fi
done
