#!/usr/bin/env bash
# One device call (< 10 min): the plugin's side-stream copies (HSEXTRACT_COPY_STREAM, default on) checked
# and measured: bench/gpu/check_copy_stream.py, fidelity of the Llama against transformers, and the
# throughput parts b,a at 512 tokens, alternated.
#   run(command="bash bench/gpu/run_copy_stream.sh", carry=[".whl/one", ".whl/extra"], timeout_s=590)
# Each step writes to its own folder under $OUT; at the end they are packed into $OUT/all.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TOP=${OUT:-/tmp/hsx-out}; mkdir -p "$TOP"
step() {  # step NAME COMMAND...: OUT=$TOP/NAME, output appended to $TOP/run.log
  local name=$1; shift
  echo "== $name at ${SECONDS} s" | tee -a "$TOP/run.log"
  OUT="$TOP/$name" "$@" >"$TOP/$name.log" 2>&1
  echo "== $name exit $? at ${SECONDS} s" | tee -a "$TOP/run.log"
  tail -n 25 "$TOP/$name.log" >>"$TOP/run.log"
}
step copy-stream bash -c "source '$HERE/setup.sh' && python3 '$HERE/check_copy_stream.py' --out \"\$OUT/copy_stream.json\""
step fidelity env MODELS=llama:1,3,5 BUDGET_S=${FIDELITY_BUDGET_S:-230} bash "$HERE/run_fidelity.sh"
step throughput env ENCODE_SWEEP=0 BUDGET_S=${BUDGET_S:-260} DD_GB=1 bash "$HERE/run_throughput.sh" \
  --concurrency 32 --lens 512 --parts b,a --shard-threads 8 --repeats 2
cat "$TOP"/*/*.md >"$TOP/summary.md" 2>/dev/null
tar czf /tmp/hsx-top.tgz -C "$TOP" . && rm -rf "$TOP"/* && mv /tmp/hsx-top.tgz "$TOP/all.tgz"
