#!/usr/bin/env bash
# The packages tests/test_examples.py::test_notebook_runs_on_gpu needs that the GPU host lacks (it has
# attrs, pygments, packaging, python-dateutil, typing-extensions, psutil, matplotlib), as Python 3.12
# wheels in .whl (git-ignored, about 14 MB). Run here (pip reaches an index), then carry .whl:
#   bash bench/notebook_wheels.sh && <device run with carry [... ".whl"]> bash bench/h200_run.sh tests
# bench/h200_run.sh installs them into /tmp/site there. Versions: those this repo's CPU tests run with.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for p in nbformat==5.11.1 nbclient==0.11.0 ipykernel==7.4.0 ipython==8.12.3 jupyter_client==8.10.0 \
         jupyter_core==5.9.1 traitlets==5.15.0 pyzmq==27.3.0 tornado==6.6.1 fastjsonschema==2.22.3 \
         jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0 \
         platformdirs==4.14.9 comm==0.2.3 debugpy==1.8.22 matplotlib-inline==0.2.2 nest-asyncio2==1.7.4 \
         decorator==5.2.1 jedi==0.20.0 parso==0.8.7 pexpect==4.8.0 ptyprocess==0.7.0 prompt_toolkit==3.0.52 \
         wcwidth==0.7.0 stack-data==0.6.3 executing==2.2.1 asttokens==3.0.1 pure_eval==0.2.3 \
         backcall==0.2.0 pickleshare==0.7.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any -d .whl "$p" 2>/dev/null
done
ls .whl | wc -l
