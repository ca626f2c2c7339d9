"""Prints a fingerprint of every Mosaic GPU shape `tests/lower_mgpu_kernel.py` lowers: the sha256 of each Mosaic GPU
module it emits, printed without source locations (which move with any edit above a line), so a refactor can be
shown to change no kernel. FINGERPRINT_DUMP=<folder> also writes each module's text there (0.mlir, 1.mlir, ...), to
diff what changed. It hooks jax's private `_emit_mosaic_gpu_custom_call` (pallas_call_registration, jax 0.11-0.12),
so a jax upgrade may need it adjusted.

Usage (the lowering environment of tests/lower_mgpu_kernel.py):
    PYTHONPATH=.venv/mosaic_gpu_lowering:. JAX_PLATFORMS=cpu python scripts/kernel_fingerprints.py [SUBSTRING] > a.txt
then the same on the other revision (`git worktree add`) and `diff a.txt b.txt`. Compare runs of the same SUBSTRING: a
shape's hashes differ between selections (what was lowered before it in the process shows in its module).
"""
import builtins
import hashlib
import os
import runpy
import sys

from jax._src.pallas.mosaic_gpu import pallas_call_registration

modules = []
dumped = []
emit = pallas_call_registration._emit_mosaic_gpu_custom_call


def recording_emit(ctx, args, lowering_result, *rest, **kwargs):
    """The kernel's module as lowered, before it is serialized into the custom call (with its locations)."""
    text = lowering_result.module.operation.get_asm(enable_debug_info=False)
    if os.environ.get("FINGERPRINT_DUMP"):
        with open(os.path.join(os.environ["FINGERPRINT_DUMP"], f"{len(dumped)}.mlir"), "w") as f:
            f.write(text)
        dumped.append(1)
    modules.append(hashlib.sha256(text.encode()).hexdigest()[:16])
    return emit(ctx, args, lowering_result, *rest, **kwargs)


printed = print


def print_with_fingerprint(*args, **kwargs):  # "ok <label>" lines gain the shape's module hashes
    line = " ".join(map(str, args))
    if line.startswith(("ok ", "FAIL ")):
        line += " " + ",".join(modules)
        modules.clear()
    printed(line, **kwargs)


if __name__ == "__main__":
    pallas_call_registration._emit_mosaic_gpu_custom_call = recording_emit
    builtins.print = print_with_fingerprint
    sys.argv = ["lower_mgpu_kernel", *sys.argv[1:]]
    runpy.run_module("tests.lower_mgpu_kernel", run_name="__main__")
