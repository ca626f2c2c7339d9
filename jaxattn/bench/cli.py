"""Benchmarks: jaxattn beside its peers and the physical floor, on the shapes of benchmarks/ANCHORS.md.

    python -m jaxattn.bench decode [--cases D1,D2] [--json out.json] [--plot out.png] [--sweep [REGEX]]
    python -m jaxattn.bench extend [--cases E1] [--json out.json] [--plot out.png] [--sweep [REGEX]]
    python -m jaxattn.bench decode --page-sizes 1,16,64     # each case also over KV pages of 16 and 64 tokens
    python -m jaxattn.bench extend --cases E1 --rounds 3    # backends timed in 3 interleaved rounds, with spread
    python -m jaxattn.bench plot results/decode.json results/extend.json -o plot.png


Every backend is timed the same way in one process on one GPU: N back-to-back calls on device-resident
inputs, then one synchronisation; the figure is the median over repeats of (elapsed / N). Inputs are
random normal (never zeros) and every sequence's KV slots are scattered at random over the pool, as a
real allocator leaves them. Floors: decode reads every K and V byte once at the GPU's measured copy rate (4.3 TB/s
on the H200); extend does 2 * q_heads * (qk_head_dim + v_head_dim) * new * (prefix + (new + 1) / 2) FLOPs per
sequence at its measured bf16 matmul rate (790 TFLOP/s on the H200): `cases.CEILINGS`, per device.
(benchmarks/ANCHORS.md: the shapes, the floors and the peers' figures.)
`--page-sizes` runs every case at each page size P (default 1 only): P > 1 scatters whole pages instead of slots,
tokens contiguous within a page, FlashInfer planned with page_size P; its rows are named <case>-P<P> (D1-P16),
with the case's floor (`jaxattn.bench.inputs`), timed in the same rounds as the case's page-1 rows, against which
each gets a paired ratio (`vs_page_1`).
Peers that are not installed (FlashInfer, torch) or not supported for a shape are skipped with a note.
Each run prints a markdown table; `--json` keeps the rows (with device, date and commit: git's, or
$JAXATTN_COMMIT where the checkout has no .git) and `--plot` draws fraction-of-floor bars (matplotlib, the
`jaxattn[bench]` extra).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

from .cases import CASES, case_named, device_name, paged_case
from .inputs import make_inputs
from .peers import BACKENDS, Skip
from .report import commit, floor_note, load_rows, markdown_table, plot_rows, require_matplotlib, today
from .sweeps import sweep_variants
from .timing import jax_sync, time_calls


def _progress(total: int, desc: str):
    """A tqdm bar over the sweep's work items, or None when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="item", leave=False, dynamic_ncols=True)


def run(op: str, cases: list, backends: list[str] | None = None, sweep: bool | str = False, log=print,
        progress: bool = True, page_sizes=(1,), rounds: int = 1) -> list[dict]:
    """Times every (case, page size, backend or config) work item; returns one row per timed item.

    `sweep`: True times every candidate configuration (`sweep_variants`) too; a string, those whose label it matches
    (a regular expression, searched).

    `rounds` > 1: a case's items are timed in that many interleaved rounds (each round times every item once), so a
    drift of the GPU's state during the run falls on every backend alike; a row's `median_ms` is the median of its
    rounds, `round_ms` lists them and `spread` is (slowest - fastest) / median: how much the rounds varied. A case's
    page sizes share its rounds (each round times every page size's items), and a paged row also gets `vs_page_1`:
    the median over rounds of its time / the same backend's page-1 time in that round (a paired ratio, which a drift
    between rounds does not move as it moves a ratio of two medians).

    `cases` are names (of CASES, or paged ones like D1-P16) or `Case` objects; each runs at every one of
    `page_sizes` (`paged_case`). A failing or skipped item is logged, never fatal.
    """
    rows = []
    device, revision, date = device_name(), commit(), today()
    named = [case_named(c) if isinstance(c, str) else c for c in cases]
    unknown = [c for c, case in zip(cases, named) if case is None]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}: the names are {list(CASES)} (a paged one: D1-P16)")
    groups = [[paged_case(case, page_size) for page_size in page_sizes] for case in named]  # timed together
    work = []  # (case, backend label, maker, sync)
    for case in (case for group in groups for case in group):
        if case.op != op:
            raise SystemExit(f"case {case.name} is a {case.op} case, not {op}")
        chosen = BACKENDS[op] if backends is None else {b: BACKENDS[op][b] for b in backends}
        work += [(case, backend, maker, sync) for backend, (maker, sync) in chosen.items()]
        if sweep is not False:
            pattern = re.compile("" if sweep is True else sweep)
            work += [(case, f"sweep[{label}]", maker, jax_sync) for label, maker in sweep_variants(op, case)
                     if pattern.search(label)]
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    bar = _progress(len(work) * rounds, f"bench {op}") if progress else None
    say = log if bar is None else (lambda line: bar.write(line))
    for group in groups:  # a case's items at every page size together, in order
        inputs = None  # free the previous group's arrays first
        inputs = {case.name: make_inputs(case) for case in group}
        timed = {}  # (case name, backend label) -> (fn, sync, [ms per round])
        for case, backend, maker, sync in (item for item in work if item[0] in group):
            try:
                timed[case.name, backend] = (maker(inputs[case.name]), sync, [])
            except Skip as why:
                say(f"  {case.name:4s} {backend:24s} skipped: {why}")
            except Exception as error:  # a peer that fails must not hide the others
                say(f"  {case.name:4s} {backend:24s} FAILED: {type(error).__name__}: {str(error)[:300]}")
            if (case.name, backend) not in timed and bar is not None:
                bar.update(rounds)  # its rounds will not run
        failed = set()
        for _ in range(rounds):
            for (name, backend), (fn, sync, samples) in timed.items():
                if bar is not None:
                    bar.set_postfix_str(f"{name} {backend}", refresh=False)
                try:
                    if (name, backend) not in failed:
                        samples.append(time_calls(fn, sync))
                except Skip as why:
                    say(f"  {name:4s} {backend:24s} skipped: {why}")
                    failed.add((name, backend))
                except Exception as error:
                    say(f"  {name:4s} {backend:24s} FAILED: {type(error).__name__}: {str(error)[:300]}")
                    failed.add((name, backend))
                finally:
                    if bar is not None:
                        bar.update(1)
        page_1 = group[0] if group[0].page_size == 1 else None
        for (name, backend), (_, _, samples) in timed.items():
            if (name, backend) in failed:
                continue
            case = next(c for c in group if c.name == name)
            floor = case.floor_ms()
            ms = statistics.median(samples)
            row = dict(op=op, case=name, backend=backend, median_ms=round(ms, 4), floor_ms=round(floor, 4),
                       fraction_of_floor=round(floor / ms, 3), device=device, commit=revision, date=date)
            spread = ""
            if rounds > 1:
                row.update(round_ms=[round(t, 4) for t in samples], spread=round((max(samples) - min(samples)) / ms, 4))
                spread = f"  rounds vary {100 * row['spread']:.1f}%"
            base = (page_1.name, backend) if page_1 is not None and case is not page_1 else None
            if base in timed and base not in failed:
                row["vs_page_1"] = round(statistics.median(t / t1 for t, t1 in zip(samples, timed[base][2])), 4)
                spread += f"  {row['vs_page_1']:.3f}x page 1 (paired rounds)"
            rows.append(row)
            say(f"  {name:4s} {backend:24s} {ms:8.3f} ms  floor {floor:6.3f} ms  {100 * floor / ms:5.1f}% of floor"
                + spread)
    if bar is not None:
        bar.close()
    return rows


