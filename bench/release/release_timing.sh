#!/usr/bin/env bash
# The release-timing measurements of docs/results.md ("real widths") on one H200, a step or two per call (each call
# under 9 minutes; about how long each step takes):
#
#   bash bench/release/release_timing.sh OUT exl3-slice               # 8.5 min: the 288-expert EXL3 slice, projected
#   bash bench/release/release_timing.sh OUT gguf-tune                # 8 min: GGUF tuning of the 288-expert layer
#   bash bench/release/release_timing.sh OUT gguf-rounding            # 1.5 min: the Hessian rounding's stacked calls
#   bash bench/release/release_timing.sh OUT build-exllamav3          # 5-7 min: exllamav3's CUDA extension, alone
#   bash bench/release/release_timing.sh OUT gpu-tests trellis        # 2 + 5 min: gpu tests; the encoder beside exllamav3
#   bash bench/release/release_timing.sh OUT exl3-slice-dsa           # 8.5 min: the same with a DSA + MoE layer
#   bash bench/release/release_timing.sh OUT gguf-hessian             # 8.5 min: a whole --rounding hessian conversion
#   bash bench/release/release_timing.sh OUT gguf-hessian-long        # 9.5 min: the same, further into the expert groups
#                                                             (kernels compiled beside the build; warm-up from COLD;
#                                                             DEADLINE=S seconds instead of 560; SIDE_STEPS="STEP..."
#                                                             runs those short steps beside the kernel builds, after
#                                                             the slice's build, each logged to OUT/side_STEP.log)
#   bash bench/release/release_timing.sh OUT gguf-round-profile       # 5 min: one stacked IQ2_S rounding call in the
#                                                             conversion, profiled (--round-profile)
#   bash bench/release/release_timing.sh OUT gguf-factor              # 1 min: the rounding's factor, two ways side by side
#   bash bench/release/release_timing.sh OUT kda-kernels              # 1.5 min: a KDA layer, reference path against fla's
#   bash bench/release/release_timing.sh OUT gguf-hessian-long-fla    # 9.5 min: gguf-hessian-long with fla's KDA kernels
#   bash bench/release/release_timing.sh OUT gguf-hessian-long-groups # 9.5 min: the same with 1.3 G-weight expert groups
#                                                             (6 groups of 51 experts; an H200's memory: on an
#                                                             80 GB H100 the first group runs out of it)
#   bash bench/release/release_timing.sh OUT gguf-tune-fla            # 6 min: gguf-tune with fla's KDA kernels, 200 steps (the
#                                                             groups' 25 each), the first group profiled
#   bash bench/release/release_timing.sh OUT gguf-tune-groups         # 5 min: the tuning probe without fla, 200 steps (the
#                                                             groups' 25 each; TUNE_BUDGET=W weights a stage)
#   bash bench/release/release_timing.sh OUT encode-q4k               # 1 min: ggml's Q4_K encoder warm on the GPU at an
#                                                             expert's shape (the NextN block's rate; a step run
#                                                             before gguf-hessian-long* prices the NextN block at it)
#   bash bench/release/release_timing.sh OUT iq2-decode               # 1 min: the tuner's IQ2 decode at an expert's shape,
#                                                             the fused and neighbour searches beside the full one,
#                                                             and a profile of the decode
#   bash bench/release/release_timing.sh OUT tuning-gpu-tests         # 1 min: the tuner's gpu tests
#   bash bench/release/release_timing.sh OUT gguf-hessian-refine1     # 8.5 min: the same with --refine-passes 1
#   bash bench/release/release_timing.sh OUT gguf-rounding-refine1    # 1 min: the stacked calls with one descent pass
#   bash bench/release/release_timing.sh OUT gguf-rounding-passes     # 1 min: IQ2_S stacks, 0 and 1 descent passes
#   bash bench/release/release_timing.sh OUT copy-back                # 1.5 min: pinned copies beside pageable ones
#
# OUT receives the JSON results. Wheels in .whl/ (transformers, gguf, exllamav3 and its needs) are installed into
# /tmp/site on first use, those in .whl/fla/ (flash-linear-attention, fla-core, einops) into /tmp/site-fla; each slice step builds the slice into /tmp/mixq-slice (about 25 s).
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
SLICE=(--work "$WORK" --experts 288 --layers kda-dense,kda-moe --no-fp8)
# the exact path's imatrix, read/write/seal and encode rates come from its measured run
EXACT=(--seed-json bench/results/glm53_slice_288.json)
# each rounded type's one-time kernel warm-up, as a run with a cold kernel cache measured it
COLD=(--warmup-json bench/results/glm53_slice_288_hessian_cold.json)

