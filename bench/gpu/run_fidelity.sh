#!/usr/bin/env bash
# One device call (< 9 min): tiny Llama and small DeepseekV3 through the patched SGLang 0.5.16 server with
# this project's plugin, against transformers on the same GPU. Results: $OUT/fidelity-*.{json,md}, logs.
#   run(command="bash bench/gpu/run_fidelity.sh", carry=[".whl/one", ".whl/extra"])
source "$(dirname "$0")/setup.sh"
cd "$REPO/bench/gpu"
python3 mk_models.py /tmp/models >"$OUT/mk_models.log" 2>&1
ARGS="$SGL_COMMON --mem-fraction-static 0.3 --max-total-tokens 131072 --max-running-requests 64 --cuda-graph-bs-prefill 4 8 16 32 64 128 256 512"
rc=0
timeout 270 python3 fidelity.py --model /tmp/models/llama --name llama --aux 1 3 5 --state /tmp/state-llama \
  --out "$OUT" --sgl-args "$ARGS" --chunked-prefill-size 128 || rc=$?
python3 -m hsextract.server stop /tmp/state-llama >/dev/null  # in case timeout killed the script
timeout 270 python3 fidelity.py --model /tmp/models/deepseek --name deepseek --aux 2 4 6 --state /tmp/state-deepseek \
  --out "$OUT" --sgl-args "$ARGS" --chunked-prefill-size 128 --port 30010 || rc=$?
python3 -m hsextract.server stop /tmp/state-deepseek >/dev/null
for f in /tmp/state-*/replica-*.log; do [ -f "$f" ] && tail -c 200000 "$f" >"$OUT/server-$(basename "$(dirname "$f")").log"; done
python3 -m hsextract.sglang_compat --site /tmp/site --json "$OUT/compat.json" >/dev/null || true
exit $rc
