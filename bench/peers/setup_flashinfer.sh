# Source this on the GPU host, from the repo root, after .gpu-bundle/setup.sh:   source .fi-bundle/setup.sh
# (written into the bundle by bench/peers/make_flashinfer_bundle.sh). Unpacks flashinfer @FI_VER@'s
# cut tree into /tmp/fi-site once per host, installs the carried wheels a host lacks into
# /tmp/fi-site/deps, and exports:
#   PYTHONPATH                 /tmp/fi-site first (ahead of any other flashinfer), then /tmp/fi-site/deps
#   FLASHINFER_WORKSPACE_BASE  /tmp/fi-ws (FlashInfer writes its locks and JIT folder under it)
#   FLASHINFER_DISABLE_JIT=1   every Cake decode program is prebuilt (data/aot); a missing one raises
#                              instead of compiling (the tree carries no headers to compile with)
#   CUDA_HOME                  /usr/local/cuda unless set
_fb="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_fs=/tmp/fi-site
_fi_bundle_unpack() {
  mkdir -p "$_fs/deps" /tmp/fi-ws || return 1
  if [ ! -f "$_fs/.unpacked" ]; then
    tar xJf "$_fb"/flashinfer-*-sm90.tar.xz -C "$_fs" && touch "$_fs/.unpacked" || return 1
  fi
  local w mod missing=()
  for w in "$_fb"/wheels/*.whl; do
    case "$(basename "$w")" in
      nvidia_ml_py-*) mod=pynvml ;; charset_normalizer-*) mod=charset_normalizer ;;
      *) mod="$(basename "$w" | cut -d- -f1)" ;;
    esac
    python3 -c "import $mod" 2>/dev/null || missing+=("$w")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$_fs/deps" "${missing[@]}" || return 1
    echo "fi bundle: installed $(printf '%s ' "${missing[@]##*/}")" >&2
  fi
}
if _fi_bundle_unpack; then
  export PYTHONPATH="$_fs:$_fs/deps${PYTHONPATH:+:$PYTHONPATH}"
  export FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws FLASHINFER_DISABLE_JIT=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
  python3 -c "import flashinfer.msa_ops" || echo "fi bundle: import flashinfer.msa_ops failed (is tvm_ffi there? source .gpu-bundle/setup.sh first)" >&2
else
  echo "fi bundle: unpack into $_fs failed" >&2
fi
unset -f _fi_bundle_unpack
