"""Experiment: runs a module or script with flags of the Mosaic GPU kernels set, so a bench or timeline run can time
a kernel form before it becomes the default, or the default against the form it replaced (the flags are read when a
kernel is traced).

Flags: `jaxattn.kernels.extend_attention_mgpu.kernel_flags()` (they reach the MLA and decode kernels that import its
pieces), e.g. PREFIX_FAST_WAITS, FP8_ADDRESSES_PER_TILE.

Usage, from the repository root:
    python3 benchmarks/experiments/with_kernel_flags.py FP8_ADDRESSES_PER_TILE=1 -- -m jaxattn.bench extend --cases E3
    python3 benchmarks/experiments/with_kernel_flags.py PREFIX_FAST_WAITS=0 -- benchmarks/experiments/bench_timeline.py \
        extend --cases E3
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    args = sys.argv[1:]
    if "--" not in args:
        raise SystemExit(__doc__)
    split = args.index("--")
    settings, command = args[:split], args[split + 1:]
    if not command:
        raise SystemExit(__doc__)
    from jaxattn.kernels import extend_attention_mgpu

    for setting in settings:
        try:
            name, value = extend_attention_mgpu.set_kernel_flag(setting, value_required=True)
        except ValueError as error:
            raise SystemExit(str(error))
        print(f"with_kernel_flags: {name} = {value}", flush=True)
    if command[0] == "-m":
        sys.argv = [command[1]] + command[2:]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main()
