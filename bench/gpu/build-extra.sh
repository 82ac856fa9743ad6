#!/usr/bin/env bash
# Run HERE (not on the GPU): wheels the GPU image may lack for the client side (shard writer: zstandard, xxhash). ~6 MB.
set -euo pipefail
out=${1:-$(cd "$(dirname "$0")/../.." && pwd)/.whl/extra}
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out" zstandard==0.25.0 xxhash==3.6.0
ls -l "$out"
