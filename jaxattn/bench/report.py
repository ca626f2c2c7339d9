"""What a run reports: the markdown table, the fraction-of-floor plot, saved JSON records, and the device, commit and
date every row carries."""

from __future__ import annotations

import datetime
import json
import os
import subprocess

from .cases import case_named, ceilings_for


def commit() -> str:
    """$JAXATTN_COMMIT when set (the GPU machine's copy of the tree), else the checkout's short hash (+dirty)."""
    if os.environ.get("JAXATTN_COMMIT"):
        # Checked first: on the GPU machine a git lookup can find some other repository's HEAD.
        return os.environ["JAXATTN_COMMIT"]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jaxattn/: dirty means the package changed
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=here, capture_output=True).returncode != 0
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        pass
    return "unknown"


def today() -> str:
    return datetime.date.today().isoformat()


def markdown_table(rows: list[dict]) -> str:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    lines = ["| backend | " + " | ".join(f"{c} (floor {next(r['floor_ms'] for r in rows if r['case'] == c):.3f} ms)" for c in cases) + " |"]
    lines.append("|---|" + "---|" * len(cases))
    for b in backends:
        cells = []
        for c in cases:
            r = next((r for r in rows if r["case"] == c and r["backend"] == b), None)
            cells.append("-" if r is None else f"{r['median_ms']:.3f} ms ({100 * r['fraction_of_floor']:.0f}%)")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plot: fraction of the floor per case and backend (matplotlib, imported only here).

LABELS = {
    "jaxattn": "jaxattn",
    "jaxattn-unified": "jaxattn unified (deterministic)",
    "jaxattn-unified-triton": "jaxattn unified (deterministic), Triton kernel",
    "jaxattn-mgpu-fp8": "jaxattn extend, Mosaic GPU kernel converting fp8 tiles itself",
    "jaxattn-mgpu-unified-fp8": "jaxattn unified extend, Mosaic GPU kernel converting fp8 tiles itself",
    "jaxattn-triton": "jaxattn, Triton kernels (extend: two-stage)",
    "jaxattn-8-layers": "jaxattn, 8 layers per jitted step",
    "jaxattn-mgpu": "jaxattn MLA decode, Mosaic GPU kernel",
    "jaxattn-mgpu-gqa": "jaxattn GQA decode, Mosaic GPU kernel",
    "jaxattn-mla": "jaxattn mla_extend_attention (V inside the latent rows)",
    "jaxattn-mla-gqa": "jaxattn mla_extend_attention on the GQA extend kernel (impl mgpu-gqa)",
    "jaxattn-draft-words": "jaxattn, tree as per-row draft words",
    "jaxattn-mgpu-draft-words": "jaxattn, tree as per-row draft words, Mosaic GPU kernel",
    "flashinfer": "FlashInfer",
    "flashinfer-tc": "FlashInfer, tensor cores",
    "flashinfer-mla": "FlashInfer MLA (BatchMLAPagedAttentionWrapper)",
    "jaxattn-extend": "jaxattn extend op (the verify step without several-token decode)",
    "flashinfer-in-jit": "FlashInfer from jit (bridge)",
    "flashinfer-in-jit-8-layers": "FlashInfer from jit (bridge), 8 layers per step",
    "flashinfer-ffi-8-layers": "FlashInfer from jit (XLA FFI launch), 8 layers per step",
    "flashinfer-ffi": "FlashInfer from jit (XLA FFI launch), one launch per step",
    "flashinfer-8-layers": "FlashInfer from torch, 8 launches per call (outputs and LSEs preallocated)",
    "flashinfer-fa2": "FlashInfer fa2",
    "flashinfer-fa3": "FlashInfer fa3",
    "flashinfer-fa3-in-jit": "FlashInfer fa3 from jit (bridge)",
    "flashinfer-fa3-in-jit-8-layers": "FlashInfer fa3 from jit (bridge), 8 layers per step",
    "flashinfer-fa3-ffi-8-layers": "FlashInfer fa3 from jit (XLA FFI launch), 8 layers per step",
    "flashinfer-fa3-8-layers": "FlashInfer fa3 from torch, 8 launches per call (outputs and LSEs preallocated)",
    "cudnn": "cuDNN (dense only)",
    "reference": "reference (jnp)",
}


def floor_note(op: str, device: str | None) -> str:
    """What `op`'s floor is on `device` (the ceilings the rows were measured against)."""
    source, ceilings = ceilings_for(device)
    whose = "" if source == device else f", {source}'s"
    if op == "decode":
        return f"decode: % of the memory floor (K and V read once at {ceilings.copy_bytes_per_s / 1e12:.1f} TB/s{whose})"
    if op == "extend":
        return f"extend: % of the matmul floor (bf16 at {ceilings.bf16_matmul_flops / 1e12:.0f} TFLOP/s{whose})"
    return op


