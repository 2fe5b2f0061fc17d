#!/usr/bin/env bash
# The `gpu` tests on a CUDA machine: pytest's JUnit XML and log into OUT (kept under bench/results/ with the commit).
#
#   bash bench/tools/gpu_suite.sh OUT COMMIT [PYTEST ARGS...]      # default: every test marked gpu
#
# Fixtures and wheels: bench/tools/device_env.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bench/tools/gpu_suite.sh OUT COMMIT [PYTEST ARGS...]}
COMMIT=${2:?usage: bench/tools/gpu_suite.sh OUT COMMIT [PYTEST ARGS...]}
shift 2
mkdir -p "$OUT"
source bench/tools/device_env.sh
[ $# -gt 0 ] || set -- tests
{
    echo "commit: $COMMIT"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$OUT/gpu_suite_env.txt" 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --junitxml "$OUT/gpu_suite.xml" "$@" 2>&1 | tee "$OUT/gpu_suite.log"