# flash-linear-attention (.whl/fla: fla, fla-core, einops) in a directory of its own: on the path only of the steps
# that name it, since transformers takes its KDA kernels over the reference path wherever `fla` imports
with_fla() {
    [ -e /tmp/site-fla/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla \
        .whl/fla/*.whl
}

# Compile the slice's rounding kernels in side processes, one per type, while the slice builds: the timed conversion
# then finds them in Triton's cache and reaches further into the expert groups before its deadline (the warm-up it
# skips is booked from COLD)
prewarm_rounding() {
    local tk
    for tk in Q5_K:matrix Q4_K:matrix Q3_K:matrix Q2_K:stack_down IQ2_S:stack IQ2_XS:stack; do
        python3 bench/speed/hessian_rounding_speed.py --types "${tk%%:*}" --kinds "${tk##*:}" --experts 2 \
            --json "/tmp/pp/prewarm_${tk%%:*}.json" > "/tmp/pp/prewarm_${tk%%:*}.log" 2>&1 &
    done
}

# The hessian conversion of the slice, its kernels built beside the slice's build, into
# $OUT/glm53_slice_288_hessian$1.json; the other arguments go to glm53_slice.py. The conversion starts once the side
# processes have ended (the tuner sizes its expert groups from the free GPU memory, and their memory once cut the
# groups from 17 experts to 10) and runs until DEADLINE (560 s) from the step's start
hessian_long() {
    local tag=$1 start=$SECONDS
    shift
    prewarm_rounding
    python3 bench/release/glm53_slice.py "${SLICE[@]}" --json "$OUT/slice_build$tag.json" --stages build
    local side
    for side in ${SIDE_STEPS:-}; do
        bash bench/release/release_timing.sh "$OUT" "$side" > "$OUT/side_$side.log" 2>&1 &
    done
    wait
    if [ -f "$OUT/kquant_speed_q4k.json" ]; then set -- "$@" --encode-rates-json "$OUT/kquant_speed_q4k.json"; fi
    python3 bench/release/glm53_slice.py "${SLICE[@]}" "${EXACT[@]}" "${COLD[@]}" "$@" \
        --json "$OUT/glm53_slice_288_hessian$tag.json" --deadline-s "$(( ${DEADLINE:-560} - (SECONDS - start) ))" \
        --stages gguf-hessian,project
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
        exl3-slice) python3 bench/release/glm53_slice.py "${SLICE[@]}" --json "$OUT/glm53_slice_288_exl3.json" \
                        --deadline-s 500 --reserve-s 15 --trellis-profile --stages build,exl3,project ;;
        exl3-slice-dsa) python3 bench/release/glm53_slice.py --work "$WORK" --experts 288 --layers kda-dense,dsa-moe --no-fp8 \
                            --json "$OUT/glm53_slice_288_exl3_dsa.json" --deadline-s 500 --reserve-s 15 \
                            --trellis-profile --stages build,exl3,project ;;
        gguf-hessian) python3 bench/release/glm53_slice.py "${SLICE[@]}" "${EXACT[@]}" --json "$OUT/glm53_slice_288_hessian.json" \
                          --deadline-s 500 --stages build,gguf-hessian,project ;;
        gguf-hessian-long) hessian_long "" ;;
        gguf-round-profile) python3 bench/release/glm53_slice.py "${SLICE[@]}" "${EXACT[@]}" "${COLD[@]}" \
                                --json "$OUT/glm53_slice_288_round_profile.json" --deadline-s 300 \
                                --round-profile "$OUT/round_profile.txt" --stages build,gguf-hessian ;;
        kda-kernels) with_fla
                     [ -d "$WORK/bf16" ] || python3 bench/release/glm53_slice.py "${SLICE[@]}" --json "$OUT/slice_build.json" \
                                               --stages build
                     python3 bench/speed/kda_kernels.py --model "$WORK/bf16" --fla-path /tmp/site-fla \
                         --json "$OUT/kda_kernels.json" ;;
        gguf-hessian-long-fla) with_fla
                               PYTHONPATH=/tmp/site-fla:$PYTHONPATH hessian_long _fla ;;
        gguf-hessian-long-groups) hessian_long _groups --tune-budget 1300000000 ;;
        gguf-factor) python3 bench/speed/hessian_factor.py --json "$OUT/hessian_factor.json" ;;
        encode-q4k) python3 bench/speed/kquant_speed.py --device cuda --types Q4_K --imatrix both --cpu-threads 1 \
                        --ggml-threads 4 --target-s 0.5 --json "$OUT/kquant_speed_q4k.json" ;;
        iq2-decode) python3 bench/speed/iq2_tuning_decode.py --device cuda --experts 4 --rows 2048 --cols 4096 \
                        --json "$OUT/iq2_tuning_decode.json" --profile "$OUT/iq2_decode_profile.txt" ;;
        tuning-gpu-tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant/test_block_tuning.py \
                              tests/conversion/test_gguf_tuning.py 2>&1 | tail -15 ;;
        gguf-hessian-refine1) python3 bench/release/glm53_slice.py "${SLICE[@]}" "${EXACT[@]}" --refine-passes 1 \
                                  --json "$OUT/glm53_slice_288_hessian_refine1.json" --deadline-s 500 \
                                  --stages build,gguf-hessian,project ;;
        gguf-rounding-refine1) python3 bench/speed/hessian_rounding_speed.py --refine 1 \
                                   --json "$OUT/hessian_rounding_speed_refine1.json" --types IQ2_S,Q4_K \
                                   --kinds stack,stack_down ;;
        gguf-rounding-passes) for n in 0 1; do
                                  python3 bench/speed/hessian_rounding_speed.py --refine $n --types IQ2_S \
                                      --kinds stack --json "$OUT/hessian_rounding_speed_refine$n.json"
                              done ;;
        gguf-rounding) python3 bench/speed/hessian_rounding_speed.py --json "$OUT/hessian_rounding_speed.json" \
                           --types IQ2_S,Q4_K --kinds stack,stack_down ;;
        gguf-tune) python3 bench/release/glm53_slice.py "${SLICE[@]}" --json "$OUT/glm53_slice_288_tune.json" \
                       --deadline-s 500 --stages build,gguf-tune,project --tune-profile "$OUT/tune_profile.txt" ;;
        gguf-tune-fla) with_fla
                       PYTHONPATH=/tmp/site-fla:$PYTHONPATH python3 bench/release/glm53_slice.py "${SLICE[@]}" \
                           --json "$OUT/glm53_slice_288_tune_fla.json" --deadline-s 500 --stages build,gguf-tune \
                           --tune-probe-iters 200 --tune-profile "$OUT/tune_profile_fla.txt" ;;
        gguf-tune-groups) python3 bench/release/glm53_slice.py "${SLICE[@]}" --json "$OUT/glm53_slice_288_tune_groups.json" \
                              --deadline-s "${DEADLINE:-420}" --stages build,gguf-tune --tune-probe-iters 200 \
                              ${TUNE_BUDGET:+--tune-budget "$TUNE_BUDGET"} ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
