#!/usr/bin/env bash
# One device call: the plugin's side-stream copies (HSEXTRACT_COPY_STREAM) checked and timed on the GPU
# (bench/gpu/check_copy_stream.py). Results: $OUT/copy_stream.json, run.log.
#   bash bench/gpu/run_copy_stream.sh   (with .whl/one, .whl/extra beside the checkout)
source "$(dirname "$0")/setup.sh"
python3 "$REPO/bench/gpu/check_copy_stream.py" --out "$OUT/copy_stream.json" 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
