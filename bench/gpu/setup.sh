# Sourced by the bench/gpu scripts on the lent H200 (Python 3.12, torch 2.11.0+cu130, no network).
# Carry: .whl/one/site.tar.xz (from bench/gpu/build-sglang-site.sh) and, if the image lacks
# zstandard, .whl/extra/ (bench/gpu/build-extra.sh). Installs nothing system-wide: everything under /tmp.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/hsx-out}; mkdir -p "$OUT"
SITE_TAR=${SITE_TAR:-$REPO/.whl/one/site.tar.xz}
if [ ! -d /tmp/site/sglang ]; then
  mkdir -p /tmp/site
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('/tmp/site')" "$SITE_TAR"
fi
EXTRA=
if ! python3 -c "import zstandard, xxhash, tenacity" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/extra "$REPO"/.whl/extra/*.whl
  EXTRA=/tmp/extra
fi
# py-spy for --profile, if carried (.whl/diag, bench/gpu/build-extra.sh)
if ls "$REPO"/.whl/diag/py_spy-*.whl >/dev/null 2>&1 && [ ! -x /tmp/diag/bin/py-spy ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/diag "$REPO"/.whl/diag/py_spy-*.whl || true
fi
[ -x /tmp/diag/bin/py-spy ] && export HSX_PYSPY=/tmp/diag/bin/py-spy
# The plugin's entry point without pip: a dist-info next to the source tree on the path.
DI=/tmp/plug/hsextract-0.1.0.dist-info; mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: hsextract\nVersion: 0.1.0\n' >"$DI/METADATA"
printf '[sglang.srt.plugins]\nhsextract = hsextract.sglang_plugin.plugin:register\n' >"$DI/entry_points.txt"
export PYTHONPATH=/tmp/site:$REPO/src:/tmp/plug${EXTRA:+:$EXTRA}
export SGLANG_IS_FLASHINFER_AVAILABLE=false PYTHONUNBUFFERED=1 PATH=/usr/local/cuda/bin:$PATH
# The slimmed bundle (build-sglang-site.sh) has no FA3/flashinfer kernels: triton attention only.
SGL_COMMON="--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs-decode 16"
# The small models of mk_models.py (fidelity, TP, diagnostics): one server on a shared GPU.
SGL_SMALL="$SGL_COMMON --mem-fraction-static 0.3 --max-total-tokens 131072 --max-running-requests 64 --cuda-graph-bs-prefill 4 8 16 32 64 128 256 512"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
  python3 -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'transformers', m.version('transformers'))"
  echo "cpus $(nproc), memlock $(ulimit -l)"; free -g | head -2; df -h /dev/shm /tmp
} >"$OUT/machine.txt" 2>&1 || true
# At most 8 files come back from $OUT: on exit, everything goes into $OUT/all.tgz, and only the
# summaries (*.md, run.log) stay beside it.
pack_out() {
  local rc=$?
  tar czf /tmp/hsx-all.tgz -C "$OUT" --exclude=all.tgz . 2>/dev/null && mv /tmp/hsx-all.tgz "$OUT/all.tgz" &&
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name all.tgz ! -name '*.md' ! -name run.log -exec rm -rf {} +
  return $rc
}
trap pack_out EXIT
