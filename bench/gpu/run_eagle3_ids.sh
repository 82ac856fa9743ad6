#!/usr/bin/env bash
# One device call (~4 min): SGLang's own EAGLE-3 capture, set up with the drafter-config ids hsextract exports,
# against the layers hsextract stores (eagle3_ids.py's docstring says what is checked), for the routing-fixed small
# DeepseekV3 (SGLang's raw-ids rule) and the tiny Llama (+1 rule).
#   bash bench/gpu/run_eagle3_ids.sh   (with .whl/one, .whl/extra beside the checkout)
# Results: $OUT/eagle3-<name>.{json,md}, $OUT/eagle3.md, server logs, run.log (packed into $OUT/all.tgz on exit).
set -euo pipefail
source "$(dirname "$0")/setup.sh"
cd "$REPO/bench/gpu"
MODELS=${MODELS:-deepseek-fixed llama}
python3 mk_models.py /tmp/models --only $MODELS >"$OUT/mk_models.log" 2>&1
rc=0
for name in $MODELS; do
  echo "== $name at ${SECONDS} s" | tee -a "$OUT/run.log"
  set +e
  timeout -k 10 ${PER_MODEL_S:-280} python3 eagle3_ids.py --model /tmp/models/$name --name $name \
    --state /tmp/e3-$name --out "$OUT" --sgl-args "$SGL_SMALL" --port $((30100 + ${#name})) >>"$OUT/run.log" 2>&1
  r=$?
  set -e
  [ "$r" -ne 0 ] && rc=1
  python3 -m hsextract.sglang.server stop /tmp/e3-$name >/dev/null 2>&1 || true
  for f in /tmp/e3-$name/replica-*.log; do [ -f "$f" ] && tail -c 100000 "$f" >"$OUT/server-$name.log"; done
  echo "== $name exit $r at ${SECONDS} s" | tee -a "$OUT/run.log"
done
cat "$OUT"/eagle3-*.md >"$OUT/eagle3.md" 2>/dev/null || true
echo "exit $rc after ${SECONDS} s" | tee -a "$OUT/run.log"
exit $rc
