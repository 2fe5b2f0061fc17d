# Sourced by the device scripts (bench/tools/gpu_suite.sh, bench/release/rehearsal_gpu.sh) from the repository root:
# the fixtures and the wheels of a bare GPU machine, and the environment that runs this checkout as `mixq`.
#
# Fixtures: ./shared when the checkout has one (a copy of ../shared), else .pack/*.tar.xz unpacked into ./shared (a
# copy of ../shared/models/NAME packed as `tar -C ../shared -cJf .pack/NAME.tar.xz models/NAME`). Wheels in .whl/
# (transformers, gguf; exllamav3 and its needs for its tests) are installed into /tmp/site on first use.
mkdir -p shared /tmp/pp
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
