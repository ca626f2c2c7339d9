# Sourced by scripts/gpu_check.sh and scripts/gpu_session.sh on the H200, from the checkout's root: installs what the
# image lacks (the wheels carried in .whl/, FlashInfer's kernels from .ficache/) and puts jaxattn on PYTHONPATH. Once
# per call: a gpu_check.sh run as a gpu_session.sh step finds it done (JAXATTN_GPU_ENV, inherited with PYTHONPATH).
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -z "${JAXATTN_GPU_ENV:-}" ]; then
  # FlashInfer's JIT-built kernels from an earlier run, if carried (nvcc takes 12-95 s per kernel otherwise).
  if [ -f .ficache/flashinfer.tgz ]; then mkdir -p ~/.cache && tar xzf .ficache/flashinfer.tgz -C ~/.cache; fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  fi
  # FlashInfer's modules prebuilt for sm_90a on a CPU machine (scripts/prebuild_flashinfer.py): FlashInfer loads
  # data/aot/<name>/<name>.so without building it. One that does not load here is deleted, so that FlashInfer
  # JIT-builds it instead of failing on it.
  if [ -f .ficache/flashinfer_aot.tar.xz ] && [ -d /tmp/site/flashinfer ]; then
    mkdir -p /tmp/site/flashinfer/data/aot && tar xJf .ficache/flashinfer_aot.tar.xz -C /tmp/site/flashinfer/data/aot
    python3 - /tmp/site/flashinfer/data/aot <<'EOF'
import pathlib
import sys

import torch  # noqa: F401  (loads libcudart.so.13, which the modules need, as FlashInfer's own import does)
import flashinfer  # noqa: F401  (and tvm_ffi's runtime, whose symbols the modules take)
import tvm_ffi

loaded, deleted = 0, 0
for so in sorted(pathlib.Path(sys.argv[1]).glob("*/*.so")):
    try:
        tvm_ffi.load_module(str(so))
        loaded += 1
    except Exception as error:  # noqa: BLE001
        print(f"flashinfer aot: deleted {so.name} (FlashInfer will build it): {type(error).__name__}: {error}")
        so.unlink()
        deleted += 1
print(f"flashinfer aot: {loaded} prebuilt modules load, {deleted} deleted")
EOF
  fi
  # jaxattn itself from the checkout, without the network (jaxattn/__init__.py maps kernels/ to jaxattn.kernels).
  export PYTHONPATH=$PWD:$PYTHONPATH
  export JAXATTN_GPU_ENV=1
fi
