"""Experiment (CPU only): the SASS loops of a Mosaic GPU kernel's PTX, without a GPU.

The GPU image has no nvdisasm, and a Mosaic GPU kernel reaches PTX only on the GPU (jaxlib compiles it there). Dump its
PTX on the GPU (`MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=DIR`: DIR/entry_N.ptx beside ptxas' report), bring it back,
then here: ptxas (CUDA 13's for Mosaic's PTX 9.0: $PTXAS, else the first of /usr/local/cuda*/bin/ptxas and PATH)
builds it for sm_90a and the nvdisasm Triton's wheel carries disassembles it. Prints ptxas' report, the spill
instructions (STL / LDL) by region (before and after the producer's setmaxnreg decrease), and each loop (a label with a
branch back to it, retry loops of mbarrier waits left out) with its instruction count and the opcodes that matter in
attention loops. With a second PTX, each side's loops that issue wgmma are compared opcode by opcode.

Found with it (thirty-fifth session, benchmarks/RESULTS.md): the fp8 extend producer's hoisted addresses in local
memory, and the two-stage prefix loop's 533 instructions a tile against the unified loop's 513.

Usage: python benchmarks/experiments/sass_loops.py A.ptx [B.ptx]
"""

import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

KEY_OPCODES = ("HGMMA", "MUFU.EX2", "FMNMX", "FFMA", "FMUL", "FADD", "F2FP", "SYNCS.PHASECHK", "BAR", "BRA", "LDL",
               "STL", "LDS", "STS", "LDGSTS", "R2UR", "VIMNMX", "ISETP")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s*`?\(?(\.L_x_\d+)")
OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")


def tool(name: str, env: str, candidates) -> str:
    path = os.environ.get(env) or next((c for c in candidates if c and os.path.exists(c)), None)
    if not path:
        raise SystemExit(f"no {name}: set ${env}")
    return path


def sass_of(ptx: str) -> tuple[str, list[str]]:
    """(ptxas' report, the SASS lines) of a PTX file built for sm_90a."""
    import triton

    triton_bin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = tool("ptxas", "PTXAS", sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True)
                 + [shutil.which("ptxas")])
    nvdisasm = tool("nvdisasm", "NVDISASM", [shutil.which("nvdisasm"), os.path.join(triton_bin, "nvdisasm")])
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        built = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(built.stderr)
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    return built.stderr, sass.splitlines()


def opcodes(lines) -> collections.Counter:
    return collections.Counter(m.group(1) for line in lines if (m := OPCODE.match(line)))


def loops(lines):
    """(label, first line, last line) of each loop: a branch back to a label. ptxas places the mbarrier waits' retry
    blocks at the kernel's end (a label, a move or a reload, the wait, a branch to itself, a branch back into the
    code): branches from a block with a wait among its first four instructions are left out."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    block_instructions, retry_block, found = 0, False, []
    for i, line in enumerate(lines):
        if LABEL.match(line):
            block_instructions, retry_block = 0, False
            continue
        if OPCODE.match(line):
            block_instructions += 1
            retry_block |= block_instructions <= 4 and "SYNCS.PHASECHK" in line
        m = BRANCH.search(line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and not retry_block:
            found.append((m.group(1), labels[m.group(1)], i))
    return found


def key_counts(counter) -> str:
    return ", ".join(f"{name} {sum(n for op, n in counter.items() if op.startswith(name))}" for name in KEY_OPCODES
                     if any(op.startswith(name) for op in counter))


def report(ptx: str):
    ptxas_report, lines = sass_of(ptx)
    print(f"== {ptx}\n{ptxas_report.strip()}")
    dealloc = next((i for i, line in enumerate(lines) if "USETMAXREG.DEALLOC" in line), len(lines))
    for region, part in (("before the producer's setmaxnreg decrease", lines[:dealloc]),
                         ("the producer's (from it on)", lines[dealloc:])):
        spills = opcodes(part)
        print(f"spills, {region}: STL {sum(n for op, n in spills.items() if op.startswith('STL'))}, "
              f"LDL {sum(n for op, n in spills.items() if op.startswith('LDL'))}")
    wgmma_loops = []
    for label, first, last in loops(lines):
        body = lines[first:last + 1]
        counts = opcodes(body)
        print(f"loop {label} (lines {first}-{last}): {sum(counts.values())} instructions; {key_counts(counts)}")
        if any(op.startswith("HGMMA") for op in counts):
            wgmma_loops.append((label, counts))
    return wgmma_loops


def main():
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
