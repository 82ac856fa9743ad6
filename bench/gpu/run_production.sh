#!/usr/bin/env bash
# Issue 34, one device call (< 10 min, one GPU): the README's production command, literally, on a miniature
# Kimi-K2.5 checkpoint, and the embedded default with engine: sglang.
#   bash bench/gpu/run_production.sh   (with .whl/one, .whl/extra, .whl/smk beside the checkout)
# BUDGET_S (default 520) bounds everything after the set-up (~40 s); a step that no longer fits is skipped.
# E_ONLY=1 runs step e1 alone; without it, steps a-d and no e. SKIP_D=1 leaves out the
# report and d (fidelity); SKIP_C=1 leaves out c. b fits a call after a only with both (SKIP_D=1 SKIP_C=1).
# kimi.yaml's share_prefixes: true (radix cache on, version-2 shards where samples share prefixes), with a second
# source of agentic conversations (production_tools.py agentic) whose per-turn samples share them; FLAT=1 instead:
# share_prefixes: false and data/'s conversations alone (flat shards, --disable-radix-cache).
# REPLICAS=N: sglang.replicas N, all on GPU 0 (gpus: [0, ...]; each server takes setup.sh's 0.3 of its memory),
# and the pool --resources gpu=N: N extract jobs at once, each driving a server of its own (step a's verdict: the
# most extract jobs Snakemake ran together, and the replica each chunk's job said it claimed). SKIP_B=1 leaves out b.
# B_ONLY=1: b alone, from a clean state (no a, c, d): the first run killed in the middle of its extract jobs, and
# the rerun given the rest of the call (each run's first extract job waits for a server start, 66-187 s so far).
# Prepare here: bench/gpu/build-sglang-site.sh .whl/one, build-extra.sh, build-snakemake.sh (bench/gpu/README.md).
#
# The production run: `snakemake --cores 8 --resources gpu=1 --configfile config/kimi.yaml --configfile
# $SOURCES`, SOURCES naming the routing-fixed twin of `python -m hsextract.tinymodel --packaging kimi-k25
# --tokenizer kimi` (production_tools.py twin: the wrapper checkpoint as Kimi-K2.5 ships, every router's
# correction bias 0, 2, 4, ...; so the shards can be held to the dense per-sample bounds, and the twin of the
# tiny model is the one that served SGLang in every run so far), the first 300 conversations of data/ and 24
# agentic ones (126 per-turn samples; FLAT=1: data/'s alone), 64 prompts per chunk (6 chunks; FLAT=1: 5),
# `sglang: {tp: 1, python: <this python3>}`, the bundle's server flags (setup.sh SGL_SMALL) as launch_args.
# Steps, each a separate Snakemake invocation, each under `timeout`:
#   a      from a clean state: build_patched_server (pip-installs this checkout into python3), prepare,
#          extract (a server started by the first extract job, reused by the others), validate, stats,
#          manifest, export; then `snakemake --report` (in the background, beside d)
#   d      fidelity (production_tools.py fidelity): every sample of a's shards against the transformers
#          engine on the same checkpoint, each sample alone, per sample <= 2e-2 for the aux layers of
#          capture: eagle3 and the pre-norm final state; the neighbouring layer and the post-norm state over 0.2
#   b-kill shards deleted, the command again; once its log shows one extract job finished and the next
#          started, `kill -9` of Snakemake's process group (Snakemake and its running jobs: what a crash of
#          the workflow's process tree does; the SGLang server, in its own session, lives on as it would,
#          and the next run's onstart stops it)
#   s      (between b-kill and b-rerun, the killed run's server alive) its API key: in no file of the run (logs,
#          results, .snakemake, $OUT), no process's command line or environment; a generate request without it
#          or with a wrong one is refused (401), with it served (production_tools.py secrets)
#   b-rerun the same command (the workflow removes the killed run's lock: hsextract.config.stale_lock; should
#          Snakemake still report a lock, `snakemake --unlock` and the command again):
#          only the chunks whose extract job Snakemake had not finished must run (a shard renamed into place
#          just before a kill, its job not yet registered, counts as incomplete and reruns too)
#   c      (before b, which needs the rest of the budget) one shard deleted, the command again: that chunk
#          alone, and what depends on it
#   e1     (only with E_ONLY=1, alone; in a copy of the checkout, port 31000) the embedded default with engine:
#          sglang: the workflow's own tiny DeepseekV3 (make_tiny_model), `snakemake --cores 8 --resources gpu=1
#          --configfile config/sglang-default.yaml`
# Results: production.md (every step: command, rc, seconds, the jobs it ran, verdict; the fidelity table),
# steps.json, fidelity.json, logs/<step>.log (Snakemake's output), server logs, report.html, run.log,
# machine.txt (packed into all.tgz on exit, production.md and run.log beside it).
# CPU rehearsal of this script (tests/fake_sglang.py behind a `sglang.launch_server` shim over SGLang 0.5.16's
# source, a throwaway server venv; fidelity then FAILS, the fake's states being no model's):
#   PROD_DRY=1 SGLANG_SRC=/tmp/sgl/src PY=$PWD/.venv/bin/python OUT=/tmp/prod-dry bash bench/gpu/run_production.sh
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# a copy of the checkout without what no run reads (the GPU machine's is one already; a rehearsal runs in one)
copy_checkout() {
  rm -rf "$2"; mkdir -p "$2"
  tar -C "$1" --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./results --exclude=./logs \
    --exclude=./benchmarks --exclude=./.snakemake --exclude=./resources/tiny-model --exclude='*/__pycache__' \
    -cf - . | tar -C "$2" -xf -
}
if [ -n "${PROD_DRY:-}" ]; then
  copy_checkout "$(cd "$HERE/../.." && pwd)" /tmp/prod-dry-repo
  REPO=/tmp/prod-dry-repo; HERE=$REPO/bench/gpu; OUT=${OUT:-/tmp/prod-dry}; rm -rf "$OUT"; mkdir -p "$OUT"
  PY=${PY:-python3}
  SGL_SMALL=""; DEVICE=cpu; FID_MAX="--max-samples 4"
  pack_out() { :; }
  export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
  # the server's Python: a venv that sees $PY's packages and installs into itself (build_patched_server),
  # with a site holding SGLang 0.5.16's source (compat check) and a launch_server that runs the fake
  DRY=/tmp/prod-dry-env; rm -rf "$DRY"; mkdir -p "$DRY/site/sglang"
  BASE=$("$PY" -c "import sys; print(sys.base_prefix)")/bin/python3
  "$BASE" -m venv --without-pip "$DRY/venv"
  "$PY" -c "import site; print(site.getsitepackages()[0])" \
    >"$("$DRY/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")/parent.pth"
  cp -r "${SGLANG_SRC:?SGLANG_SRC: an unpacked sglang-0.5.16 wheel}/sglang/srt" "$DRY/site/sglang/"
  cp -r "$SGLANG_SRC"/sglang-0.5.16.dist-info "$DRY/site/"
  : >"$DRY/site/sglang/__init__.py"
  printf 'import sys\nsys.path.insert(0, "%s")\nfrom fake_sglang import main\nmain()\n' "$REPO/tests" \
    >"$DRY/site/sglang/launch_server.py"
  printf '#!/bin/sh\nPYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "$DRY/site" "$DRY/venv/bin/python" \
    >"$DRY/python"; chmod +x "$DRY/python"
  SERVER_PY=$DRY/python
  echo "PROD_DRY: fake server, CPU" >"$OUT/machine.txt"
