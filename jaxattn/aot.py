"""Ahead-of-time compilation of shipped kernel configurations for a GPU target, without a GPU.

Each module that launches Triton kernels lists the builds its block-size tables and heuristics can choose (`kernel_builds()`),
and `compile_build` compiles one for a `GPUTarget` with Triton's bundled ptxas. CI uses it to prove every
configuration compiles for the H200 (sm_90), fits in shared memory and uses Hopper's wgmma where it
should; developers use `python -m jaxattn.aot` to see what a tuning change costs before spending GPU time.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import sys

from jaxattn.hardware import SM90

H200_TARGET = SM90.aot_target
H200_SHARED_LIMIT_BYTES = SM90.shared_memory_bytes  # opt-in shared memory per block on sm_90


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One kernel x configuration, as a launch would compile it."""

    module: str  # module of jaxattn.kernels, e.g. "merge_state"
    function: str  # the @triton.jit function
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type) for every non-constexpr parameter, e.g. ("Q", "*bf16")
    constexprs: tuple[tuple[str, object], ...]  # (parameter, value)
    num_warps: int = 4
    num_stages: int = 1
    expects_wgmma: bool = False  # a tl.dot kernel on bf16/fp16 should use Hopper's wgmma
    expects_pipelining: bool = False  # its main loop's loads should be software-pipelined (cp.async / TMA in the PTX)
    max_registers: int | None = None  # registers per thread its timing relied on (occupancy; on tuning.sm90.TIMED_TRITON)
    label: str = ""  # what configuration this is, for the report

    @property
    def key(self) -> str:
        return f"{self.module}.{self.function}[{self.label}]"


def build(module, function, signature, constexprs, *, num_warps=4, num_stages=1, expects_wgmma=False,
          expects_pipelining=False, max_registers=None, label=""):
    """Convenience constructor taking dicts."""
    return KernelBuild(
        module, function, tuple(signature.items()), tuple(sorted(constexprs.items())), num_warps, num_stages, expects_wgmma,
        expects_pipelining, max_registers, label,
    )


@dataclasses.dataclass(frozen=True)
class CompiledReport:
    build: KernelBuild
    shared_bytes: int
    registers: int | None
    spills: int | None
    has_wgmma: bool
    has_async_copy: bool  # cp.async or TMA loads: the pipeliner turned loads into asynchronous copies


