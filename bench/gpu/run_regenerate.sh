#!/usr/bin/env bash
# One device call (< 10 min, one GPU): regeneration through SGLang (regenerate.engine: sglang, server_url), the
# workflow's own rules (regenerate_chunk, regenerate_concat), against plain SGLang 0.5.16 servers serving the
# routing-fixed twin of `python -m hsextract.tinymodel --packaging kimi-k25 --tokenizer kimi`
# (production_tools.py twin). Two servers, started together, each with the bundle's small-model flags:
#   S1  as a user starts one
#   S2  --enable-deterministic-inference (SGLang then honours a request's sampling_seed)
# Every run: 32 conversations of data/, thinking off (the random model never closes a <think>), max_new_tokens 32.
#   g1      S1, greedy: `snakemake --cores 8 --resources gpu=1` to the end (prepare reads the regenerated file;
#           extract with the transformers engine on the GPU); verdict: rc 0, all_valid, the regeneration's stats
#   g2      S1, temperature 0.8, send_seed true: must be refused by the seeding check (S1 would drop the seeds)
#   g3a/b   S2, temperature 0.8, seed 0, batch_size 16 then 1: byte-identical conversations.jsonl if the seed,
#           not how requests were batched, decides what is sampled (FAIL otherwise; with random norm weights they
#           differ in 6 of 32: bench/README.md, the logits are not bit-equal across the prefills' batching)
#   g3c     S2, seed 1: must differ from g3a
#   g3d     (G3_MORE=1) S2, g3a's config again: run to run at the same batch_size
#   g3e/f   (G3_MORE=1) S3 (--enable-deterministic-inference --disable-radix-cache), seed 0, batch_size 16 then 1
#           g3's files are kept under $OUT/g3-files/
#   g1-ref  (last) g1's regeneration with regenerate.engine: transformers (on the GPU): each record's first assistant
#           turn (whose context is the input's alone) compared with g1's (regen_tools.py compare), as information:
#           two engines' bf16 numerics may part on a near-tie of a random model's logits
# Steps run in that order, each under a limit cut to what is left of BUDGET_S (default 540); STEPS="g1 g1-ref"
# (say) runs those alone (S1 only for g1 and g2, S2 only for g3).
#   bash bench/gpu/run_regenerate.sh   (with .whl/one, .whl/extra, .whl/smk beside the checkout)
# Results: regenerate.md (a row a step), steps.jsonl, logs/, server logs (packed into all.tgz on exit).
# CPU rehearsal (regen_tools.py serve stands in for both servers, this project's transformers generator behind
# SGLang's HTTP API, one request at a time; g1-ref, in batches of 16, then agrees but on near-ties):
#   REGEN_DRY=1 PY=$PWD/.venv/bin/python OUT=/tmp/regen-dry bash bench/gpu/run_regenerate.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
if [ -n "${REGEN_DRY:-}" ]; then
  OUT=${OUT:-/tmp/regen-dry}; rm -rf "$OUT"; mkdir -p "$OUT"
  PY=${PY:?PY: an absolute path to a Python with the project installed}; DEVICE=cpu
  export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH} PATH=$(dirname "$PY"):$PATH
  pack_out() { :; }
  echo "REGEN_DRY: regen_tools.py serve stands in for SGLang, CPU" >"$OUT/machine.txt"
