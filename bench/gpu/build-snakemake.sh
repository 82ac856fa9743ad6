#!/usr/bin/env bash
# Run HERE (not on the GPU): Snakemake (the version of requirements/cpu.lock) and the packages it imports that
# the GPU machine's image lacks, as py3 / cp312 manylinux wheels in OUT_DIR (default .whl/smk, ~6 MB), for
# run_production.sh, which installs them with `pip install --no-index --no-deps --target /tmp/smk`.
# What the image already has (the package list of /work/.library/device/KINDS.md) is not downloaded: jinja2,
# psutil, pyyaml, requests, tabulate, wrapt, attrs, packaging, pygments (reports), markupsafe; the SGLang bundle
# (build-sglang-site.sh, on PYTHONPATH first) brings jsonschema, jsonschema-specifications, referencing, rpds-py,
# pydantic and traitlets; .whl/extra (build-extra.sh) brings tenacity. nbformat is needed although no rule is a
# notebook (every `script:` job asks it for the script's language). Not downloaded: greenlet (SQLAlchemy's
# asyncio only). PuLP is slimmed: its bundled CBC binaries (~35 MB) are dropped; without a solver Snakemake's
# default ILP scheduler warns once and falls back to the greedy one, so the commands need no --scheduler flag.
# Usage: bash bench/gpu/build-snakemake.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../../.whl/smk}
mkdir -p "$out"
rm -f "$out"/*.whl
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
# versions: requirements/cpu.lock
python3 -m pip download -q --no-deps $plat -d "$out" \
  snakemake==9.27.1 snakemake-interface-common==1.23.0 snakemake-interface-executor-plugins==9.4.0 \
  snakemake-interface-logger-plugins==2.1.0 snakemake-interface-report-plugins==1.3.0 \
  snakemake-interface-scheduler-plugins==2.0.2 snakemake-interface-storage-plugins==4.4.1 \
  argparse-dataclass==2.0.0 conda-inject==1.3.2 ConfigArgParse==1.9.0 \
  docutils==0.22.4 dpath==2.2.0 GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3 humanfriendly==10.0 \
  immutables==0.21 platformdirs==4.14.9 PuLP==3.3.2 smart_open==7.7.1 throttler==1.2.3 yte==1.9.4 \
  sqlmodel==0.0.37 SQLAlchemy==2.0.58 nbformat==5.11.1 fastjsonschema==2.22.3 jupyter_core==5.9.1
# connection_pool 0.0.3 is published as an sdist only (pure Python): built into a wheel here
python3 -m pip wheel -q --no-deps --no-binary connection_pool -w "$out" connection_pool==0.0.3
python3 "$here/slim_wheel.py" "$out"/pulp-3.3.2-*.whl '^pulp/solverdir/.*'
# setuptools (the lock's): rule build_patched_server pip-installs this checkout into the server's Python with
# --no-build-isolation, and pyproject.toml's `license = "Apache-2.0"` needs setuptools >= 77; run_production.sh
# puts it on the path only if the image's is older
python3 -m pip download -q --no-deps $plat -d "$out" setuptools==84.2.1
ls -l "$out"
du -cb "$out"/*.whl | tail -n 1
