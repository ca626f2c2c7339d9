"""Benchmarks: jaxattn beside its peers and the physical floor, on the shapes of benchmarks/ANCHORS.md.

    python -m jaxattn.bench decode|extend [--cases D1,D2] [--page-sizes 1,16,64] [--json out.json] [--plot out.png]
                                          [--sweep]
    python -m jaxattn.bench plot results/decode.json results/extend.json -o plot.png

benchmarks/ANCHORS.md holds the shapes, how the floors are computed and the peers' figures the project compares
against; benchmarks/RESULTS.md the runs. One job per module:
    cases   Case, CASES (the anchor shapes and the tuning cases), CEILINGS (each GPU's measured rates, ceilings_for,
            device_name), Case.floor_ms, paged_case (a case over KV pages, named D1-P16), case_named
    inputs  Inputs, make_inputs: device-resident random inputs with scattered KV slots (or pages)
    timing  time_calls (N back-to-back calls, one sync, median of repeats), PerCall, jax_sync, torch_sync
    peers   the backend adapters (jaxattn, FlashInfer from torch and through the bridge, cuDNN, reference), Skip, BACKENDS
    sweeps  sweep_variants: candidate kernel configurations per shape (--sweep)
    report  markdown_table, plot_rows, load_rows, floor_note, commit, today
    cli     run (times the work items, one row each) and main (the argparse command line)
"""

from .cases import (
    BF16_MATMUL_FLOPS,
    CASES,
    CEILINGS,
    COPY_BANDWIDTH_BYTES_PER_S,
    Case,
    Ceilings,
    case_named,
    ceilings_for,
    device_name,
    paged_case,
)
from .cli import main, run
from .inputs import Inputs, make_inputs
from .peers import (
    BACKENDS,
    Skip,
    bridged,
    decode_flashinfer,
    decode_jaxattn,
    decode_reference,
    extend_cudnn,
    extend_flashinfer,
    extend_jaxattn,
    extend_meta,
    extend_mgpu,
    extend_reference,
    torch_views,
)
from .report import LABELS, commit, floor_note, load_rows, markdown_table, plot_rows, today
from .sweeps import sweep_variants
from .timing import PerCall, jax_sync, time_calls, torch_sync

__all__ = [
    "BACKENDS", "BF16_MATMUL_FLOPS", "Case", "CASES", "Ceilings", "CEILINGS", "COPY_BANDWIDTH_BYTES_PER_S",
    "Inputs", "LABELS", "PerCall", "Skip", "bridged", "case_named", "ceilings_for", "commit", "decode_flashinfer",
    "decode_jaxattn", "decode_reference", "device_name", "extend_cudnn", "extend_flashinfer", "extend_jaxattn",
    "extend_meta", "extend_mgpu", "extend_reference", "floor_note", "jax_sync", "load_rows", "main", "make_inputs",
    "markdown_table", "paged_case", "plot_rows", "run", "sweep_variants", "time_calls", "today", "torch_sync",
    "torch_views",
]
