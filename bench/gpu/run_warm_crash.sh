#!/usr/bin/env bash
# One device call (< 10 min, one GPU): what makes SGLang 0.5.16 crash at the warm-up request of the tiny
# DeepseekV3 with its former head widths (qk_nope/qk_rope/v 32, kv_lora 256; bench/README.md, "the warm-up
# crash"). Plain SGLang, no plugin, the bundle's small-model flags. Starts, one after the other, each a fresh
# server on the same model, each ending at its "fired up" line (served), an illegal memory access or the death
# of the server (crash), or START_S (hung):
#   cold       TRITON_CACHE_DIR empty (the kernels compiled at this start)
#   warm       the same cache, now holding them (the crash seen before)
#   no-overlap warm cache, --disable-overlap-schedule (a race between the scheduler's streams?)
#   no-graph   warm cache, --disable-cuda-graph (the decode graphs captured from the cached kernels?)
#   recompile  warm cache, TRITON_ALWAYS_COMPILE=1 (compiled again: the cache's kernels, or fast launches?)
#   fresh      another empty cache (is it the cache, or anything else this machine kept?)
#   kimi-cold, kimi-warm (KIMI=1) the tiny model as built now (Kimi-K2.5's widths): the control
#   STARTS="cold fresh-b recompile-b fresh2" instead: those starts alone, in that order, where fresh-b (another
#   empty cache) and recompile-b (cache a, TRITON_ALWAYS_COMPILE=1) run with CUDA_LAUNCH_BLOCKING=1, so that a
#   crash names the kernel launch at fault (its innermost frame goes into the table), and fresh2 is one more
#   empty cache without it
# A start that could not end within BUDGET_S (default 540) of the script's start is skipped.
#   bash bench/gpu/run_warm_crash.sh   (with .whl/one, .whl/extra beside the checkout)
# Results: warm-crash.md (one row a start), server-<start>.log, run.log (packed into all.tgz on exit).
set -euo pipefail
source "$(dirname "$0")/setup.sh"
cd "$REPO"
# SGLang alone: without the plugin's entry point (setup.sh's /tmp/plug)
PYTHONPATH=$(printf '%s' "$PYTHONPATH" | tr ':' '\n' | grep -vx /tmp/plug | paste -sd: -)
START_S=${START_S:-200} BUDGET_S=${BUDGET_S:-540}
M=/tmp/wc-models; rm -rf "$M" /tmp/wc-tc-*; mkdir -p "$M"
python3 - "$M" ${KIMI:+kimi} >"$OUT/models.log" 2>&1 <<'PYEOF'
import sys
from pathlib import Path
from hsextract.tinymodel.build import make_tiny_model
out, data = Path(sys.argv[1]), Path("data/conversations.jsonl")
make_tiny_model(out / "old", data, kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
if len(sys.argv) > 2:
    make_tiny_model(out / "kimi", data)
PYEOF
echo "| start | model | triton cache | env / flags | result | seconds |" >"$OUT/warm-crash.md"
echo "|---|---|---|---|---|---|" >>"$OUT/warm-crash.md"

# start NAME MODEL CACHE ENV FLAGS: one server, its verdict in warm-crash.md
start() {
  local name=$1 model=$2 cache=$3 envs=$4 flags=$5 log=$OUT/server-$1.log t=$SECONDS verdict=hung
  if [ $((SECONDS + START_S)) -gt "$BUDGET_S" ]; then echo "| $name | $model | | | skipped (budget) | |" \
    | tee -a "$OUT/warm-crash.md"; return; fi
  mkdir -p "$cache"
  # its own session, so that the kill below takes the scheduler and detokenizer processes too
  env TRITON_CACHE_DIR="$cache" $envs setsid python3 -m sglang.launch_server --model-path "$M/$model" \
    --port 30500 --host 127.0.0.1 $SGL_SMALL $flags >"$log" 2>&1 &
  local pid=$!
  while [ $((SECONDS - t)) -lt "$START_S" ]; do
    if grep -q "fired up and ready" "$log"; then verdict=served; break; fi
    if grep -qi "illegal memory access" "$log"; then verdict="crash: illegal memory access"; break; fi
    if ! kill -0 "$pid" 2>/dev/null; then verdict="died: $(grep -m1 -iE 'error' "$log" | cut -c1-120 || true)"; break; fi
    sleep 1
  done
  local secs=$((SECONDS - t))
  # the innermost frame of the traceback that reported it (with CUDA_LAUNCH_BLOCKING=1: the faulting launch)
  if [ "${verdict#crash}" != "$verdict" ]; then
    sleep 2
    verdict="$verdict at $(grep -B 40 -m1 -i 'illegal memory access' "$log" | grep -E '^ *File ' | tail -n 1 \
      | sed -E 's#.*/(site|site-packages)/##; s/"//g' | cut -c1-110 || true)"
  fi
  kill -9 -- -"$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  # the port and the GPU free again before the next start
  local w=0
  while nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -q . && [ $((w += 1)) -lt 60 ]; do
    sleep 1; done
  echo "| $name | $model | ${cache#/tmp/} ($(find "$cache" -name '*.cubin' | wc -l) cubins) | ${envs:--} ${flags:-} | $verdict | $secs |" \
    | tee -a "$OUT/warm-crash.md" | tee -a "$OUT/run.log"
}
one() {
  case $1 in
    cold) start cold old /tmp/wc-tc-a "" "" ;;
    warm) start warm old /tmp/wc-tc-a "" "" ;;
    no-overlap) start no-overlap old /tmp/wc-tc-a "" "--disable-overlap-schedule" ;;
    no-graph) start no-graph old /tmp/wc-tc-a "" "--disable-cuda-graph" ;;
    recompile) start recompile old /tmp/wc-tc-a "TRITON_ALWAYS_COMPILE=1" "" ;;
    fresh) start fresh old /tmp/wc-tc-b "" "" ;;
    kimi-cold) start kimi-cold kimi /tmp/wc-tc-k "" "" ;;
    kimi-warm) start kimi-warm kimi /tmp/wc-tc-k "" "" ;;
    fresh-b) start fresh-b old /tmp/wc-tc-c "CUDA_LAUNCH_BLOCKING=1" "" ;;
    recompile-b) start recompile-b old /tmp/wc-tc-a "TRITON_ALWAYS_COMPILE=1 CUDA_LAUNCH_BLOCKING=1" "" ;;
    fresh2) start fresh2 old /tmp/wc-tc-d "" "" ;;
    *) echo "unknown start $1" >&2; exit 2 ;;
  esac
}
for s in ${STARTS:-cold warm no-overlap no-graph recompile fresh ${KIMI:+kimi-cold kimi-warm}}; do one "$s"; done
echo "done after ${SECONDS} s" | tee -a "$OUT/run.log"
