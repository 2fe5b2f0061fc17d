#!/usr/bin/env bash
# The release rehearsal on one GPU machine (H200: 16 cores, 128 GiB RAM, 64 GB disk, 10 minutes a command), one
# command per call, the same command every call: each call runs the steps of bench/release/rehearsal.py that are
# not finished yet, in order, until its deadline, and writes the result so far to $OUT.
#
#   bash bench/release/rehearsal_gpu.sh [STATE.json]
#
# Work: /tmp/rehearsal (kept while the machine stays warm). A fresh machine continues from STATE.json, the
# rehearsal_state.json an earlier call brought back (carry it in the tree, e.g. bench/results/rehearsal_state.json):
# it rebuilds the model (the same seed, the same weights) and runs what is left. The disk holds the 48.5 GB BF16
# model and one output at a time, so the EXL3 chain runs first, its directory is removed once checked (free-exl3),
# then the GGUF chain. The GGUF `--rounding hessian` convert of three real-width layers and the NextN block outlasts
# one command: the call that starts it records it cut, with its profile so far; the next call writes the same plan
# with ggml's exact rounding (--gguf-fallback) for verify, eval and the llama.cpp load.
#
# An H200: a 288-expert EXL3 layer has peaked at 82 GiB of GPU memory (bench/results/glm53_slice_288_exl3.json).
# REHEARSAL_ARGS passes other driver options (e.g. --no-profile).
# Expected calls (288 experts): 1 build + EXL3 convert (cut), 2 EXL3 --resume to the end + verify, 3 EXL3 evals and
# exllamav3 load + free + imatrix, 4 GGUF hessian convert (cut), 5 GGUF exact + verify + eval + llama.cpp load +
# projection. A machine is held at most 30 minutes: calls 4-5 usually start on a fresh one (STATE.json).
#
# Fixtures: ./shared when the checkout has one, else .pack/*.tar.xz unpacked into ./shared (it needs
# models/glm-5.3-flash-shape/config.json, models/glm5next-mini's tokenizer and data/heldout.txt). Wheels in .whl/
# (transformers, gguf, exllamav3, llama-cpp-python when present) are installed into /tmp/site on first use.
# Back in $OUT (4 files): rehearsal.json (every step over every call: command, exit code, seconds, peaks, profile,
# what was cut), rehearsal_state.json (for a fresh machine), rehearsal_log.txt (this call), env.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?OUT must name the folder whose files come back}
STATE=${1:-}
DEADLINE=${REHEARSAL_DEADLINE_S:-540}
WORK=${REHEARSAL_WORK:-/tmp/rehearsal}
start=$SECONDS
mkdir -p "$OUT" "$WORK"
source bench/tools/device_env.sh
if [ ! -f shared/models/glm-5.3-flash-shape/config.json ]; then
    echo "rehearsal_gpu.sh: shared/models/glm-5.3-flash-shape/config.json is missing" | tee "$OUT/rehearsal_log.txt"
    exit 2
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    df -h "$WORK" | tail -1
    free -g | head -2
} > "$OUT/env.txt" 2>&1
STATE_ARGS=()
[ -n "$STATE" ] && STATE_ARGS=(--state-from "$STATE")
python3 bench/release/rehearsal.py --work "$WORK" --json "$OUT/rehearsal.json" ${STATE_ARGS[@]+"${STATE_ARGS[@]}"} \
    --steps all,free-exl3 --deadline-s "$(( DEADLINE - (SECONDS - start) ))" \
    --gguf-fallback "--bpw 8 --gguf-ladder iq" ${REHEARSAL_ARGS:-} 2>&1 | tee "$OUT/rehearsal_log.txt"
rc=${PIPESTATUS[0]}
cp "$WORK/rehearsal_state.json" "$OUT/" 2>/dev/null
df -h "$WORK" | tail -1 >> "$OUT/env.txt"
exit "$rc"
