"""What the decode experiment scripts share: time one variant against its case's floor, and write the run's record.

A variant that fails (a tile that does not fit, a kernel that declines) is reported and skipped: it must not hide
the others.
"""

from __future__ import annotations

import json


def time_variant(rows: list, label: str, fn, case, **fields) -> None:
    """Times fn() (`jaxattn.bench.timing.time_calls`), prints `label`, ms and % of case's floor, and appends
    dict(case=case.name, **fields, ms=, floor_ms=) to rows."""
    from jaxattn.bench.timing import jax_sync, time_calls

    try:
        ms = time_calls(fn, jax_sync)
    except Exception as error:  # noqa: BLE001  (a variant that fails must not hide the others)
        print(f"{label} FAILED {type(error).__name__}: {error}"[:300], flush=True)
        return
    floor = case.floor_ms()
    rows.append(dict(case=case.name, **fields, ms=ms, floor_ms=floor))
    print(f"{label} {ms:.4f} ms  {100 * floor / ms:5.1f}% of its floor", flush=True)


def warmed_backend(op: str, backend: str, label: str, inp):
    """(fn, sync) of a bench backend (`jaxattn.bench.BACKENDS[op][backend]`) made for inp and run 3 times (compile,
    warm), or None where it skips the case (the reason printed after `label`)."""
    from jaxattn import bench

    maker, sync = bench.BACKENDS[op][backend]
    try:
        fn = maker(inp)
    except bench.Skip as why:
        print(f"{label} {backend}: skipped: {why}", flush=True)
        return None
    for _ in range(3):
        sync(fn())
    return fn, sync


def write_record(path: str | None, rows: list) -> None:
    """The run's JSON record (device, commit, rows) at path, if one is given."""
    if path:
        from jaxattn import bench

        with open(path, "w") as f:
            json.dump(dict(device=bench.device_name(), commit=bench.commit(), rows=rows), f, indent=1)