def page_sizes_argument(text: str) -> tuple[int, ...]:
    """--page-sizes "1,16,64" -> (1, 16, 64); each one of jaxattn.paging.PAGE_SIZES."""
    from jaxattn.paging import PAGE_SIZES

    try:
        sizes = tuple(int(size) for size in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(size not in PAGE_SIZES for size in sizes):
        raise SystemExit(f"--page-sizes must be comma-separated page sizes of {PAGE_SIZES}; got {text!r}")
    return sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxattn.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for op in ("decode", "extend"):
        p = sub.add_parser(op, help=f"time the {op} cases")
        p.add_argument("--cases", default=None, help="comma-separated case names (default: all of the op)")
        p.add_argument("--backends", default=None, help="comma-separated backends (default: all)")
        p.add_argument("--json", default=None, help="write the rows to this JSON file")
        p.add_argument("--plot", default=None, help="write a PNG of %% of floor per case and backend (needs matplotlib)")
        p.add_argument("--sweep", nargs="?", const=True, default=False, metavar="REGEX",
                       help="also time every candidate kernel configuration (with REGEX: those whose label it matches)")
        p.add_argument("--page-sizes", default="1", help="comma-separated KV page sizes to run each case at (default: 1)")
        p.add_argument("--rounds", type=int, default=1,
                       help="time a case's backends in this many interleaved rounds; rows give the median and spread")
        p.add_argument("--no-progress", action="store_true", help="no progress bar; one line per item instead")
    p = sub.add_parser("plot", help="plot saved JSON records")
    p.add_argument("records", nargs="+", help="JSON files written by --json")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--title", default=None)
    p.add_argument("--sweeps", action="store_true", help="include sweep[...] rows")
    args = parser.parse_args(argv)
    if args.command == "plot":
        rows = load_rows(args.records)
        print(markdown_table(rows))
        print(f"wrote {plot_rows(rows, args.output, title=args.title, include_sweeps=args.sweeps)}")
        return 0
    if args.plot:
        require_matplotlib()  # fail before the sweep, not after it
    case_names = args.cases.split(",") if args.cases else [n for n, c in CASES.items() if c.op == args.command and c.default]
    backends = args.backends.split(",") if args.backends else None
    page_sizes = page_sizes_argument(args.page_sizes)
    print(f"jaxattn.bench {args.command}: device {device_name()}, commit {commit()}")
    print(floor_note(args.command, device_name()))
    rows = run(args.command, case_names, backends, sweep=args.sweep, log=lambda s: print(s, flush=True),
               progress=not args.no_progress, page_sizes=page_sizes, rounds=args.rounds)
    print()
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot and rows:
        print(f"wrote {plot_rows(rows, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
