"""Experiment (CPU only): the SASS loops of a Mosaic GPU kernel's PTX, without a GPU.

The GPU image has no nvdisasm, and a Mosaic GPU kernel reaches PTX only on the GPU (jaxlib compiles it there). Dump its
PTX on the GPU (`MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR`: DIR/entry_N.ptx beside ptxas' report), bring it back,
then here: ptxas (CUDA 13's for Mosaic's PTX 9.0: $PTXAS, else the first of /usr/local/cuda*/bin/ptxas and PATH)
builds it for sm_90a and the nvdisasm Triton's wheel carries disassembles it. Prints ptxas' report, the spill
instructions (STL / LDL) by region (before and after the producer's setmaxnreg decrease), and each loop (a label with a
branch back to it, retry loops of mbarrier waits left out) with its instruction count and the opcodes that matter in
attention loops. With a second PTX, each side's loops that issue wgmma are compared opcode by opcode.

With --splits, one PTX is built again for each register split (its `setmaxnreg` increases set to the consumers'
count, its decreases to the producer's), each report saying whether the split can launch (`register_split_fits`).

Found with it (benchmarks/RESULTS.md): the fp8 extend producer's hoisted addresses in local memory, and the two-stage
prefix loop's 533 instructions a tile against the unified loop's 513 (thirty-fifth session); that no split of three
warpgroups frees the fp8 MLA producer's spills, which end near 224 registers (thirty-sixth session).

Usage: python benchmarks/experiments/sass_loops.py A.ptx [B.ptx]
       python benchmarks/experiments/sass_loops.py A.ptx --splits 232/40,216/72,208/88
"""

import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from jaxattn.aot import sass_loops  # noqa: E402  (the loop finder `python -m jaxattn.aot --loop` uses)

KEY_OPCODES = ("HGMMA", "MUFU.EX2", "FMNMX", "FFMA", "FMUL", "FADD", "F2FP", "SYNCS.PHASECHK", "BAR", "BRA", "LDL",
               "STL", "LDS", "STS", "LDGSTS", "R2UR", "VIMNMX", "ISETP")


def sass_of(ptx: str) -> tuple[str, str]:
    """(ptxas' report, the SASS text) of a PTX file built for sm_90a: CUDA 13's ptxas ($PTXAS, else the newest
    /usr/local/cuda*/bin/ptxas, else PATH's), Triton's nvdisasm."""
    import triton

    ptxas = os.environ.get("PTXAS") or next(
        (p for p in sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True) + [shutil.which("ptxas")] if p), None)
    if not ptxas:
        raise SystemExit("no ptxas: set $PTXAS")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        built = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(built.stderr)
        sass = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    return built.stderr, sass


def opcodes(instructions) -> collections.Counter:
    """Full opcodes (predicates dropped) of instruction texts."""
    return collections.Counter(text.split()[1] if text.startswith("@") else text.split()[0] for text in instructions)


def key_counts(counter) -> str:
    return ", ".join(f"{name} {sum(n for op, n in counter.items() if op.startswith(name))}" for name in KEY_OPCODES
                     if any(op.startswith(name) for op in counter))


def report(ptx: str):
    ptxas_report, sass = sass_of(ptx)
    print(f"== {ptx}\n{ptxas_report.strip()}")
    lines = sass.splitlines()
    dealloc = next((i for i, line in enumerate(lines) if "USETMAXREG.DEALLOC" in line), len(lines))
    for region, part in (("before the producer's setmaxnreg decrease", lines[:dealloc]),
                         ("the producer's (from it on)", lines[dealloc:])):
        spills = [line for line in part if " STL" in line or " LDL" in line]
        print(f"spills, {region}: STL {sum(' STL' in line for line in spills)}, "
              f"LDL {sum(' LDL' in line for line in spills)}")
    wgmma_loops = []
    for label, body in sass_loops(sass):
        counts = opcodes(body)
        print(f"loop {label}: {len(body)} instructions; {key_counts(counts)}")
        if any(op.startswith("HGMMA") for op in counts):
            wgmma_loops.append((label, counts))
    return wgmma_loops


def with_split(ptx_text: str, consumer: int, producer: int) -> str:
    """The PTX with every `setmaxnreg` increase set to `consumer` registers and every decrease to `producer`."""
    text = re.sub(r"setmaxnreg\.inc\.sync\.aligned\.u32 \d+;", f"setmaxnreg.inc.sync.aligned.u32 {consumer};",
                  ptx_text)
    return re.sub(r"setmaxnreg\.dec\.sync\.aligned\.u32 \d+;", f"setmaxnreg.dec.sync.aligned.u32 {producer};", text)


def report_splits(ptx: str, splits: str):
    """report() of `ptx` rebuilt at each "consumer/producer" split of `splits` (comma-separated)."""
    from jaxattn.kernels.extend_attention_mgpu import WARPGROUP, register_split_fits

    with open(ptx) as f:
        text = f.read()
    threads = re.search(r"\.maxntid (\d+)", text)
    warpgroups = int(threads.group(1)) // WARPGROUP if threads else None
    with tempfile.TemporaryDirectory() as tmp:
        for split in splits.split(","):
            consumer, producer = map(int, split.split("/"))
            fits = warpgroups and register_split_fits((consumer,) * (warpgroups - 1) + (producer,))
            print(f"=== split {consumer} / {producer} ({warpgroups} warpgroups: "
                  f"{'fits the launch' if fits else 'past the launch: compiled, not runnable'})")
            path = os.path.join(tmp, f"split_{consumer}_{producer}.ptx")
            with open(path, "w") as f:
                f.write(with_split(text, consumer, producer))
            report(path)


def main():
    if len(sys.argv) == 4 and sys.argv[2] == "--splits":
        return report_splits(sys.argv[1], sys.argv[3])
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    sides = [report(path) for path in sys.argv[1:]]
    if len(sides) == 2:
        for (label_a, a), (label_b, b) in zip(*sides):
            print(f"== wgmma loop {label_a} against {label_b}: {sum(a.values())} / {sum(b.values())} instructions")
            for op in sorted(set(a) | set(b)):
                if a[op] != b[op]:
                    print(f"  {op}: {a[op]} / {b[op]}")


if __name__ == "__main__":
    main()
