"""How much of the fp8 kernels' time is the in-place conversion (issue 26): `python -m jaxattn.bench` with the
conversion steps replaced. FP8_STEPS=none (the default) removes them (`fp8_conversion_steps` -> none: the producer
still copies each tile, waits for its copies, syncs and releases it; the consumers read unconverted bytes, so the
outputs are wrong and only the times mean anything); FP8_STEPS=rounds converts in rounds of `fp8_round_rows` only,
a sync in each (the form before the halving phases; correct outputs); FP8_STEPS=phases keeps the kernel's steps (for
the options below alone). FP8_REGISTERS=c,p sets the two-consumer kernels' registers per thread (consumer, producer;
232,40 by default: the producer's 40 hold few loads in flight); 2c + p must stay within 504 (`register_split_fits`:
the kernel refuses a split past the launch's registers, which hangs on the GPU). FP8_CONVERT=integer|permute
replaces the f16 tiles' conversion instruction (one cvt per two values): "integer" with integer ops, exact for every
e4m3fn byte NaN included but 2^8 too small (the scales are not adjusted here: times only), "permute" with e5m2's two
byte permutes (on e4m3 data, times only); set FP8_STEPS=phases with it. In SASS for sm_90 (ptxas 13.0) four fp8
values take 2 F2FP.F16.E4M3.UNPACK_B, 2 PRMT, or 19 integer instructions (LOP3, LEA.HI, VIADD, SHF, IMAD). Run it
beside the real rows in one device call: the difference is what the conversion, or its phases, cost on the critical
path.

Usage: [FP8_STEPS=none|rounds|phases] [FP8_REGISTERS=c,p] [FP8_CONVERT=integer|permute] \
    python benchmarks/experiments/fp8_conversion_cost.py <jaxattn.bench arguments>
"""
import os
import sys

from jaxattn.bench.cli import main
from jaxattn.kernels import extend_attention_mgpu


def rounds_only(block_kv, head_dim):
    rows = extend_attention_mgpu.fp8_round_rows(head_dim)
    return tuple((row, rows, True) for row in range(0, block_kv, rows))


# Each writes two f16x2 words $0, $1 from the four bytes of $2, as `FP8_TO_F16_PTX` does (braces doubled: the kernel
# formats the string). permute: bytes 0, 1 and 2, 3, as cvt pairs them. integer: bytes 0, 2 and 1, 3 (a kernel taking
# it would pair them as cvt does with one more permute; times only here); f16 = sign | (magnitude << 7), i.e. value x
# 2^-8, then magnitude 0x3F80 (e4m3fn's NaN) made 0x7E00 (adding 0x80 reaches bit 14 for it alone).
INTEGER_HALVES = """and.b32 t, {x}, 0x80008000;
and.b32 u, {x}, 0x7F007F00;
shr.b32 u, u, 1;
or.b32 {out}, t, u;
and.b32 m, {out}, 0x7FFF7FFF;
add.u32 m, m, 0x00800080;
and.b32 m, m, 0x40004000;
shr.b32 m, m, 9;
mul.lo.u32 m, m, 0x3F0;
or.b32 {out}, {out}, m;"""
CONVERSIONS = {
    "integer": "{{\n.reg .b32 s, t, u, m;\nshl.b32 s, $2, 8;\n" + INTEGER_HALVES.format(x="s", out="$0")
               + "\n" + INTEGER_HALVES.format(x="$2", out="$1") + "\n}}",
    "permute": "{{\nprmt.b32 $0, $2, 0, 0x1404;\nprmt.b32 $1, $2, 0, 0x3424;\n}}",
}
STEPS = {"none": lambda block_kv, head_dim: (), "rounds": rounds_only,
         "phases": extend_attention_mgpu.fp8_conversion_steps}
# The MLA kernel converts with the same functions.
extend_attention_mgpu.fp8_conversion_steps = STEPS[os.environ.get("FP8_STEPS", "none")]
if "FP8_REGISTERS" in os.environ:
    extend_attention_mgpu.REGISTERS[2] = tuple(int(n) for n in os.environ["FP8_REGISTERS"].split(","))
if "FP8_CONVERT" in os.environ:
    extend_attention_mgpu.FP8_TO_F16_PTX = CONVERSIONS[os.environ["FP8_CONVERT"]]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
