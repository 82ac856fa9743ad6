#!/usr/bin/env bash
# One device call (< 10 min, one GPU): shared prefixes on the patched SGLang 0.5.16 server (docs/SHARED_PREFIX.md
# 5.7), the same synthetic agentic chunk with sharing off and on, side by side (shared_prefix.py's docstring says
# what is measured and checked).
#   bash bench/gpu/run_shared_prefix.sh   (with .whl/one, .whl/extra beside the checkout)
# MODELS (default: deepseek-fixed llama; dense or routing-fixed models only, the per-sample bounds are the dense
# ones): each gets a flat then a shared server, one after the other. The first server start pays the triton JIT
# (~2 min), later ones ~1 min; a model that no longer fits the budget (BUDGET_S, default 500 s after set-up) is
# skipped, says so, and fails the run. SP_ARGS: more arguments for shared_prefix.py (e.g. --convs 48 --turns 12).
# MODELS=llama8b: the Llama-3-8B shape with SGLang's dummy weights (seeded, so both servers hold the same ones), a
# model whose prefill, not the launch overheads, sets the wall time; no transformers reference (no weights on disk).
#   MODELS=llama8b MODEL_TIMEOUT_S=470 BUDGET_S=520 SP_ARGS="--convs 64 --concurrency 64 --shard-threads 16" \
#     bash bench/gpu/run_shared_prefix.sh
# MODEL_TIMEOUT_S: the most one model's flat + shared runs may take (default 300 s).
# Results: $OUT/shared-prefix-<model>.{json,md}, $OUT/shared-prefix.md (all models), server logs, run.log (packed
# into $OUT/all.tgz on exit, the summaries beside it).
# CPU dry run of the whole script without SGLang or a GPU (tests/fake_sglang.py with the real plugin code; the
# reference check FAILS there, the fake's states being no model's):
#   SP_DRY=1 PY=$PWD/.venv/bin/python OUT=/tmp/sp-dry bash bench/gpu/run_shared_prefix.sh
set -euo pipefail
if [ -n "${SP_DRY:-}" ]; then
  REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  OUT=${OUT:-/tmp/sp-dry}; mkdir -p "$OUT"
  PY=${PY:-python3}
  export PYTHONPATH=$REPO/src:$REPO/tests${PYTHONPATH:+:$PYTHONPATH} HSX_DEVICE=cpu
  DRY="--server-module fake_sglang --convs 4 --turns 3 --decl 80 --concurrency 4 --reference 4"
  SGL_SMALL=""
  MODELS=${MODELS:-llama}
else
  source "$(dirname "$0")/setup.sh"
  PY=python3
  DRY=""
fi
cd "$REPO/bench/gpu"
MODELS=${MODELS:-deepseek-fixed llama}
BIG=""; case " $MODELS " in *" llama8b "*) BIG="--llama8b" ;; esac
# shellcheck disable=SC2086 - word lists
"$PY" mk_models.py ${MODELS_DIR:-/tmp/models} $BIG --only $MODELS >"$OUT/mk_models.log" 2>&1
END=$((SECONDS + ${BUDGET_S:-500}))
rc=0
echo "set-up done at ${SECONDS} s; models: $MODELS" | tee "$OUT/run.log"
for name in $MODELS; do
  port=$((30200 + 2 * ${#name}))
  left=$((END - SECONDS))
  if [ "$left" -lt 150 ]; then
    echo "### $name: SKIPPED (budget: ${left} s left)" | tee "$OUT/shared-prefix-$name.md" | tee -a "$OUT/run.log"
    rc=1; continue
  fi
  cap=${MODEL_TIMEOUT_S:-300}
  t=$(( left - 10 < cap ? left - 10 : cap ))
  sgl=$SGL_SMALL; extra=""
  if [ "$name" = llama8b ]; then  # 16 GB of dummy weights; KV room for the shared run's whole radix tree
    sgl="${SGL_COMMON:-} --mem-fraction-static 0.6 --load-format dummy --dtype bfloat16 --max-running-requests 128"
    extra="--reference 0"
  fi
  echo "== $name, timeout ${t} s, at ${SECONDS} s" | tee -a "$OUT/run.log"
  set +e
  # shellcheck disable=SC2086 - extra, DRY and SP_ARGS are word lists
  timeout -k 10 "$t" "$PY" shared_prefix.py --model "${MODELS_DIR:-/tmp/models}/$name" --name "$name" \
    --state "/tmp/sp-state-$name" --out "$OUT" --sgl-args "$sgl" --port "$port" \
    --startup-timeout $(( t / 2 )) $extra $DRY ${SP_ARGS:-} >>"$OUT/run.log" 2>&1
  r=$?
  set -e
  [ "$r" -ne 0 ] && rc=1
  echo "== $name exit $r at ${SECONDS} s" | tee -a "$OUT/run.log"
  for mode in flat shared; do  # after a timeout: a server may still run
    "$PY" -m hsextract.sglang.server stop "/tmp/sp-state-$name/$mode" >/dev/null 2>&1 || true
  done
  rm -f "$OUT/$name"-*.hss  # the shards: compared already, and too big to come back
done
cat "$OUT"/shared-prefix-*.md >"$OUT/shared-prefix.md" 2>/dev/null || true
echo "exit $rc after ${SECONDS} s" | tee -a "$OUT/run.log"
exit $rc
