#!/usr/bin/env bash
# Builds OUT_DIR/site.tar.xz (about 48 MB): SGLang 0.5.16 and the packages the H200 machine's image lacks
# (Python 3.12, torch 2.11.0+cu130, triton 3.6 are already there), installed into one folder and packed so
# that a single call can carry it. On the GPU machine:
#   mkdir -p /tmp/site && python3 -c "import tarfile; tarfile.open('<carried dir>/site.tar.xz').extractall('/tmp/site')"
#   export PYTHONPATH=/tmp/site SGLANG_IS_FLASHINFER_AVAILABLE=false
#   python3 -m sglang.launch_server --attention-backend triton --sampling-backend pytorch ...
# FA3, sm100, infllm and flashmla kernels are left out to fit: only the triton (or torch_native)
# attention backend works with this bundle (bench/gpu/setup.sh unpacks it and sets the flags).
# Usage: build-sglang-site.sh OUT_DIR      (needs python3.12, which pyenv provides here, and PyPI)
set -euo pipefail
out=${1:?usage: build-sglang-site.sh OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
python3 -m pip download -q --no-deps $plat -d "$work/w" \
  sglang==0.5.16 sglang-kernel==0.4.5 flashinfer-python==0.6.14 xgrammar==0.2.1 transformers==5.12.1 \
  tokenizers==0.22.2 apache-tvm-ffi==0.1.11 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 openai==2.6.1 pyzmq==27.3.0 \
  ipython==9.18.1 traitlets==5.16.1 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 \
  python-multipart==0.0.34 opentelemetry-api==1.45.2 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 \
  setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 distro==1.9.0 sniffio==1.3.1 dill==0.4.1 \
  compressed-tensors==0.20.1 gguf==0.19.0 loguru==0.7.3 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
python3 "$here/slim_wheel.py" "$work"/w/sglang_kernel-0.4.5-*.whl \
  '^sgl_kernel/(flash_ops\.abi3\.so|sm100/.*|infllm_ops.*\.so|flashmla_ops\.abi3\.so)$'
python3 "$here/slim_wheel.py" "$work"/w/xgrammar-0.2.1-*.whl '^xgrammar/lib/.*\.a$'
if ! python3.12 -V >/dev/null 2>&1 && command -v pyenv >/dev/null; then
  export PYENV_VERSION=$(pyenv versions --bare | grep -E '^3\.12' | tail -n 1)
fi
python3.12 -V >/dev/null 2>&1 || { echo "python3.12 not found (pyenv install 3.12, or any Python 3.12)" >&2; exit 1; }
python3.12 -m venv "$work/v12"
"$work/v12/bin/pip" install -q --no-index --no-deps --no-compile --target "$work/site" "$work"/w/*.whl
mkdir -p "$out"
tar -C "$work/site" -cf - . | xz -9e -T0 >"$out/site.tar.xz.tmp"
mv "$out/site.tar.xz.tmp" "$out/site.tar.xz"
ls -l "$out/site.tar.xz"