else
  source "$HERE/setup.sh"
  PY=python3; DEVICE=cuda
  PYTHONPATH=$(printf '%s' "$PYTHONPATH" | tr ':' '\n' | grep -vx /tmp/plug | paste -sd: -)  # SGLang alone
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/smk \
    $(ls "$REPO"/.whl/smk/*.whl | grep -v '/setuptools-') >"$OUT/pip-smk.log" 2>&1
  export PATH=/tmp/smk/bin:$PATH PYTHONPATH=$PYTHONPATH:/tmp/smk
fi
export HF_HUB_OFFLINE=1
WD=/tmp/regen-wd; rm -rf "$WD"; mkdir -p "$WD" "$OUT/logs"
tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./results --exclude=./logs \
  --exclude=./.snakemake --exclude='*/__pycache__' -cf - . | tar -C "$WD" -xf -
cd "$WD"
T0=$SECONDS
# every step's limit is cut to what is left of BUDGET_S (default 540: one device call); the rehearsal's CPU
# runs the model itself, several times slower
END=$((T0 + ${BUDGET_S:-540})); SCALE=1; [ -z "${REGEN_DRY:-}" ] || SCALE=4
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$OUT/run.log"; }

M=/tmp/regen-models; rm -rf "$M"; mkdir -p "$M"
"$PY" -m hsextract.tinymodel --packaging kimi-k25 --tokenizer kimi --out "$M/mini" \
  --conversations data/conversations.jsonl >"$OUT/logs/models.log" 2>&1
"$PY" "$HERE/production_tools.py" twin "$M/mini" "$M/twin" >>"$OUT/logs/models.log" 2>&1
"$PY" "$HERE/production_tools.py" refsample "$M/twin" "$M/ref.pt" >>"$OUT/logs/models.log" 2>&1
log "models built"

# ---- the two servers, started together
PIDS=()
start_server() {  # NAME PORT EXTRA_FLAGS
  if [ -n "${REGEN_DRY:-}" ]; then
    setsid "$PY" "$HERE/regen_tools.py" serve "$M/twin" --port "$2" \
      $([ -n "$3" ] && echo --deterministic) >"$OUT/server-$1.log" 2>&1 &
  else
    # shellcheck disable=SC2086
    setsid python3 -m sglang.launch_server --model-path "$M/twin" --trust-remote-code --host 127.0.0.1 \
      --port "$2" $SGL_SMALL $3 >"$OUT/server-$1.log" 2>&1 &
  fi
  PIDS+=($!)
}
stop_servers() { for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; }
RECORDS=$OUT/steps.jsonl; : >"$RECORDS"
finish() {
  local rc=$?
  stop_servers
  "$PY" "$HERE/regen_tools.py" summary "$RECORDS" "$OUT/regenerate.md" || true
  cp -r "$WD/logs" "$OUT/workflow-logs" 2>/dev/null || true
  log "exit $rc after $((SECONDS - T0)) s"
  pack_out
  return $rc
}
trap finish EXIT
WANT=" ${STEPS:-g1 g2 g3 g1-ref} "
want() { [[ "$WANT" == *" $1 "* ]]; }
PORTS=""
if want g1 || want g2; then start_server s1 30100 ""; PORTS="30100"; fi
if want g3; then start_server s2 30200 "--enable-deterministic-inference"; PORTS="$PORTS 30200"; fi
if want g3 && [ -n "${G3_MORE:-}" ]; then
  start_server s3 30300 "--enable-deterministic-inference --disable-radix-cache"; PORTS="$PORTS 30300"
fi
up() { "$PY" -c "import sys; from hsextract.sglang.api import health; sys.exit(health(sys.argv[1]) is not None)" "$1"; }
for port in $PORTS; do
  until up "http://127.0.0.1:$port"; do
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { log "a server died at start"; exit 1; }; done
    [ $((SECONDS - T0)) -lt 420 ] || { log "servers not up in time"; exit 1; }
    sleep 2
  done
done
log "servers up"

# record NAME RC SECS VERDICT [DETAIL_JSON_FILE]
record() {
  "$PY" - "$@" >>"$RECORDS" <<'PYEOF'
import json, sys, pathlib
name, rc, secs, verdict = sys.argv[1:5]
detail = json.loads(pathlib.Path(sys.argv[5]).read_text()) if len(sys.argv) > 5 and sys.argv[5] else None
print(json.dumps({"name": name, "rc": int(rc), "seconds": int(secs), "verdict": verdict, "detail": detail}))
PYEOF
}
# config NAME ENGINE URL TEMPERATURE SEED BATCH: config/NAME.yaml, run_name NAME
config() {
  cat >"config/$1.yaml" <<EOF
run_name: $1
model: $M/twin
make_tiny_model: false
reference_sample: $M/ref.pt
sources:
  - {path: data/conversations.jsonl, format: messages, max_records: 32}
prompts_per_chunk: 16
chat_template_kwargs: {thinking: false}
transformers: {device: $DEVICE}
extract: {retries: 0}
regenerate: {enabled: true, engine: $2, server_url: $3, temperature: $4, seed: $5, batch_size: $6,
             max_new_tokens: 32, device: $DEVICE, retries: 0}
EOF
}
# run NAME LIMIT [TARGET]: Snakemake on config/NAME.yaml (LIMIT x SCALE, at most what is left); sets RC, SECS
run() {
  local t=$SECONDS limit=$(($2 * SCALE)) left=$((END - SECONDS - 10))
  [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -lt 20 ]; then RC=125 SECS=0; log "$1: SKIPPED (budget)"; return; fi
  set +e
  # the target before --configfile, which takes every word after it
  timeout -k 10 "$limit" snakemake ${3:+"$3"} --cores 8 --resources gpu=1 --configfile "config/$1.yaml" \
    >"$OUT/logs/$1.log" 2>&1
  RC=$?
  set -e
  SECS=$((SECONDS - t))
  log "$1: rc $RC in $SECS s"
}
regen() { echo "results/$1/regenerated/conversations.jsonl"; }
stats() { "$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); print(json.dumps(d))" \
  "results/$1/regenerated/conversations.stats.json" 2>/dev/null || echo '{}'; }

S1=http://127.0.0.1:30100 S2=http://127.0.0.1:30200
if want g1; then
config g1 sglang "$S1" 0 0 16
run g1 150
VALID=$("$PY" -c "import json; print(json.load(open('results/g1/dataset.json')).get('all_valid'))" 2>/dev/null || echo missing)
stats g1 >"$OUT/g1-stats.json"
record g1 "$RC" "$SECS" "dataset all_valid: $VALID" "$OUT/g1-stats.json"
fi

if want g2; then
config g2 sglang "$S1" 0.8 0 16
run g2 60 "$(regen g2)"
MSG=$(grep -o "ignores the per-request sampling_seed" "$OUT/logs/g2.log" "logs/g2/regenerate/"*.log 2>/dev/null | head -n 1 || true)
record g2 "$RC" "$SECS" "$([ "$RC" != 0 ] && [ -n "$MSG" ] && echo "PASS: refused (ignores the per-request sampling_seed)" || echo "FAIL: rc $RC, message: ${MSG:-none}")"
fi

if want g3; then
config g3a sglang "$S2" 0.8 0 16; run g3a 60 "$(regen g3a)"; A_RC=$RC A_S=$SECS
config g3b sglang "$S2" 0.8 0 1; run g3b 90 "$(regen g3b)"; B_RC=$RC
config g3c sglang "$S2" 0.8 1 16; run g3c 60 "$(regen g3c)"; C_RC=$RC
SAME_AB=$("$PY" "$HERE/regen_tools.py" same "$(regen g3a)" "$(regen g3b)" 2>&1 || true)
SAME_AC=$("$PY" "$HERE/regen_tools.py" same "$(regen g3a)" "$(regen g3c)" 2>&1 || true)
V="rc $A_RC/$B_RC/$C_RC; seed 0 batch 16 vs 1: $SAME_AB; seed 0 vs 1: $SAME_AC"
case "$SAME_AB|$SAME_AC|$A_RC$B_RC$C_RC" in identical*"|differ"*"|000") V="PASS: $V" ;; *) V="FAIL: $V" ;; esac
stats g3a >"$OUT/g3a-stats.json"
record g3 "$A_RC" "$A_S" "$V" "$OUT/g3a-stats.json"
if [ -n "${G3_MORE:-}" ]; then
  S3=http://127.0.0.1:30300
  config g3d sglang "$S2" 0.8 0 16; run g3d 60 "$(regen g3d)"; D_RC=$RC D_S=$SECS
  SAME_AD=$("$PY" "$HERE/regen_tools.py" same "$(regen g3a)" "$(regen g3d)" 2>&1 || true)
  record g3d "$D_RC" "$D_S" "seed 0 batch 16, run again: $SAME_AD"
  config g3e sglang "$S3" 0.8 0 16; run g3e 60 "$(regen g3e)"; E_RC=$RC E_S=$SECS
  config g3f sglang "$S3" 0.8 0 1; run g3f 90 "$(regen g3f)"; F_RC=$RC
  SAME_EF=$("$PY" "$HERE/regen_tools.py" same "$(regen g3e)" "$(regen g3f)" 2>&1 || true)
  record g3ef "$E_RC" "$E_S" "radix cache off, rc $E_RC/$F_RC; seed 0 batch 16 vs 1: $SAME_EF"
fi
mkdir -p "$OUT/g3-files"
for r in g3a g3b g3c g3d g3e g3f; do [ ! -f "$(regen $r)" ] || cp "$(regen $r)" "$OUT/g3-files/$r.jsonl"; done
fi

if want g1-ref; then
config g1-ref transformers null 0 0 16
run g1-ref 120 "$(regen g1-ref)"
CMP=""
if [ -f "$(regen g1)" ] && [ -f "$(regen g1-ref)" ]; then
  "$PY" "$HERE/regen_tools.py" compare "$(regen g1)" "$(regen g1-ref)" --model "$M/twin" \
    --out "$OUT/g1-compare.json" >/dev/null 2>>"$OUT/run.log" && CMP=$OUT/g1-compare.json
fi
record g1-ref "$RC" "$SECS" "transformers on the GPU; first turns against g1: see detail" "$CMP"
fi