def require_matplotlib():
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(
            "jaxattn.bench: plotting needs matplotlib: pip install 'jaxattn[bench]' (or pip install matplotlib). "
            f"Import failed with: {error}"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _case_label(name: str) -> str:
    case = case_named(name)
    if case is None:
        return name
    if case.op == "decode":
        shape = f"{case.batch} x {case.prefix + case.new}"
    else:
        shape = f"{case.batch} x ({case.prefix}+{case.new})"
    if case.v_head_dim is not None:
        shape += f"\n{case.q_heads}/{case.kv_heads} heads, {case.head_dim}/{case.dv}"
    if case.page_size > 1:
        shape += f"\npages of {case.page_size}"
    return f"{name}\n{shape}"


def _summary(rows: list[dict], key: str) -> str:
    values = list(dict.fromkeys(str(r.get(key, "?")) for r in rows))
    return ", ".join(values) if values else "?"


def plot_rows(rows: list[dict], path: str, title: str | None = None, include_sweeps: bool = False) -> str:
    """Writes a PNG of grouped bars (one group per case, one bar per backend) of % of the floor; returns `path`.

    One panel per op in `rows`; the dashed line is the floor (100%). Sweep rows ("sweep[...]") are left out
    unless `include_sweeps`.
    """
    plt = require_matplotlib()
    if not include_sweeps:
        rows = [r for r in rows if not r["backend"].startswith("sweep[")]
    if not rows:
        raise ValueError("no rows to plot")
    ops = [op for op in ("decode", "extend") if any(r["op"] == op for r in rows)]
    ops += sorted({r["op"] for r in rows} - set(ops))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    palette = plt.get_cmap("tab10").colors
    colour = {b: palette[i % len(palette)] for i, b in enumerate(backends)}
    widths = [max(2, len({r["case"] for r in rows if r["op"] == op})) for op in ops]
    top = max(110.0, 100 * max(r["fraction_of_floor"] for r in rows) + 15)
    fig, axes = plt.subplots(1, len(ops), figsize=(2.2 * sum(widths) + 1.5, 6.0), squeeze=False,
                             gridspec_kw=dict(width_ratios=widths))
    for ax, op in zip(axes[0], ops):
        op_rows = [r for r in rows if r["op"] == op]
        cases = list(dict.fromkeys(r["case"] for r in op_rows))
        op_backends = [b for b in backends if any(r["backend"] == b for r in op_rows)]
        op_backends.sort(key=lambda b: b == "reference")  # the slow oracle last
        bar_width = 0.84 / len(op_backends)
        labelled = set()
        for i, case in enumerate(cases):
            present = [(b, r) for b in op_backends for r in op_rows if r["case"] == case and r["backend"] == b]
            for j, (backend, row) in enumerate(present):  # centred on the case: no gaps for skipped backends
                x = i + bar_width * (j - (len(present) - 1) / 2)
                y = 100 * row["fraction_of_floor"]
                label = LABELS.get(backend, backend) if backend not in labelled else "_nolegend_"
                labelled.add(backend)
                ax.bar([x], [y], bar_width, color=colour[backend], label=label,
                       edgecolor="black" if backend == "jaxattn" else "none", linewidth=1.0)
                ax.annotate(f"{y:.0f}", (x, y), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                            fontsize=7)
        handles, labels = ax.get_legend_handles_labels()
        order = sorted(range(len(labels)), key=lambda k: [LABELS.get(b, b) for b in op_backends].index(labels[k]))
        ax.axhline(100, color="black", linestyle="--", linewidth=1)
        ax.text(len(cases) - 0.5, 101, "floor", ha="right", va="bottom", fontsize=8)
        ax.set_xticks(range(len(cases)), [_case_label(c) for c in cases], fontsize=8)
        ax.set_xlim(-0.5, len(cases) - 0.5)
        ax.set_ylim(0, top)
        ax.set_title(floor_note(op, _summary(op_rows, 'device')), fontsize=9)
        ax.set_ylabel("% of floor (higher is better)")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend([handles[k] for k in order], [labels[k] for k in order], fontsize=7, loc="upper center",
                  bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    if title is None:
        title = (f"jaxattn benchmarks on {_summary(rows, 'device')}, {_summary(rows, 'date')}, "
                 f"commit {_summary(rows, 'commit')}")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def load_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)
    return rows
