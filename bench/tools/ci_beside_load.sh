#!/usr/bin/env bash
# `.ci/run` on a fresh clone of COMMIT while BUSY busy loops (default 2, one per core of a 2-core CI machine) hold
# the CPU: the condition of a CI runner shared with other jobs. The whole output, the exit status and the wall time
# go to LOG (keep it under bench/results/ci_beside_load_COMMIT.txt).
#
#   bash bench/tools/ci_beside_load.sh COMMIT LOG [BUSY]
set -u
COMMIT=${1:?usage: bench/tools/ci_beside_load.sh COMMIT LOG [BUSY]}
LOG=$(realpath -m "${2:?usage: bench/tools/ci_beside_load.sh COMMIT LOG [BUSY]}")
BUSY=${3:-2}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
# the clone is elsewhere; the fixtures stay where this checkout finds them (../shared, as in CI)
export MIXQ_SHARED=${MIXQ_SHARED:-$(realpath -m "$REPO/../shared")}
[ -d "$MIXQ_SHARED/models" ] || { echo "ci_beside_load.sh: no fixtures at $MIXQ_SHARED" >&2; exit 2; }
CLONE=$(mktemp -d)/mixq
git clone -q "$REPO" "$CLONE" && cd "$CLONE" && git checkout -q "$COMMIT" || exit 2
pids=()
for _ in $(seq "$BUSY"); do ( while :; do :; done ) & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
start=$(date +%s)
{ echo "commit: $(git rev-parse --short HEAD)"; echo "started: $(date -u)"; echo "beside: $BUSY busy loops"; uptime; } > "$LOG"
bash .ci/run >> "$LOG" 2>&1
rc=$?
{ echo "exit: $rc"; echo "wall_s: $(( $(date +%s) - start ))"; echo "ended: $(date -u)"; uptime; } >> "$LOG"
exit "$rc"
