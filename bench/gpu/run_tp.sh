#!/usr/bin/env bash
# Issue 9, one device call (< 9 min) on nvidia-h200-x2: capture under TP=2 (and DP attention) equals TP=1.
#   bash bench/gpu/run_tp.sh   (with .whl/one, .whl/extra beside the checkout; on a 2-GPU host)
# Smoke test of the TP=1 half on the single-GPU kind (both TP=1 servers on GPU 0, no TP=2):
#   TP_ONLY1=1 bash bench/gpu/run_tp.sh   (with .whl/one, .whl/extra beside the checkout; on one GPU)
# Models (mk_models.py): small DeepseekV3 (MLA + MoE, 8 layers, aux 2,4,6 -> capture 3,5,7, all MoE layers
# behind TP all-reduces) and tiny Llama (aux 1,3,5). Phases, each run under its own `timeout`, skipped when
# the budget (BUDGET_S after set-up, default 450 s) cannot hold it:
#   1. deepseek-tp1 (GPU 0) and llama-tp1 (GPU 1; GPU 0 with TP_ONLY1) in parallel, 32 prompts (a quarter
#      of them 400-900 tokens, chunked at 128), then 6 again one at a time (the "-alone" runs);
#   2. deepseek-tp2 (GPUs 0,1)  3. llama-tp2  4. deepseek-dp2 (--enable-dp-attention --dp 2 --tp 2).
# After each phase tp_compare.py compare rewrites $OUT/tp-<model>.{json,md}, so a kill keeps what ran.
# Results: tp-<model>.{json,md}, tp.md, runs/<run>.json (writer check, markers, stats, timings, error),
# server-<run>.log, run.log, machine.txt, compat.json.
# CPU dry run of this script's plumbing (tests/fake_sglang.py instead of SGLang; one fake process, so the
# TP=2 writer checks FAIL one_marker_per_rank there, as they must):
#   TP_DRY=1 PY=$PWD/.venv/bin/python OUT=/tmp/tpdry-out bash bench/gpu/run_tp.sh
if [ "${TP_DRY:-0}" = 1 ]; then
  set -euo pipefail
  REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd); OUT=${OUT:-/tmp/hsx-out}; mkdir -p "$OUT"
  export PYTHONPATH=$REPO/src:$REPO/tests; SGL_COMMON=""; SGL_SMALL=""; : >"$OUT/machine.txt"
  FAKE="--module fake_sglang"
  pack_out() { :; }  # results stay unpacked under $OUT
else
  source "$(dirname "$0")/setup.sh"
  FAKE=""
fi
PY=${PY:-python3}
# NVLink multicast stays off on the lent machines (device KINDS.md); the servers inherit this environment
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$REPO/bench/gpu"
MODELS=${MODELS_DIR:-/tmp/models}; RUNS=/tmp/tp-runs; rm -rf "$RUNS"; mkdir -p "$RUNS" "$OUT/runs"
ARGS=$SGL_SMALL
N=${N:-32}
{ nvidia-smi topo -m; env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)_' | sort; } >>"$OUT/machine.txt" 2>&1 || true

finish() {
  for d in /tmp/state-tp-*; do
    [ -d "$d" ] || continue
    for f in "$d"/replica-*.log; do [ -f "$f" ] && tail -c 200000 "$f" >"$OUT/server-${d#/tmp/state-tp-}.log"; done
    $PY -m hsextract.sglang.server stop "$d" >/dev/null 2>&1 || true
  done
  cp "$RUNS"/*.json "$OUT/runs/" 2>/dev/null || true
  $PY -m hsextract.sglang.compat --site /tmp/site --json "$OUT/compat.json" >/dev/null 2>&1 || true
  cat "$OUT"/tp-*.md >"$OUT/tp.md" 2>/dev/null || true
  echo "exit ${rc:-?} after ${SECONDS} s" | tee -a "$OUT/run.log"
  pack_out
}
trap finish EXIT

$PY mk_models.py $MODELS >"$OUT/mk_models.log" 2>&1
END=$((SECONDS + ${BUDGET_S:-450}))
rc=0
echo "set-up done at ${SECONDS} s (TP_ONLY1=${TP_ONLY1:-0})" | tee "$OUT/run.log"

aux_of() { case $1 in deepseek) echo "2 4 6";; llama) echo "1 3 5";; esac; }

# capture RUN MODEL TP DP "GPUS" PORT [--again K]: one server, one extraction, its json in $RUNS
capture() {
  local run=$1 model=$2 tp=$3 dp=$4 gpus=$5 port=$6; shift 6
  local left=$((END - SECONDS))
  if [ "$left" -lt 100 ]; then
    echo "== $run SKIPPED (budget: ${left} s left)" | tee -a "$OUT/run.log"
    printf '{"name": "%s", "tp": %s, "dp": %s, "error": "skipped: %s s of the budget left"}\n' \
      "$run" "$tp" "$dp" "$left" >"$RUNS/$run.json"
    return 1
  fi
  local t=$(( left - 10 < 240 ? left - 10 : 240 ))
  echo "== $run (tp $tp, dp $dp, gpus $gpus), timeout ${t} s, at ${SECONDS} s" | tee -a "$OUT/run.log"
  local r=0
  timeout -k 10 "$t" $PY tp_compare.py capture --model $MODELS/$model --name $run --aux $(aux_of $model) \
    --tp $tp --dp $dp --gpus $gpus --state /tmp/state-tp-$run --runs "$RUNS" --port $port --n $N \
    --sgl-args "$ARGS" $FAKE --chunked-prefill-size 128 --startup-timeout $(( t - 40 )) "$@" >>"$OUT/run.log" 2>&1 || r=$?
  $PY -m hsextract.sglang.server stop /tmp/state-tp-$run >/dev/null 2>&1 || true  # in case timeout killed it
  echo "== $run exit $r at ${SECONDS} s" | tee -a "$OUT/run.log"
  return $r
}

# compare MODEL CANDIDATE...: rewrites $OUT/tp-MODEL.{json,md}
compare() {
  local model=$1; shift
  $PY tp_compare.py compare --model $MODELS/$model --name $model --aux $(aux_of $model) \
    --runs "$RUNS" --out "$OUT" --ref $model-tp1 --cands "$@" >>"$OUT/run.log" 2>&1
}

# 1. the references, in parallel (the first start pays the triton JIT)
g2=1; [ "${TP_ONLY1:-0}" = 1 ] && g2=0
capture deepseek-tp1 deepseek 1 1 "0" 30101 --again 6 & p1=$!
capture llama-tp1 llama 1 1 "$g2" 30102 --again 6 & p2=$!
wait $p1 || rc=1
wait $p2 || rc=1
if [ "${TP_ONLY1:-0}" = 1 ]; then
  compare deepseek deepseek-tp1-alone || rc=1
  compare llama llama-tp1-alone || rc=1
  exit $rc
fi
# 2-4. TP=2, then DP attention; each comparison written as soon as its run is done
capture deepseek-tp2 deepseek 2 1 "0 1" 30103 || rc=1
compare deepseek deepseek-tp2 deepseek-tp1-alone || rc=1
capture llama-tp2 llama 2 1 "0 1" 30104 || rc=1
compare llama llama-tp2 llama-tp1-alone || rc=1
capture deepseek-dp2 deepseek 2 2 "0 1" 30105 || rc=1
compare deepseek deepseek-tp2 deepseek-dp2 deepseek-tp1-alone || rc=1
exit $rc