else
  source "$HERE/setup.sh"
  PY=python3; DEVICE=cuda; FID_MAX=""
  SERVER_PY=$(command -v python3)
  # the plugin's entry point must come from rule build_patched_server's install, not from setup.sh's
  PYTHONPATH=$(printf '%s' "$PYTHONPATH" | tr ':' '\n' | grep -vx /tmp/plug | paste -sd: -)
  export PYTHONPATH
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
cd "$REPO"
mkdir -p "$OUT/logs"
T0=$SECONDS
log() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$OUT/run.log"; }

# ---- Snakemake from .whl/smk (the image has none); setuptools >= 77 for build_patched_server's pip install
SMK=/tmp/smk
if [ -z "${PROD_DRY:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SMK" \
    $(ls "$REPO"/.whl/smk/*.whl | grep -v '/setuptools-') >"$OUT/logs/pip-smk.log" 2>&1
  export PATH=$SMK/bin:$PATH PYTHONPATH=$PYTHONPATH:$SMK
  if ! "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/bt "$REPO"/.whl/smk/setuptools-*.whl
    export PYTHONPATH=/tmp/bt:$PYTHONPATH
  fi
else
  export PATH=$(dirname "$PY"):$PATH
fi
{ echo "snakemake $(snakemake --version 2>&1)"; "$PY" -c "import setuptools; print('setuptools', setuptools.__version__)"
  echo "server python: $SERVER_PY"; } >>"$OUT/machine.txt" 2>&1 || true

# ---- the checkpoints and the config files
M=/tmp/prod-models; rm -rf "$M"; mkdir -p "$M"
"$PY" -m hsextract.tinymodel --packaging kimi-k25 --tokenizer kimi --out "$M/kimi-k25-mini" \
  --conversations data/conversations.jsonl >"$OUT/logs/tinymodel.log" 2>&1
"$PY" "$HERE/production_tools.py" twin "$M/kimi-k25-mini" "$M/kimi-k25-mini-fixed" >>"$OUT/logs/tinymodel.log" 2>&1
"$PY" "$HERE/production_tools.py" refsample "$M/kimi-k25-mini-fixed" "$M/reference-data_0.pt" \
  >>"$OUT/logs/tinymodel.log" 2>&1
# a second source whose per-turn samples share prefixes (data/'s conversations carry no reasoning, so
# split_turns: auto keeps them whole and no two of them share one)
AGENTIC="" FLAT_KEY=""
if [ -n "${FLAT:-}" ]; then
  FLAT_KEY="share_prefixes: false"
else
  "$PY" "$HERE/production_tools.py" agentic "$M/kimi-k25-mini-fixed" "$M/agentic.jsonl" >>"$OUT/logs/tinymodel.log" 2>&1
  AGENTIC="  - {path: $M/agentic.jsonl, format: auto}"
fi
LAUNCH=$("$PY" -c "import json, shlex, sys; print(json.dumps(shlex.split(sys.argv[1])))" "$SGL_SMALL")
REPLICAS=${REPLICAS:-1}
REPLICA_KEYS=""
[ "$REPLICAS" = 1 ] || REPLICA_KEYS="  replicas: $REPLICAS
  gpus: [$("$PY" -c "import sys; print(', '.join(['0'] * int(sys.argv[1])))" "$REPLICAS")]"
SOURCES=/tmp/prod-sources.yaml
cat >"$SOURCES" <<EOF
model: $M/kimi-k25-mini-fixed
sources:
  - {path: data/conversations.jsonl, format: auto, max_records: 300}
$AGENTIC
prompts_per_chunk: 64
# kimi.yaml's [2, 30, 58] are Kimi-K2.5's 61 layers: the eagle3 preset of this model's instead
aux_layers: null
# one sample of this model's data (production_tools.py refsample), as a user gives one of theirs
reference_sample: $M/reference-data_0.pt
sglang:
  python: $SERVER_PY
  tp: 1
  startup_timeout_s: 400
  launch_args: $LAUNCH
$REPLICA_KEYS
extract: {threads: 4, mem_mb: 8000, retries: 0}
$FLAT_KEY
EOF
CFG=(--configfile config/kimi.yaml --configfile "$SOURCES")
CMD=(snakemake --cores 8 --resources gpu=$REPLICAS "${CFG[@]}")
RUN=results/$(awk '/^run_name:/ {print $2}' config/kimi.yaml)
HOSTDIR=hosts/$("$PY" -c "from hsextract.sglang.server import host_name; print(host_name())")  # the jobs' own name
rm -rf "$RUN" "logs/${RUN#results/}" "benchmarks/${RUN#results/}" .snakemake
cp "$SOURCES" "$OUT/sources.yaml"

BUDGET=${BUDGET_S:-520}
SETUP_S=$((SECONDS - T0))
END=$((SECONDS + BUDGET))
left() { echo $((END - SECONDS)); }
STEPS=$OUT/steps.jsonl; : >"$STEPS"
log "set-up done (models, snakemake); budget ${BUDGET} s"

# step NAME VERDICT_CMD... : record one invocation (its rc, seconds, jobs from its log) into steps.jsonl
record() {
  local name=$1 rc=$2 secs=$3 cmd=$4 verdict=${5:-} notes=${6:-}
  local jobs; jobs=$("$PY" "$HERE/production_tools.py" jobs "$OUT/logs/$name.log" 2>/dev/null || echo null)
  "$PY" - "$name" "$rc" "$secs" "$cmd" "$verdict" "$notes" "$jobs" >>"$STEPS" <<'PYEOF'
import json, sys
n, rc, s, cmd, verdict, notes, jobs = sys.argv[1:]
print(json.dumps({"name": n, "rc": int(rc), "seconds": int(s), "cmd": cmd, "verdict": verdict, "notes": notes,
                  "jobs": json.loads(jobs)}))
PYEOF
}
# smk NAME LIMIT ARGS...: one Snakemake invocation in the foreground, under timeout; sets RC and SECS
smk() {
  local name=$1 limit=$2; shift 2
  local t=$SECONDS
  set +e
  timeout -k 20 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  RC=$?
  set -e
  SECS=$((SECONDS - t))
  log "$name: rc $RC in $SECS s: $*"
}
jobs_of() { "$PY" "$HERE/production_tools.py" jobs "$OUT/logs/$1.log"; }
field() { "$PY" -c "import json, sys; d = json.loads(sys.argv[1]); print(eval(sys.argv[2], {}, {'d': d}))" "$1" "$2"; }
shards() { { ls "$RUN"/shards/ 2>/dev/null | grep -E '^chunk-[0-9]+\.hss$' | sed 's/^chunk-//; s/\.hss$//' | sort | tr '\n' ' '; } || true; }
all_valid() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1])).get('all_valid'))" "$RUN/dataset.json" 2>/dev/null || echo missing; }

# ---- e: the embedded default with engine: sglang, in a copy of the checkout, beside a-c ----------------------
EWD=/tmp/prod-default; rm -f /tmp/prod-e.pid
copy_checkout "$REPO" "$EWD"
cat >"$EWD/config/sglang-default.yaml" <<EOF
engine: sglang
sglang:
  python: $SERVER_PY
  port: 31000
  startup_timeout_s: 400
  launch_args: $LAUNCH
extract: {retries: 0}
EOF
e_steps() {
  # after a's first shard: build_patched_server's pip installs into one Python must not overlap, and e's
  # must not replace the plugin's entry point while a's server reads it at start-up
  while [ -z "${E_ONLY:-}" ] && [ -z "$(shards)" ] && kill -0 "$$" 2>/dev/null && [ "$(left)" -gt 60 ] \
        && ! grep -qs "^Exiting because\|steps (100%) done" "$OUT/logs/a.log"; do sleep 1; done
  local t=$SECONDS rc
  set +e
  (cd "$EWD" && exec setsid timeout -k 20 $(( $(left) > 30 ? $(left) - 20 : 10 )) snakemake --cores 8 \
     --resources gpu=1 --configfile config/sglang-default.yaml) >"$OUT/logs/e1.log" 2>&1 &
  echo $! >/tmp/prod-e.pid; wait $!
  rc=$?
  set -e
  local secs=$((SECONDS - t))
  local srv; srv=$(ls "$EWD"/results/tiny-default/server/hosts/*/replica-*.log 2>/dev/null | head -n 1 || true)
  [ -n "$srv" ] && tail -c 150000 "$srv" >"$OUT/server-e1.log"
  local crash=no
  grep -qs "illegal memory access" "$OUT/logs/e1.log" "$OUT/server-e1.log" && crash=yes
  local vocab; vocab=$("$PY" -c "import json; print(json.load(open('$EWD/resources/tiny-model/config.json'))['vocab_size'])" 2>/dev/null || echo ?)
  local valid; valid=$("$PY" -c "import json; print(json.load(open('$EWD/results/tiny-default/dataset.json')).get('all_valid'))" 2>/dev/null || echo missing)
  local verdict="dataset all_valid: $valid; illegal memory access: $crash"
  log "e1: rc $rc in $secs s; $verdict (tiny model vocab $vocab)"
  record e1 "$rc" "$secs" "cd <copy>; snakemake --cores 8 --resources gpu=1 --configfile config/sglang-default.yaml" \
    "$verdict" "the workflow's own tiny DeepseekV3 (make_tiny_model, tiny_model_tokenizer kimi: vocab $vocab), engine sglang; server log: server-e1.log"
}
E_PID=
if [ -n "${E_ONLY:-}" ]; then e_steps & E_PID=$!; fi

