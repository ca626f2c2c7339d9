"""Prints a fingerprint of every Mosaic GPU shape `tests/lower_mgpu_kernel.py` lowers: the sha256 of the exported
module (the kernels' serialized Mosaic GPU modules included), so a refactor can be shown to change no kernel.

Usage (the lowering environment of tests/lower_mgpu_kernel.py):
    PYTHONPATH=.venv/mosaic_gpu_lowering:. JAX_PLATFORMS=cpu python scripts/kernel_fingerprints.py [SUBSTRING] > a.txt
then the same on the other revision (`git worktree add`) and `diff a.txt b.txt`.
"""
import hashlib
import runpy
import sys

import jax

modules = []
export = jax.export.export


def recording_export(*args, **kwargs):
    def run(*call_args):
        exported = export(*args, **kwargs)(*call_args)
        modules.append(hashlib.sha256(exported.mlir_module().encode()).hexdigest()[:16])
        return exported

    return run


jax.export.export = recording_export
printed = print


def print_with_fingerprint(*args, **kwargs):  # "ok <label>" lines gain the shape's module hashes
    line = " ".join(map(str, args))
    if line.startswith(("ok ", "FAIL ")):
        line += " " + ",".join(modules)
        modules.clear()
    printed(line, **kwargs)


if __name__ == "__main__":
    import builtins

    builtins.print = print_with_fingerprint
    sys.argv = ["lower_mgpu_kernel", *sys.argv[1:]]
    runpy.run_module("tests.lower_mgpu_kernel", run_name="__main__")
