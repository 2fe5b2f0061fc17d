#!/usr/bin/env bash
# The release-timing measurements of docs/results.md ("real widths") on one H200, a step or two per call (each call
# under 9 minutes; about how long each step takes):
#
#   bash bench/release/release_timing.sh OUT gguf-rounding            # 1.5 min: the Hessian rounding's stacked calls
#   bash bench/release/release_timing.sh OUT build-exllamav3          # 5-7 min: exllamav3's CUDA extension, alone
#   bash bench/release/release_timing.sh OUT gpu-tests trellis        # 2 + 5 min: gpu tests; the encoder beside exllamav3
#   bash bench/release/release_timing.sh OUT gguf-factor              # 1 min: the rounding's factor, two ways side by side
#   bash bench/release/release_timing.sh OUT kda-kernels              # 1.5 min: a KDA layer, reference path against fla's
#   bash bench/release/release_timing.sh OUT encode-q4k               # 1 min: ggml's Q4_K encoder warm on the GPU at an
#                                                             expert's shape (the NextN block's rate)
#   bash bench/release/release_timing.sh OUT iq2-decode               # 1 min: the tuner's IQ2 decode at an expert's shape,
#                                                             the fused and neighbour searches beside the full one,
#                                                             and a profile of the decode
#   bash bench/release/release_timing.sh OUT tuning-gpu-tests         # 1 min: the tuner's gpu tests
#   bash bench/release/release_timing.sh OUT gguf-rounding-refine1    # 1 min: the stacked calls with one descent pass
#   bash bench/release/release_timing.sh OUT gguf-rounding-passes     # 1 min: IQ2_S stacks, 0 and 1 descent passes
#   bash bench/release/release_timing.sh OUT copy-back                # 1.5 min: pinned copies beside pageable ones
#   bash bench/release/release_timing.sh OUT rehearsal                # 9.5 min: one call of the release rehearsal
#                                                             (bench/release/rehearsal_gpu.sh; REHEARSAL_STATE=FILE
#                                                             continues an earlier machine's calls)
#
# OUT receives the JSON results. Wheels in .whl/ (transformers, gguf, exllamav3 and its needs) are installed into
# /tmp/site on first use, those in .whl/fla/ (flash-linear-attention, fla-core, einops) into /tmp/site-fla; kda-kernels
# builds a 288-expert KDA + dense, KDA + MoE model (bench/release/rehearsal_model.py) into /tmp/mixq-slice (about 25 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bench/release/release_timing.sh OUT STEP...}
shift
mkdir -p "$OUT" /tmp/pp
if [ -d .whl ] && [ ! -e /tmp/site/.mixq-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    touch /tmp/site/.mixq-wheels
fi
ln -sfn "$PWD" /tmp/pp/mixq
export PYTHONPATH=/tmp/site:/tmp/pp${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
[ -d shared ] && export MIXQ_SHARED="$PWD/shared"
WORK=/tmp/mixq-slice
SLICE=(--experts 288 --kinds kda-dense,kda-moe --no-fp8 --no-nextn)

# flash-linear-attention (.whl/fla: fla, fla-core, einops) in a directory of its own: on the path only of the steps
# that name it, since transformers takes its KDA kernels over the reference path wherever `fla` imports
with_fla() {
    [ -e /tmp/site-fla/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla \
        .whl/fla/*.whl
}

for step in "$@"; do
    echo "== $step ($(date +%T))"
    case "$step" in
        build-exllamav3) python3 -c "import exllamav3; from exllamav3.ext import exllamav3_ext" ;;
        gpu-tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant/test_viterbi_gluon.py \
                       tests/quant/test_viterbi_fused.py tests/runtime/test_overlap.py \
                       tests/runtime/test_layer_stream.py 2>&1 | tail -15
                   python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant/test_ggml_hessian_rounding.py \
                       -k synthetic 2>&1 | tail -15 ;;
        trellis) python3 bench/speed/trellis_vs_exllamav3.py --json "$OUT/trellis_vs_exllamav3.json" --budget 300 ;;
        copy-back) python3 bench/speed/copy_back.py --json "$OUT/copy_back.json" ;;
        rehearsal) OUT="$OUT" bash bench/release/rehearsal_gpu.sh ${REHEARSAL_STATE:-} ;;
        kda-kernels) with_fla
                     [ -d "$WORK/bf16" ] || python3 bench/release/rehearsal_model.py "$WORK" "${SLICE[@]}" \
                                               --json "$OUT/slice_build.json"
                     python3 bench/speed/kda_kernels.py --model "$WORK/bf16" --fla-path /tmp/site-fla \
                         --json "$OUT/kda_kernels.json" ;;
        gguf-factor) python3 bench/speed/hessian_factor.py --json "$OUT/hessian_factor.json" ;;
        encode-q4k) python3 bench/speed/kquant_speed.py --device cuda --types Q4_K --imatrix both --cpu-threads 1 \
                        --ggml-threads 4 --target-s 0.5 --json "$OUT/kquant_speed_q4k.json" ;;
        iq2-decode) python3 bench/speed/iq2_tuning_decode.py --device cuda --experts 4 --rows 2048 --cols 4096 \
                        --json "$OUT/iq2_tuning_decode.json" --profile "$OUT/iq2_decode_profile.txt" ;;
        tuning-gpu-tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant/test_block_tuning.py \
                              tests/conversion/test_gguf_tuning.py 2>&1 | tail -15 ;;
        gguf-rounding-refine1) python3 bench/speed/hessian_rounding_speed.py --refine 1 \
                                   --json "$OUT/hessian_rounding_speed_refine1.json" --types IQ2_S,Q4_K \
                                   --kinds stack,stack_down ;;
        gguf-rounding-passes) for n in 0 1; do
                                  python3 bench/speed/hessian_rounding_speed.py --refine $n --types IQ2_S \
                                      --kinds stack --json "$OUT/hessian_rounding_speed_refine$n.json"
                              done ;;
        gguf-rounding) python3 bench/speed/hessian_rounding_speed.py --json "$OUT/hessian_rounding_speed.json" \
                           --types IQ2_S,Q4_K --kinds stack,stack_down ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
