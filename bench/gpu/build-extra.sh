#!/usr/bin/env bash
# Run HERE (not on the GPU): wheels the GPU image may lack for the client side (shard writer: zstandard, xxhash;
# the HTTP client's retries: tenacity). ~6 MB.
set -euo pipefail
out=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.whl/extra}
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out" zstandard==0.25.0 xxhash==3.6.0
python3 -m pip download -q --no-deps -d "$out" tenacity==9.2.1
# pyarrow (~55 MB, its own folder: carried only by run_read.sh, beside .whl/extra): bench/read.py's exports
read=$(dirname "$out")/read; mkdir -p "$read"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$read" pyarrow==26.0.1
# py-spy (a static binary, ~3 MB): the throughput bench's --profile samples who holds the GIL, in the
# client and in SGLang's scheduler process
diag=$(dirname "$out")/diag; mkdir -p "$diag"
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 -d "$diag" py-spy==0.4.3
ls -l "$out" "$read" "$diag"
