#!/usr/bin/env bash
# One device call (< 9 min): the patched SGLang 0.5.16 server with this project's plugin against the transformers
# engine on the same GPU, every final state checked directly (fidelity.py's docstring says what is checked).
#   bash bench/gpu/run_fidelity.sh   (with .whl/one, .whl/extra beside the checkout)
# Results: $OUT/fidelity-<name>.{json,md}, $OUT/fidelity.md (all models), server logs, run.log (packed into
# $OUT/all.tgz on exit, summaries beside it).
# MODELS (name:aux, aux = comma-separated ids or a capture preset): by default the small DeepseekV3 with the
# eagle3 preset ([2, 4, 5] of 8 layers) and the small Llama with the dflash preset (5 aux layers: [1, 2, 3, 4,
# 5]). Every MoE model also runs as its routing-fixed twin NAME-fixed (added when missing), checked per sample
# with the dense bounds: flipped tokens of the random-routing model are then routing near-ties, not capture
# errors. The first server start pays the triton JIT (~2 min), later ones ~1 min; a model that does not fit in
# the remaining budget (BUDGET_S, default 440 s after set-up) is skipped, says so, and fails the run.
# CPU dry run of the whole script without SGLang or a GPU (the candidate is the transformers engine batched
# with padding; same models, checks and files; tests/test_bench_dryrun.py runs it):
#   FID_DRY=1 PY=$PWD/.venv/bin/python OUT=/tmp/fid-dry bash bench/gpu/run_fidelity.sh
set -euo pipefail
if [ -n "${FID_DRY:-}" ]; then
  REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  OUT=${OUT:-/tmp/fid-dry}; mkdir -p "$OUT"
  PY=${PY:-python3}
  export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH} HSX_DEVICE=cpu
  CAND="--candidate transformers-batched --n ${FID_N:-4} --max-len 48 --alone 2 --direct-hf 2"
  BUDGET_S=${BUDGET_S:-3000}
else
  source "$(dirname "$0")/setup.sh"
  PY=python3
  CAND=""
fi
cd "$REPO/bench/gpu"
SPECS=${MODELS:-deepseek:eagle3 llama:dflash}
# every MoE model gets its routing-fixed twin, right after it
LIST=""
for spec in $SPECS; do
  name=${spec%%:*}; aux=${spec#*:}
  LIST="$LIST $spec"
  case "$name" in
    *-fixed) ;;
    deepseek|tiny) [[ " $SPECS " == *" $name-fixed:"* ]] || LIST="$LIST $name-fixed:$aux" ;;
  esac
done
NAMES=$(for spec in $LIST; do echo -n "${spec%%:*} "; done)
"$PY" mk_models.py ${MODELS_DIR:-/tmp/models} --only $NAMES >"$OUT/mk_models.log" 2>&1
ARGS=${SGL_SMALL:-}
END=$((SECONDS + ${BUDGET_S:-440}))
rc=0
echo "set-up done at ${SECONDS} s; models:$LIST" | tee "$OUT/run.log"
for spec in $LIST; do
  name=${spec%%:*}; aux=${spec#*:}; port=$((30000 + ${#name}))
  checks=auto
  [[ "$name" == *-fixed ]] && checks=sample  # the twin must pass the dense per-sample bounds
  left=$((END - SECONDS))
  if [ "$left" -lt 100 ]; then
    echo "### $name: SKIPPED (budget: ${left} s left)" | tee "$OUT/fidelity-$name.md" | tee -a "$OUT/run.log"; rc=1; continue
  fi
  cap=${FID_DRY:+900}; cap=${cap:-280}
  t=$(( left - 10 < cap ? left - 10 : cap ))
  echo "== $name (aux $aux, checks $checks), timeout ${t} s, at ${SECONDS} s" | tee -a "$OUT/run.log"
  set +e
  timeout -k 10 "$t" "$PY" fidelity.py --model "${MODELS_DIR:-/tmp/models}/$name" --name $name --aux ${aux//,/ } \
    --checks $checks \
    --state /tmp/state-$name --out "$OUT" --sgl-args "$ARGS" --chunked-prefill-size 128 --port $port \
    --startup-timeout $(( t - 60 )) ${PREFILL_GRAPH:+--prefill-cuda-graph} $CAND >>"$OUT/run.log" 2>&1
  r=$?
  set -e
  [ "$r" -ne 0 ] && rc=1
  echo "== $name exit $r at ${SECONDS} s" | tee -a "$OUT/run.log"
  # after a timeout: the server may still run
  [ -z "${FID_DRY:-}" ] && { "$PY" -m hsextract.sglang.server stop /tmp/state-$name >/dev/null 2>&1 || true; }
done
if [ -z "${FID_DRY:-}" ]; then
  for f in /tmp/state-*/replica-*.log; do [ -f "$f" ] && tail -c 200000 "$f" >"$OUT/server-$(basename "$(dirname "$f")").log"; done
  "$PY" -m hsextract.sglang.compat --site /tmp/site --json "$OUT/compat.json" >/dev/null 2>&1 || true
fi
cat "$OUT"/fidelity-*.md >"$OUT/fidelity.md" 2>/dev/null || true
echo "exit $rc after ${SECONDS} s" | tee -a "$OUT/run.log"
exit $rc
