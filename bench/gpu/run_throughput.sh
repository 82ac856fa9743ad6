#!/usr/bin/env bash
# One device call (< 9 min): bench/sglang_throughput.py on the Llama-3-8B shape (dummy weights).
#   bash bench/gpu/run_throughput.sh   (with .whl/one, .whl/extra beside the checkout)
# The python part has a 430 s budget (BUDGET_S; parts that do not fit are skipped and recorded) and a hard
# timeout 40 s later; throughput.json is rewritten after every part. DD_GB: size of the disk probe (2). Extra arguments go to the script, e.g.
#   bash bench/gpu/run_throughput.sh --parts b,a --lens 512
# MODEL=wide: Kimi-K2.5's width in 4 thin layers (mk_models.py), for the writer's ceiling; give --aux 0 1 2.
source "$(dirname "$0")/setup.sh"
T0=$SECONDS
MODEL=${MODEL:-llama8b}
python3 "$REPO/bench/gpu/mk_models.py" /tmp/models --llama8b --wide --only llama >"$OUT/mk_models.log" 2>&1
echo "setup took $T0 s, models $((SECONDS - T0)) s" | tee "$OUT/run.log"
# The shards of (b) go to $OUT's disk, fsynced: its sequential write speed bounds (b) (2 GB, fdatasync).
dd if=/dev/zero of="$OUT/ddprobe" bs=16M count=$((64 * ${DD_GB:-2})) conv=fdatasync 2>&1 | tail -1 | sed 's/^/disk write ($OUT): /' | tee -a "$OUT/run.log"
rm -f "$OUT/ddprobe"; df -h "$OUT" | tail -1 | tee -a "$OUT/run.log"
# The shard encoder alone on this host's CPU (no server yet), by threads: its capacity beside nothing.
if [ "${ENCODE_SWEEP:-1}" = 1 ]; then
  timeout 60 python3 "$REPO/bench/shard_encode.py" --threads 1 4 8 16 --samples 96 --repeats 1 \
    --out "$OUT/encode.json" 2>&1 | sed 's/^/shard_encode: /' | tee -a "$OUT/run.log" || true
fi
set +e
BUDGET_S=${BUDGET_S:-430}
timeout -k 15 $((BUDGET_S + 40)) python3 "$REPO/bench/sglang_throughput.py" --model "/tmp/models/$MODEL" \
  --out "$OUT" --budget-s "$BUDGET_S" "$@" 2>&1 | tee -a "$OUT/run.log"
rc=${PIPESTATUS[0]}
set -e
python3 -m hsextract.sglang.server stop /tmp/hsx-bench-state >/dev/null 2>&1 || true
tail -c 300000 /tmp/hsx-bench-state/replica-0.log >"$OUT/server-capture.log" 2>/dev/null || true
# every prefill batch of both servers (size, queue, throughput), whatever the tail above cut off
grep -h "Prefill batch" /tmp/hsx-bench-state/replica-0.log >"$OUT/server-capture-prefill-batches.log" 2>/dev/null || true
grep -h "Prefill batch" "$OUT/server-plain.log" >"$OUT/server-plain-prefill-batches.log" 2>/dev/null || true
echo "exit $rc after $SECONDS s" | tee -a "$OUT/run.log"
exit $rc
