#!/usr/bin/env bash
# Runs on the lent GPU machine from the repository root: installs the carried wheels (pyzmq,
# pytest-asyncio, zstandard (not in the image); torchtune 0.6.1 with torchao 0.17, the last torchao that has the
# torchao.dtypes.nf4tensor torchtune imports, for bench/'s torchtune rows) and this checkout, then
# runs what is passed, e.g.
#   bash bench/on_device.sh python3 -m pytest -q tests/test_gpu.py
set -eo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
"$@"