@functools.lru_cache(maxsize=None)
def _compile(kb: KernelBuild, target: tuple):
    """Triton's compiled kernel of `kb` for `target` (backend, arch, warp size)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"jaxattn.kernels.{kb.module}"), kb.function)
    constexprs = dict(kb.constexprs)
    signature = dict(kb.signature)
    # jax-triton tells Triton that every array argument is 16-byte aligned (XLA's buffers are); without the
    # same hint here the compiler assumes 2-byte alignment, cannot use cp.async and does not pipeline loads.
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    # enable_fp_fusion: the launches' default on Triton 3.6-3.9, stated so a later default (3.10 flips it) keeps the report.
    options = {"num_warps": kb.num_warps, "num_stages": kb.num_stages, "enable_fp_fusion": True}
    return triton.compile(source, target=GPUTarget(*target), options=options)


@functools.lru_cache(maxsize=None)
def compile_build(kb: KernelBuild, target: tuple = H200_TARGET) -> CompiledReport:
    """Compiles `kb` for `target` (backend, arch, warp size) and reports its resources."""
    compiled = _compile(kb, target)
    ptx = compiled.asm.get("ptx", "")
    registers, spills = _ptxas_resources(ptx, target[1])
    has_async = "cp.async" in ptx or "cp.async.bulk" in ptx
    return CompiledReport(kb, int(compiled.metadata.shared), registers, spills, "wgmma" in ptx, has_async)


@dataclasses.dataclass(frozen=True)
class LoopProfile:
    """The SASS of a build's largest loop (its main loop: the key tiles): instructions per warp per iteration, and
    how many of each opcode (predicates and modifiers dropped: "HMMA.16816.F32" counts as HMMA)."""

    instructions: int
    opcodes: tuple[tuple[str, int], ...]  # most frequent first

    def count(self, opcode: str) -> int:
        return dict(self.opcodes).get(opcode, 0)


def main_loop(kb: KernelBuild, target: tuple = H200_TARGET) -> LoopProfile | None:
    """`LoopProfile` of kb's largest loop (the span from a backward branch's target to the branch), from Triton's
    bundled nvdisasm; None if the kernel has no loop. An issue-bound kernel's time follows these counts (Nsight
    Compute's count for the fp8 decode table tile matched this one, 1081, benchmarks/RESULTS.md), so they compare
    variants before any GPU time is spent; they are not timings."""
    import collections
    import subprocess
    import tempfile

    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/kernel.cubin"
        with open(path, "wb") as f:
            f.write(_compile(kb, target).asm["cubin"])
        sass = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", path], capture_output=True, text=True,
                              check=True).stdout
    loops = sass_loops(sass)
    if not loops:
        return None
    body = max((body for _, body in loops), key=len)
    opcodes = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in body]
    return LoopProfile(len(opcodes), tuple(collections.Counter(opcodes).most_common()))


def sass_loops(sass: str) -> list[tuple[str, list[str]]]:
    """The loops of a kernel's SASS (`nvdisasm -c` text): (label, the instructions from the label to the branch back
    to it), in the order of their branches. ptxas places mbarrier waits' retry blocks after the code (a move or a
    reload, the wait, a branch to itself, a branch back into the code); a branch from a block with a wait among its
    first four instructions closes no loop."""
    instructions, labels = [], {}  # instruction texts; label -> index of its first instruction
    loops, block_length, retry_block = [], 0, False
    for line in sass.splitlines():
        if found := re.match(r"\s*\.(L_x_\d+):", line):
            labels[found.group(1)], block_length, retry_block = len(instructions), 0, False
        elif found := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            text = found.group(1).strip()
            block_length += 1
            retry_block |= block_length <= 4 and "SYNCS.PHASECHK" in text
            instructions.append(text)
            branch = re.search(r"BRA[^`]*`\(\.(L_x_\d+)\)", text)
            if branch and branch.group(1) in labels and not retry_block:
                loops.append((branch.group(1), instructions[labels[branch.group(1)]:]))
    return loops


def _ptxas_resources(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers per thread, spilled bytes) from Triton's bundled ptxas in verbose mode.

    Without a driver Triton leaves its own n_regs/n_spills unset, so assemble the PTX once more with -v.
    """
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/kernel.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        result = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={gpu_name}", src, "-o", f"{tmp}/kernel.o"], capture_output=True, text=True
        )
    log = result.stdout + result.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spill_stores = re.search(r"(\d+) bytes spill stores", log)
    return (int(registers.group(1)) if registers else None, int(spill_stores.group(1)) if spill_stores else None)


def shipped_builds() -> list[KernelBuild]:
    """Every kernel x configuration the shipped op modules can launch on the GPU."""
    builds = []
    for module_name in OP_MODULES:
        module = importlib.import_module(module_name)
        builds.extend(module.kernel_builds())
    return builds


# Op modules that ship kernels; each defines kernel_builds() -> list[KernelBuild].
OP_MODULES = [
    "jaxattn.kv_indices",
    "jaxattn.merge_state",
    "jaxattn.impl.triton_decode",
    "jaxattn.impl.triton_extend",
]


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Compile every shipped kernel configuration for the H200 (sm_90) without a GPU.")
    parser.add_argument("-k", default="", help="only builds whose key contains this text (regular expression)")
    parser.add_argument("--loop", action="store_true",
                        help="also each build's main loop in SASS: instructions per warp per iteration, top opcodes")
    args = parser.parse_args(argv)
    rows = []
    for kb in shipped_builds():
        if args.k and not re.search(args.k, kb.key):
            continue
        report = compile_build(kb)
        rows.append(report)
        regs = "?" if report.registers is None else report.registers
        spills = "?" if report.spills is None else report.spills
        print(
            f"{kb.key:90s} warps={kb.num_warps} stages={kb.num_stages} shared={report.shared_bytes:7d} B "
            f"regs={regs} spills={spills} wgmma={'yes' if report.has_wgmma else 'no'} "
            f"async_copy={'yes' if report.has_async_copy else 'no'}"
        )
        if args.loop and (loop := main_loop(kb)) is not None:
            top = " ".join(f"{name}={n}" for name, n in loop.opcodes[:10])
            keys = dict(kb.constexprs).get("BLOCK_N")
            per_key = f" ({loop.instructions * kb.num_warps / keys:.1f} per key over the warps)" if keys else ""
            print(f"    main loop: {loop.instructions} instructions per warp per iteration{per_key}; {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