finish() {
  local rc=$?
  # e's Snakemake (its own session) and the e steps, if the budget ran out before them
  [ -f /tmp/prod-e.pid ] && kill -TERM -- "-$(cat /tmp/prod-e.pid)" 2>/dev/null || true
  [ -n "$E_PID" ] && kill "$E_PID" 2>/dev/null || true
  for d in "$RUN/server/$HOSTDIR" "$EWD/results/tiny-default/server/$HOSTDIR"; do
    [ -d "$d" ] && { "$PY" -m hsextract.sglang.server stop "$d" >/dev/null 2>&1 || true; }
  done
  for f in "$RUN"/server/hosts/*/replica-*.log; do  # one log per replica: server-production[-replica-N].log
    [ -f "$f" ] || continue
    r=$(basename "$f" .log); r=${r#replica-}
    tail -c 150000 "$f" >"$OUT/server-production$([ "$r" = 0 ] || echo "-replica-$r").log"
  done
  cp -r "logs/${RUN#results/}" "$OUT/workflow-logs" 2>/dev/null || true
  cp "$RUN/dataset.json" "$RUN/server/patched.json" "$OUT/" 2>/dev/null || true
  "$PY" - "$STEPS" "$OUT/steps.json" "$OUT/fidelity.json" "$BUDGET" "${SETUP_S:-}" <<'PYEOF' || true
import json, sys, time, pathlib
steps, out, fid, budget, setup_s = sys.argv[1:]
rows = [json.loads(l) for l in pathlib.Path(steps).read_text().splitlines() if l.strip()]
m = pathlib.Path(out).parent / "machine.txt"
machine = m.read_text().splitlines()[0] if m.is_file() and m.read_text().strip() else "?"
doc = {"machine": machine, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "budget_s": int(budget),
       "setup_s": int(setup_s) if setup_s else None, "steps": rows}
f = pathlib.Path(fid)
if f.is_file():
    doc["fidelity"] = json.loads(f.read_text())
pathlib.Path(out).write_text(json.dumps(doc, indent=1))
PYEOF
  "$PY" "$HERE/production_tools.py" summary "$OUT/steps.json" "$OUT/production.md" || true
  log "exit $rc after $((SECONDS - T0)) s"
  pack_out
  return $rc
}
trap finish EXIT
# E_ONLY=1: step e alone on the machine (no production server beside it), then stop
if [ -n "${E_ONLY:-}" ]; then [ -z "$E_PID" ] || wait "$E_PID" || true; exit 0; fi

# ---- a: the production command from a clean state -------------------------------------------------------------
# a leaves 200 s for the steps after it, unless all of them are skipped
RESERVE=200; [ -n "${SKIP_D:-}" ] && [ -n "${SKIP_C:-}" ] && [ -n "${SKIP_B:-}" ] && RESERVE=20
A_SHARDS=""; if [ -n "${B_ONLY:-}" ]; then SKIP_C=1 SKIP_D=1; fi
if [ -z "${B_ONLY:-}" ]; then
smk a $(( $(left) - RESERVE > 120 ? $(left) - RESERVE : 120 )) "${CMD[@]}"
A_SHARDS=$(shards)
N_CHUNKS=$(field "$(jobs_of a)" "d['by_rule'].get('extract', 0)")
# the replica each chunk's extract job claimed (hsextract.sglang.config says it in the job's log)
CLAIMED=$(grep -ho "^chunk [0-9]*: sglang replica [0-9]* of [0-9]*" "logs/${RUN#results/}"/extract/chunk-*.log 2>/dev/null \
  | awk '{print $2 $5}' | sort -n | paste -sd' ' - || true)
record a "$RC" "$SECS" "${CMD[*]}" "shards: $A_SHARDS; dataset all_valid: $(all_valid)" \
  "extract jobs at once (most): $(field "$(jobs_of a)" "d['extract_at_once']"); chunk:replica claimed: ${CLAIMED:-none said}"
fi

# ---- report (background) and d: fidelity -------------------------------------------------------------------------
[ -n "${SKIP_D:-}" ] || ( t=$SECONDS; set +e
  timeout -k 10 120 snakemake --report "$OUT/report.html" "${CFG[@]}" >"$OUT/logs/report.log" 2>&1; r=$?
  record report "$r" $((SECONDS - t)) "snakemake --report report.html ${CFG[*]}" \
    "$( [ -s "$OUT/report.html" ] && echo "report.html $(stat -c %s "$OUT/report.html") bytes" || echo "no report" )" ) &
REPORT_PID=$!
if [ -z "${SKIP_D:-}" ] && [ -n "$A_SHARDS" ] && [ "$(left)" -gt 60 ]; then
  t=$SECONDS
  set +e
  timeout -k 10 $(( $(left) > 150 ? 120 : $(left) - 30 )) "$PY" "$HERE/production_tools.py" fidelity --run "$RUN" \
    --model "$M/kimi-k25-mini-fixed" --device "$DEVICE" $FID_MAX --out "$OUT/fidelity.json" >"$OUT/logs/d.log" 2>&1
  r=$?
  set -e
  log "d: fidelity rc $r in $((SECONDS - t)) s"
  record d "$r" $((SECONDS - t)) "production_tools.py fidelity --run $RUN --model <twin>" \
    "$( [ "$r" = 0 ] && echo PASS || echo FAIL ) (fidelity.json)"
fi
wait "$REPORT_PID" || true

# ---- c: one shard deleted, the same command ----------------------------------------------------------------------
if [ -z "${SKIP_C:-}" ] && [ "$(left)" -gt 240 ] && [ -f "$RUN/shards/chunk-00002.hss" ]; then
  rm "$RUN/shards/chunk-00002.hss"
  smk c 150 "${CMD[@]}"
  RAN=$(field "$(jobs_of c)" "' '.join(d['extract_chunks'])")
  BYRULE=$(field "$(jobs_of c)" "d['by_rule']")
  OK=$([ "$RAN" = "00002" ] && echo "chunk 2 alone was extracted" || echo "MISMATCH: extract ran [$RAN]")
  [ "$RC" = 0 ] || OK="rc $RC; $OK"
  record c "$RC" "$SECS" "rm $RUN/shards/chunk-00002.hss; ${CMD[*]}" "$OK; dataset all_valid: $(all_valid)" \
    "jobs: $BYRULE"
else
  log "c: SKIPPED (budget: $(left) s left, or no shard 2)"; record c 0 0 "-" "SKIPPED"
fi

# ---- b: kill -9 in the middle of an extract, then the same command ---------------------------------------------
if [ -z "${SKIP_B:-}" ] && [ "$(left)" -gt 150 ] && { [ -n "${B_ONLY:-}" ] || [ -n "$A_SHARDS" ]; }; then
  rm -f "$RUN"/shards/chunk-*.hss
  t=$SECONDS
  setsid "${CMD[@]}" >"$OUT/logs/b-kill.log" 2>&1 &
  SMK_PID=$!
  # the event: Snakemake has finished one extract job and started the next (a job in the middle)
  mid_extract() {
    local f; f=$(grep -c "^Finished jobid: .*(Rule: extract)" "$OUT/logs/b-kill.log" 2>/dev/null || true)
    local n; n=$(grep -c "^\(local\)\?rule extract:" "$OUT/logs/b-kill.log" 2>/dev/null || true)
    [ "${f:-0}" -ge 1 ] && [ "${n:-0}" -gt "${f:-0}" ]
  }
  while kill -0 "$SMK_PID" 2>/dev/null && ! mid_extract && [ "$(left)" -gt 90 ]; do sleep 0.2; done
  REACHED=$(mid_extract && echo yes || echo no)  # no: the budget ran out first (a server start of this machine)
  AT_KILL=$(shards)
  INFLIGHT=$(ls -a "$RUN"/shards/ 2>/dev/null | grep -E '^\.chunk-.*tmp' | tr '\n' ' ' || true)
  kill -9 -- "-$SMK_PID" 2>/dev/null || true
  wait "$SMK_PID" 2>/dev/null || true
  for _ in $(seq 50); do [ -z "$(ps -eo pgid= | awk -v g="$SMK_PID" '$1 == g')" ] && break; sleep 0.1; done
  LEFTOVER=$(ps -eo pgid=,stat=,comm= | awk -v g="$SMK_PID" '$1 == g {print $3 "(" $2 ")"}' | paste -sd, -)
  SERVER_ALIVE=$("$PY" - "$RUN/server/$HOSTDIR" <<'PYEOF'
import json, pathlib, sys, psutil
pids = []
for f in pathlib.Path(sys.argv[1]).glob("replica-*.json"):
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError):
        continue
    p = d.get("pid") or d.get("pgid")
    if p and psutil.pid_exists(int(p)):
        pids.append(int(p))
print(" ".join(map(str, pids)) or "none")
PYEOF
)
  log "b-kill: killed after $((SECONDS - t)) s with shards [$AT_KILL] (in flight: ${INFLIGHT:-none}); server pids alive: $SERVER_ALIVE"
  record b-kill 137 $((SECONDS - t)) "${CMD[*]} (kill -9 of its process group once it has finished one extract job and started the next)" \
    "shards at the kill: $AT_KILL" "extract jobs Snakemake had finished: [$(field "$(jobs_of b-kill)" "' '.join(d['finished_extract_chunks'])")], started: [$(field "$(jobs_of b-kill)" "' '.join(d['extract_chunks'])")]; partial shard files at the kill: ${INFLIGHT:-none}; processes of Snakemake's group left: ${LEFTOVER:-none}; live server after the kill: $SERVER_ALIVE (its own session; the next run's onstart stops it)"
  if [ "$REACHED" = no ]; then
    log "b: NOT REACHED: no extract job had finished when the budget ran out; s and b-rerun skipped"
    record b-rerun 0 0 "-" "SKIPPED: the kill came before one extract job finished (budget), so no rerun to check"
  else
    # s: the key of the server the killed run left alive (its key file still there): no file of the run, no
    # process's command line or environment holds it, and the server refuses a generate request without it
    if [ "$SERVER_ALIVE" != none ]; then
      t=$SECONDS
      set +e
      SEC=$("$PY" "$HERE/production_tools.py" secrets --state "$RUN/server/$HOSTDIR" --out "$OUT/secrets.json" "$RUN" logs \
        .snakemake "$OUT" "$SOURCES" 2>"$OUT/logs/s.log")
      r=$?
      set -e
      log "s: rc $r: $SEC"
      record s "$r" $((SECONDS - t)) "production_tools.py secrets --state $RUN/server/hosts/<host> $RUN logs .snakemake \$OUT <sources>" \
        "${SEC:-no verdict (logs/s.log)}"
    fi
    # unfinished: every chunk whose extract job Snakemake had not finished (a shard renamed into place just before
    # the kill, its job not yet registered, is incomplete to Snakemake: rerun-incomplete redoes it)
    # B_ONLY: the chunks are the prompts the killed run's prepare wrote (it finished before any extract job)
    [ -z "${B_ONLY:-}" ] || N_CHUNKS=$(ls "$RUN"/prompts/ | grep -cE '^chunk-[0-9]+\.parquet$')
    EXPECT=$("$PY" -c "import sys, json; done = set(json.loads(sys.argv[2])['finished_extract_chunks']); print(' '.join(f'{i:05d}' for i in range(int(sys.argv[1])) if f'{i:05d}' not in done))" "$N_CHUNKS" "$(jobs_of b-kill)")
    smk b-rerun $(( $(left) - 60 > 60 ? $(left) - 60 : 60 )) "${CMD[@]}"
    if [ "$RC" != 0 ] && [ "$(field "$(jobs_of b-rerun)" "d['lock_error']")" = True ]; then
      record b-rerun "$RC" "$SECS" "${CMD[*]}" "refused: the lock the kill left" "README: after a hard kill, snakemake --unlock first"
      smk b-unlock 60 snakemake --unlock "${CFG[@]}"
      record b-unlock "$RC" "$SECS" "snakemake --unlock ${CFG[*]}" ""
      smk b-rerun2 $(( $(left) - 60 > 60 ? $(left) - 60 : 60 )) "${CMD[@]}"
      NAME=b-rerun2
    else
      NAME=b-rerun
    fi
    RAN=$(field "$(jobs_of $NAME)" "' '.join(d['extract_chunks'])")
    OK=$([ "$RAN" = "$EXPECT" ] && echo "only the unfinished chunks ran" || echo "MISMATCH: expected [$EXPECT]")
    # the budget's timeout (124) before every unfinished chunk ran: a verdict only on those that did
    SUBSET=$("$PY" -c "import sys; print(set(sys.argv[1].split()) <= set(sys.argv[2].split()))" "$RAN" "$EXPECT")
    [ "$RC" = 124 ] && [ "$RAN" != "$EXPECT" ] && [ "$SUBSET" = True ] && \
      OK="cut by the budget: the chunks that ran ([$RAN]) are all unfinished ones, the others ([$EXPECT]) not all reached"
    [ "$RC" = 0 ] || OK="rc $RC; $OK"
    [ "$(field "$(jobs_of $NAME)" "d['stale_lock_removed']")" = True ] && OK="the killed run's lock removed; $OK"
    record "$NAME" "$RC" "$SECS" "${CMD[*]}" "$OK; shards now: $(shards); dataset all_valid: $(all_valid)" \
      "extract chunks that ran: [$RAN] (reasons: $(field "$(jobs_of $NAME)" "d['extract_reasons']")); unfinished at the kill: [$EXPECT]"
  fi
else
  log "b: SKIPPED (budget: $(left) s left)"; record b-kill 0 0 "-" "SKIPPED (budget)"
fi

[ -z "$E_PID" ] || wait "$E_PID" || true
log "done: shards [$(shards)], dataset all_valid: $(all_valid)"
