#!/usr/bin/env bash
# One device call (< 9 min): bench/sglang_throughput.py on the Llama-3-8B shape (dummy weights).
#   run(command="bash bench/gpu/run_throughput.sh", carry=[".whl/one", ".whl/extra"])
source "$(dirname "$0")/setup.sh"
python3 "$REPO/bench/gpu/mk_models.py" /tmp/models --llama8b >"$OUT/mk_models.log" 2>&1
rc=0
timeout 560 python3 "$REPO/bench/sglang_throughput.py" --model /tmp/models/llama8b --out "$OUT" "$@" || rc=$?
python3 -m hsextract.server stop /tmp/hsx-bench-state >/dev/null || true
tail -c 200000 /tmp/hsx-bench-state/replica-0.log >"$OUT/server-capture.log" 2>/dev/null || true
exit $rc
