#!/usr/bin/env bash
# The `gpu` tests on a CUDA machine: pytest's JUnit XML and log into OUT (kept under bench/results/ with the commit).
#
#   bash bench/tools/gpu_suite.sh OUT COMMIT [PYTEST ARGS...]      # default: every test marked gpu
#
# Fixtures: ./shared when the checkout has one (a copy of ../shared), else .pack/*.tar.xz unpacked into ./shared
# (a copy of ../shared/models/NAME packed as `tar -C ../shared -cJf .pack/NAME.tar.xz models/NAME`). Wheels in
# .whl/ (transformers, gguf; exllamav3 and its needs for its tests) are installed into /tmp/site on first use.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bench/tools/gpu_suite.sh OUT COMMIT [PYTEST ARGS...]}
COMMIT=${2:?usage: bench/tools/gpu_suite.sh OUT COMMIT [PYTEST ARGS...]}
shift 2
mkdir -p "$OUT" shared /tmp/pp
for p in .pack/*.tar.xz; do
    [ -e "$p" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
        "$p" shared
done
if [ -d .whl ] && [ ! -e /tmp/site/.mixq-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && touch /tmp/site/.mixq-wheels
fi
ln -sfn "$PWD" /tmp/pp/mixq
export PYTHONPATH=/tmp/site:/tmp/pp${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
export MIXQ_SHARED="$PWD/shared"
[ $# -gt 0 ] || set -- tests
{
    echo "commit: $COMMIT"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$OUT/gpu_suite_env.txt" 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --junitxml "$OUT/gpu_suite.xml" "$@" 2>&1 | tee "$OUT/gpu_suite.log"
