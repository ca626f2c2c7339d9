"""Experiment: runs a command while nvidia-smi samples the GPU every 50 ms (utilisation, SM clock, power, the clock
event reasons), then prints those figures over the samples where the GPU was busy (>= 90% utilisation), so two runs
of the same kernels can be told apart by clock.

Asked by the thirty-fifth session's timeline (benchmarks/RESULTS.md): on an H100, E1's extend kernel took 1445 us on
the GPU's clock as one jitted call a step and 1568 us a call as 8 chained calls a step (the same kernel, 8.5% longer),
while FlashInfer's fa3 timed the same in both forms. Whether the 8-layer form runs at a lower clock (power) is the
question. Usage, from the repository root on the GPU machine:
    python3 benchmarks/experiments/gpu_clocks_during.py [--json PATH] -- <command...>
"""

import argparse
import json
import statistics
import subprocess
import sys

FIELDS = ("utilization.gpu", "clocks.sm", "power.draw")
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # the newer name, then the older


def start_sampler():
    """An nvidia-smi process printing one CSV row per 50 ms, with whichever name of the clock event reasons the driver
    takes."""
    for reasons in REASONS:
        query = ",".join(FIELDS + (reasons,))
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms",
                                     "50"], stdout=subprocess.PIPE, text=True)
    raise SystemExit(f"nvidia-smi takes neither of {REASONS}: {probe.stderr.strip()}")


def summary(lines: list[str]) -> dict:
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append((float(parts[0]), float(parts[1]), float(parts[2]), parts[3]))
        except (ValueError, IndexError):
            continue  # "[N/A]" or a partial last line
    busy = [row for row in rows if row[0] >= 90.0]
    if not busy:
        return {"samples": len(rows), "busy_samples": 0}
    clocks = [row[1] for row in busy]
    reasons: dict[str, int] = {}
    for row in busy:
        reasons[row[3]] = reasons.get(row[3], 0) + 1
    return {"samples": len(rows), "busy_samples": len(busy), "sm_clock_mhz_median": statistics.median(clocks),
            "sm_clock_mhz_min": min(clocks), "sm_clock_mhz_max": max(clocks),
            "power_w_mean": round(statistics.fmean(row[2] for row in busy), 1), "event_reasons": reasons}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sampler = start_sampler()
    rc = subprocess.call(command)
    sampler.terminate()
    out, _ = sampler.communicate()
    result = dict(summary(out.splitlines()), command=" ".join(command), rc=rc)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
