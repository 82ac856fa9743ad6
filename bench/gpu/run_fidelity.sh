#!/usr/bin/env bash
# One device call (< 9 min): tiny Llama and small DeepseekV3 through the patched SGLang 0.5.16 server with
# this project's plugin, against transformers on the same GPU. Results: $OUT/fidelity-*.{json,md}, logs.
#   run(command="bash bench/gpu/run_fidelity.sh", carry=[".whl/one", ".whl/extra"])
source "$(dirname "$0")/setup.sh"
cd "$REPO/bench/gpu"
python3 mk_models.py /tmp/models >"$OUT/mk_models.log" 2>&1
ARGS="$SGL_COMMON --mem-fraction-static 0.3 --max-total-tokens 131072 --max-running-requests 64 --cuda-graph-bs-prefill 4 8 16 32 64 128 256 512"
rc=0
# MODELS picks which to run (default all): name:aux ids, one server each, ~1-2 min per model
for spec in ${MODELS:-llama:1,3,5 deepseek:2,4,6 tiny:1,5,7}; do
  name=${spec%%:*}; aux=${spec#*:}; port=$((30000 + ${#name}))
  timeout 270 python3 fidelity.py --model /tmp/models/$name --name $name --aux ${aux//,/ } --state /tmp/state-$name \
    --out "$OUT" --sgl-args "$ARGS" --chunked-prefill-size 128 --port $port || rc=$?
  python3 -m hsextract.server stop /tmp/state-$name >/dev/null  # in case timeout killed the script
done
for f in /tmp/state-*/replica-*.log; do [ -f "$f" ] && tail -c 200000 "$f" >"$OUT/server-$(basename "$(dirname "$f")").log"; done
python3 -m hsextract.sglang_compat --site /tmp/site --json "$OUT/compat.json" >/dev/null || true
exit $rc
