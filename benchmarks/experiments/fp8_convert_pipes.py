"""Which pipe converts fp8 to f16 on this GPU, and whether integer ops would convert cheaper (issue 26). The fp8 extend
kernel's own conversion (one `cvt.rn.f16x2.e4m3x2` per two values) costs ~0.17 ms at E3-FP8 on the H100 however its
steps are arranged (RESULTS.md, twenty-ninth session): throughput, not latency. If that instruction shares the
multi-function unit with exp2 (`ex2.approx`, which the consumers' softmax runs on every score), the producer's
conversion competes with the consumers' exp2; integer ops (vLLM Marlin's form: two LOP3s and shifts per two values,
the exponent bias folded into a scale) run on other pipes; e5m2 needs only byte permutes (it is f16's top byte).

Each Triton kernel keeps its data in registers and repeats its work ITERS times per element, so time is the pipes'
throughput: a baseline loop (the loop's own integer work), cvt, integer form, exp2, then cvt + exp2 and integer +
exp2 in one loop. If cvt + exp2 takes about cvt's time plus exp2's, they share a pipe; about the larger of the two,
they do not. Prints ps per word-iteration (one 32-bit word: 4 fp8 values, or 4 exp2). Needs torch and triton.

The integer form is exact for every e4m3fn byte but the two NaNs, which it turns into +-480 (checked against
ml_dtypes over all 256 bytes): a kernel taking it must restore NaN (a compare per byte) to keep NaN in, NaN out.

Usage: python3 benchmarks/experiments/fp8_convert_pipes.py [--json PATH]
"""
import argparse
import json

import torch
import triton
import triton.language as tl

ITERS = 256
CVT = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                   "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")
# e5m2 is f16's top byte: each byte moved into the high byte of a 16-bit half, exact (NaN and inf included).
PRMT = tl.constexpr("prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;")


@triton.jit
def _convert(word, MODE: tl.constexpr):
    """Two i32 of f16x2 from one i32 of 4 fp8 bytes (MODE 1: cvt; 2: integer ops, no NaN, exponent bias 2^8 off;
    3: e5m2 by byte permutes)."""
    if MODE == 1:
        lo, hi = tl.inline_asm_elementwise(CVT, "=r,=r,r", [word], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    elif MODE == 3:
        lo, hi = tl.inline_asm_elementwise(PRMT, "=r,=r,r", [word], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        signs = -0x7FFF8000  # 0x80008000 as an int32
        lo = (word & signs) | ((word & 0x7F007F00) >> 1)
        shifted = word << 8
        hi = (shifted & signs) | ((shifted & 0x7F007F00) >> 1)
    return lo, hi


@triton.jit
def pipes_kernel(words_ptr, out_ptr, CONVERT: tl.constexpr, EXP2: tl.constexpr, ITERS: tl.constexpr,
                 BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    word = tl.load(words_ptr + offsets)
    sink = word
    value = word.to(tl.float32, bitcast=True) * 1e-30
    for _ in range(ITERS):
        if CONVERT:
            lo, hi = _convert(word, CONVERT)
            sink ^= lo ^ hi
        if EXP2:  # four exp2 per word, as the consumers' four scores per fp8 word of K
            value = tl.math.exp2(value) * 0.5
            value = tl.math.exp2(value) * 0.5
            value = tl.math.exp2(value) * 0.5
            value = tl.math.exp2(value) * 0.5
        word += 0x01010101  # new bytes each iteration: nothing is hoisted out of the loop
    tl.store(out_ptr + offsets, sink ^ value.to(tl.int32, bitcast=True))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    block, elements = 1024, 132 * 32 * 1024
    words = torch.randint(-2**31, 2**31 - 1, (elements,), dtype=torch.int32, device="cuda")
    out = torch.empty_like(words)
    rows = []
    for name, convert, exp2 in (("loop alone", 0, False), ("cvt", 1, False), ("integer ops", 2, False),
                                ("e5m2 permutes", 3, False), ("exp2", 0, True), ("cvt + exp2", 1, True),
                                ("integer ops + exp2", 2, True), ("e5m2 permutes + exp2", 3, True)):
        grid = (elements // block,)
        run = lambda: pipes_kernel[grid](words, out, CONVERT=convert, EXP2=exp2, ITERS=ITERS,  # noqa: E731
                                         BLOCK=block, num_warps=8)
        ms = triton.testing.do_bench(run, warmup=50, rep=300)
        ns = ms * 1e6 / (elements * ITERS)
        rows.append(dict(name=name, ms=ms, ns_per_word_iteration=ns))
        print(f"{name:20s} {ms:8.3f} ms  {ns * 1e3:8.3f} ps per word-iteration", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), iters=ITERS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
