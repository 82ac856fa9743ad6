#!/usr/bin/env bash
# One device call (~5 min, CPU and disk only): bench/read.py on the GPU host, a trainer-class machine
# (16 cores, a real disk), where DataLoader workers and decode threads have cores of their own.
#   bash bench/gpu/run_read.sh   (with .whl/extra, .whl/read beside the checkout)
# .whl/extra and .whl/read (pyarrow): bench/gpu/build-extra.sh; installed under /tmp only if the image lacks
# them. Extra arguments go to bench/read.py (default: --gb 2.5 --workers 1 2 4 --decode-threads 4).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hsx-out}; mkdir -p "$OUT"
if ! python3 -c "import zstandard, xxhash, pyarrow, safetensors" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/extra "$REPO"/.whl/extra/*.whl "$REPO"/.whl/read/*.whl
fi
export PYTHONPATH=$REPO/src:/tmp/extra PYTHONUNBUFFERED=1
{ echo "cpus $(nproc)"; free -g | head -2; df -h /tmp | tail -1
  dd if=/dev/zero of=/tmp/ddprobe bs=16M count=128 conv=fdatasync 2>&1 | tail -1 | sed 's/^/disk write: /'
  rm -f /tmp/ddprobe
  findmnt -T /tmp -o SOURCE,FSTYPE | tail -1 | sed 's/^/\/tmp on: /'
  for q in /sys/block/*/queue; do  # the most one posix_fadvise(WILLNEED) starts: max of the first two
    echo "$(basename "$(dirname "$q")"): read_ahead_kb $(cat "$q/read_ahead_kb") max_sectors_kb $(cat "$q/max_sectors_kb")" \
      "nr_requests $(cat "$q/nr_requests") scheduler $(cat "$q/scheduler")"
  done | grep -v '^loop'
} >"$OUT/machine.txt" 2>&1 || true
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--gb 2.5 --workers 1 2 4 --decode-threads 4)
# the stores go to /tmp (the host's disk, not $OUT: nothing of them should come back)
timeout -k 10 540 python3 "$REPO/bench/read.py" "${args[@]}" --dir /tmp --out "$OUT/read.json" \
  --md "$OUT/read.md" 2>&1 | tee "$OUT/run.log"
