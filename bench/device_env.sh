# The GPU host's environment for the device scripts (sourced by bench/h200_run.sh and bench/merge_ab.sh):
# the carried DSL runtime bundle, this checkout on the path, the carried cache with compiling forbidden.
source .gpu-bundle/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-} MSA_JIT_CACHE_DIR=$PWD/.artifacts MSA_JIT_NO_COMPILE=1 \
       MSA_JIT_DSL_VERSION=4.8.1 PYTHONUNBUFFERED=1
# the engine-code tests read vLLM's files from a carried, git-ignored copy (../shared does not travel)
if [ -d .engine-src/vllm-0.33.0 ]; then export MSA_JIT_TEST_ENGINE_DIR=$PWD/.engine-src/vllm-0.33.0; fi
