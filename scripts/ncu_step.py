#!/usr/bin/env python3
"""Where a profiled decode step's time goes: an Nsight Compute CSV summed per kernel.

Input: the CSV that `ncu --csv --log-file FILE --metrics
gpu__time_duration.sum,dram__bytes_read.sum` writes (one row per kernel and metric), for
example of `graft-candle-ports --profile-steps N` under `ncu --profile-from-start off` (only
the replayed steps' kernels are profiled). --skip and --take pick a range of the profiled
kernels in launch order (one model and batch of several profiled ranges); --steps divides
the totals into per-step figures.

Prints, per kernel name (templates and arguments cut off), the launches per step, the time
per step, its share, the DRAM bytes read per step and the bandwidth they were read at; then
the totals.

Example: python3 scripts/ncu_step.py ncu.csv --skip 0 --take 846 --steps 3
"""

import argparse
import csv
import re
from collections import OrderedDict


def kernels(path):
    """Kernel launches in order: (name, {metric: value}) per ncu ID."""
    by_id = OrderedDict()
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not CSV
    for row in csv.DictReader(lines):
        k = by_id.setdefault(row["ID"], {"name": row["Kernel Name"], "metrics": {}})
        value = row["Metric Value"].replace(",", "")
        unit = row["Metric Unit"]
        try:
            v = float(value)
        except ValueError:
            continue
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "byte": 1.0,
                 "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1.0)
        k["metrics"][row["Metric Name"]] = v * scale
    return list(by_id.values())


def short(name):
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--skip", type=int, default=0, help="profiled kernels to skip first")
    p.add_argument("--take", type=int, default=None, help="profiled kernels to sum")
    p.add_argument("--steps", type=int, default=1, help="steps the kernels span")
    a = p.parse_args()
    ks = kernels(a.csv)
    end = None if a.take is None else a.skip + a.take
    ks = ks[a.skip:end]
    rows = OrderedDict()
    for k in ks:
        r = rows.setdefault(short(k["name"]), [0, 0.0, 0.0])
        r[0] += 1
        r[1] += k["metrics"].get("gpu__time_duration.sum", 0.0)
        r[2] += k["metrics"].get("dram__bytes_read.sum", 0.0)
    total_us = sum(r[1] for r in rows.values())
    total_b = sum(r[2] for r in rows.values())
    print(f"{len(ks)} kernels over {a.steps} steps: {len(ks) / a.steps:.0f} per step")
    print(f"{'kernel':<48} {'per step':>8} {'us/step':>9} {'share':>6} {'MB/step':>9} {'GB/s':>7}")
    for name, (n, us, b) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        gbs = b / (us * 1e-6) / 1e9 if us else 0.0
        print(f"{name[:48]:<48} {n / a.steps:8.1f} {us / a.steps:9.1f} {us / total_us:6.1%} "
              f"{b / a.steps / 1e6:9.2f} {gbs:7.0f}")
    gbs = total_b / (total_us * 1e-6) / 1e9 if total_us else 0.0
    print(f"{'total':<48} {len(ks) / a.steps:8.1f} {total_us / a.steps:9.1f} {1:6.1%} "
          f"{total_b / a.steps / 1e6:9.2f} {gbs:7.0f}")


if __name__ == "__main__":
    main()
