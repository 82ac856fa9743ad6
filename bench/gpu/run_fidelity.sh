#!/usr/bin/env bash
# One device call (< 9 min): small DeepseekV3, the workflow's tiny DeepseekV3 and a tiny Llama through the
# patched SGLang 0.5.16 server with this project's plugin, against the transformers engine on the same GPU.
# Results: $OUT/fidelity-<name>.{json,md}, $OUT/<name>-{plugin,stats}-*.json, server logs, run.log.
#   run(command="bash bench/gpu/run_fidelity.sh", carry=[".whl/one", ".whl/extra"], timeout_s=600)
# Default order: tiny-fixed (routing made unambiguous: the control for MoE flips) and tiny first, then the
# two that passed on 2026-12-02; the budget skips what does not fit. MODELS picks which to run, in order (name:aux ids, one server each; the first start pays the triton JIT,
# ~2 min, later ones ~1 min). MoE models first: they carry the new per-token checks. A model that does not
# fit in the remaining budget (BUDGET_S, default 420 s after set-up) is skipped and says so in its .md.
# The servers run prefills eagerly (sglang.prefill_cuda_graph false, the default); PREFILL_GRAPH=1 puts
# them on SGLang's FULL-mode prefill graphs, as every fidelity run before 2026-12-03 run 11 did.
source "$(dirname "$0")/setup.sh"
cd "$REPO/bench/gpu"
python3 mk_models.py /tmp/models >"$OUT/mk_models.log" 2>&1
ARGS=$SGL_SMALL
END=$((SECONDS + ${BUDGET_S:-420}))
rc=0
echo "set-up done at ${SECONDS} s" | tee "$OUT/run.log"
for spec in ${MODELS:-tiny-fixed:1,5,7 tiny:1,5,7 deepseek:2,4,6 llama:1,3,5}; do
  name=${spec%%:*}; aux=${spec#*:}; port=$((30000 + ${#name}))
  left=$((END - SECONDS))
  if [ "$left" -lt 100 ]; then
    echo "### $name: SKIPPED (budget: ${left} s left)" | tee "$OUT/fidelity-$name.md" | tee -a "$OUT/run.log"; rc=1; continue
  fi
  t=$(( left - 10 < 280 ? left - 10 : 280 ))
  echo "== $name (aux $aux), timeout ${t} s, at ${SECONDS} s" | tee -a "$OUT/run.log"
  set +e
  timeout -k 10 "$t" python3 fidelity.py --model /tmp/models/$name --name $name --aux ${aux//,/ } \
    --state /tmp/state-$name --out "$OUT" --sgl-args "$ARGS" --chunked-prefill-size 128 --port $port \
    --startup-timeout $(( t - 60 )) ${PREFILL_GRAPH:+--prefill-cuda-graph} >>"$OUT/run.log" 2>&1
  r=$?
  set -e
  [ "$r" -ne 0 ] && rc=1
  echo "== $name exit $r at ${SECONDS} s" | tee -a "$OUT/run.log"
  python3 -m hsextract.sglang.server stop /tmp/state-$name >/dev/null 2>&1 || true  # in case timeout killed the script
done
for f in /tmp/state-*/replica-*.log; do [ -f "$f" ] && tail -c 200000 "$f" >"$OUT/server-$(basename "$(dirname "$f")").log"; done
python3 -m hsextract.sglang.compat --site /tmp/site --json "$OUT/compat.json" >/dev/null 2>&1 || true
cat "$OUT"/fidelity-*.md >"$OUT/fidelity.md" 2>/dev/null || true
echo "exit $rc after ${SECONDS} s" | tee -a "$OUT/run.log"
exit $rc
