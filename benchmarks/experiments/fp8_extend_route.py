"""Where fp8 extend should convert (issue 26): the Mosaic GPU kernel converting each pool tile itself
(`impl="mgpu-fp8"`, f16 tiles) against gathering and dequantising the listed prefix once (`impl="mgpu"`, the default),
over the new-token lengths between E3 (128) and E1 (2048).

In-kernel conversion is repeated by every CTA that reads a prefix tile ((new tokens / q rows per CTA) x q heads per
kv head / heads per CTA times), dequantising converts each listed row once, so the crossover is a length; this prints
both routes and bf16 at each length in one run, through `python -m jaxattn.bench` (the cases below are added to its
table; each sequence has 4096 cached tokens, batch x new = 4096 new tokens in all, 32/8 heads x 128).

Usage: python benchmarks/experiments/fp8_extend_route.py [jaxattn.bench extend arguments]
"""
import sys

from jaxattn.bench import cases
from jaxattn.bench.cli import main

LENGTHS = (128, 256, 512, 1024, 2048)
NAMES = []
for new in LENGTHS:
    for kv_dtype, suffix in (("bfloat16", ""), ("float8_e4m3fn", "-FP8")):
        name = f"R{new}{suffix}"
        cases.CASES[name] = cases.Case(name, "extend", 4096 // new, 4096, new, kv_dtype=kv_dtype, default=False)
        NAMES.append(name)

if __name__ == "__main__":
    args = sys.argv[1:] or ["--backends", "jaxattn,jaxattn-mgpu-fp8", "--rounds", "3", "--no-progress"]
    sys.exit(main(["extend", "--cases", ",".join(NAMES), *args]))
