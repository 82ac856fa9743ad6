#!/usr/bin/env bash
# One device call (~8 min): why the workflow's tiny DeepseekV3 crashed SGLang 0.5.16 at its warm-up
# (bench/README.md runs 12, 14), variant by variant (bench/gpu/diag_eager_moe.py). Results: $OUT/diag-eager.json,
# one server log per variant, run.log.
#   run(command="bash bench/gpu/run_diag_eager.sh", carry=[".whl/one", ".whl/extra"], timeout_s=600)
source "$(dirname "$0")/setup.sh"
cd "$REPO/bench/gpu"
python3 mk_models.py /tmp/models >"$OUT/mk_models.log" 2>&1
ARGS=$SGL_SMALL
python3 diag_eager_moe.py --model /tmp/models/${MODEL:-tiny} --aux 1 5 7 --sgl-args "$ARGS" --out "$OUT" \
  --budget-s "${BUDGET_S:-480}" ${VARIANTS:+--variants "$VARIANTS"} 2>&1 | tee "$OUT/run.log"
python3 - "$OUT/diag-eager.json" <<'PY' | tee "$OUT/diag-eager.md"
import json, sys
rows = json.load(open(sys.argv[1]))
print("| variant | started | start s | answers ok | alive after | illegal access |\n|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['variant']} | {r.get('started', r.get('skipped'))} | {r.get('start_s')} | {r.get('answers_ok')} "
          f"| {r.get('alive_after')} | {r.get('illegal_access')} |")
for r in rows:
    if r.get("traceback"):
        print(f"\n#### {r['variant']}\n```\n" + "\n".join(r["traceback"][-25:]) + "\n```")
PY
