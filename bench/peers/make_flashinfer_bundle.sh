#!/usr/bin/env bash
# Packs FlashInfer's Hopper MSA sparse decode for a GPU host with no package index, small enough to
# travel beside the tree in one device call (project tooling: `msa-jit bench --compare flashinfer`).
#
#   bash bench/peers/make_flashinfer_bundle.sh [DEST]        (DEST defaults to ./.fi-bundle; keep it out of git)
#
# DEST then holds:
#   flashinfer-<ver>-sm90.tar.xz  the files of the flashinfer-python wheel that `import flashinfer.msa_ops`
#                                 and its SM90 decode path read (traced, fi_bundle.py trace), the Cake decode
#                                 programs' CUDA sources (FlashInfer names each program by their digest) and
#                                 every Cake decode program prebuilt here for sm_90a with FlashInfer's own JIT
#                                 (nvcc 13), where FlashInfer looks for prebuilt modules: data/aot/<uri>/<uri>.so
#   wheels/                       pure-Python packages its import chain needs that a host may lack
#                                 (nvidia-ml-py, packaging, requests and its four, tqdm); setup.sh installs
#                                 only the missing ones
#   setup.sh, BUILD.txt           the host side (see setup.sh) and what was built from what
#
# On the GPU host, from the repo root, after `source .gpu-bundle/setup.sh` (it provides tvm_ffi):
#   source .fi-bundle/setup.sh    # unpacks into /tmp/fi-site, sets PYTHONPATH, FLASHINFER_WORKSPACE_BASE,
#                                 # CUDA_HOME and FLASHINFER_DISABLE_JIT=1 (every decode program is prebuilt)
#
# Needs: python3 with pip, nvcc 13 ($CUDA_HOME or /usr/local/cuda), ninja, a C/C++ compiler, xz.
# Results are cached in ~/.cache/msa-fi-bundle/ ($FI_BUNDLE_CACHE): a second run only repacks.
# The 22 decode programs take ~10 min of one core here (FI_BUNDLE_JOBS=2: nvcc runs on two).
set -euo pipefail
DEST="${1:-.fi-bundle}"
FI_VER="${FLASHINFER_VERSION:-0.7.4}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${FI_BUNDLE_CACHE:-$HOME/.cache/msa-fi-bundle}/flashinfer-$FI_VER"
JOBS="${FI_BUNDLE_JOBS:-1}"
# what the traced import chain needs beyond torch, numpy, jinja2, filelock and tvm_ffi (pure Python; the host
# is Python 3.12: charset-normalizer's cp312 wheel)
DEPS=(nvidia-ml-py packaging requests certifi charset-normalizer idna urllib3 tqdm)
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
mkdir -p "$CACHE/whl" "$CACHE/deps"

if ! ls "$CACHE"/whl/flashinfer_python-"$FI_VER"-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps -d "$CACHE/whl" "flashinfer-python==$FI_VER"
fi
if [ ! -f "$CACHE/deps.done" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$CACHE/deps-whl" "${DEPS[@]}"
  # for the trace and verify steps here: the same packages beside the tree
  python3 -m pip install -q --no-deps --no-compile --target "$CACHE/deps" "$CACHE"/deps-whl/nvidia_ml_py-*.whl
  touch "$CACHE/deps.done"
fi
if [ ! -f "$CACHE/wheel.done" ]; then
  rm -rf "$CACHE/wheel"; mkdir -p "$CACHE/wheel"
  (cd "$CACHE/wheel" && python3 -m zipfile -e "$CACHE"/whl/flashinfer_python-"$FI_VER"-*.whl .)
  touch "$CACHE/wheel.done"
fi

# 1. the import chain, as the host runs it
python3 "$HERE/fi_bundle.py" trace --root "$CACHE/wheel" --deps "$CACHE/deps" --out "$CACHE/files.txt"
# 2. the decode programs, built once (kept in $CACHE/aot across runs)
python3 "$HERE/fi_bundle.py" prebuild --root "$CACHE/wheel" --deps "$CACHE/deps" --aot "$CACHE/aot" \
  --workspace "$CACHE/ws" --jobs "$JOBS"
# 3. the cut tree: traced files, dist-info, the Cake sources, the prebuilt programs
rm -rf "$CACHE/tree"; mkdir -p "$CACHE/tree/flashinfer/data/aot" "$CACHE/tree/flashinfer/data/csrc"
(cd "$CACHE/wheel" && tar cf - -T "$CACHE/files.txt" flashinfer_python-"$FI_VER".dist-info \
   flashinfer/data/csrc/cake_hopper_msa) | (cd "$CACHE/tree" && tar xf -)
cp -r "$CACHE"/aot/. "$CACHE/tree/flashinfer/data/aot/"
python3 "$HERE/fi_bundle.py" verify --root "$CACHE/tree" --deps "$CACHE/deps"

rm -rf "$DEST"; mkdir -p "$DEST/wheels"
(cd "$CACHE/tree" && tar cf - .) | xz -9e -T"$JOBS" > "$DEST/flashinfer-$FI_VER-sm90.tar.xz"
cp "$CACHE"/deps-whl/*.whl "$DEST/wheels/"
sed "s/@FI_VER@/$FI_VER/" "$HERE/setup_flashinfer.sh" > "$DEST/setup.sh"
{
  echo "flashinfer-python $FI_VER ($(basename "$CACHE"/whl/flashinfer_python-*.whl)), built $(date -u +%FT%TZ)"
  echo "nvcc: $("$CUDA_HOME/bin/nvcc" --version | tail -n 2 | head -n 1)"
  echo "traced files: $(wc -l < "$CACHE/files.txt"); prebuilt programs: $(ls "$CACHE/aot" | wc -l) (sm_90a)"
  (cd "$DEST" && sha256sum flashinfer-*.tar.xz wheels/*.whl)
} > "$DEST/BUILD.txt"
du -sh "$DEST"
