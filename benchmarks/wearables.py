"""Wearables (WBM) benchmark: the SSD scan and the full model at a week (168 h) and a year (8,760 h)
of hours against the Transformer backbone and a sequential recurrence, and the Apple Health
reader's throughput and peak memory on generated exports of two sizes.

    python benchmarks/wearables.py                  # everything; exports of 200 MB and 1 GB
    python benchmarks/wearables.py --skip-models --export-mb 200 --engines fast expat
    python benchmarks/wearables.py --skip-parser    # model figures only

Exports are generated in a temporary folder at run time (never committed) and deleted after.
Peak memory is each parse's maximum resident set size in a fresh subprocess, reported as the
increment over that process after its imports (parser_rss_mb) and in total.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _time(fn, repeat: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_scan(lengths=(168, 8760), batch=1, heads=8, headdim=64, d_state=64, chunk=64) -> list[dict]:
    """Chunked SSD scan vs the step-by-step recurrence (float32, wbm-base's mixer sizes)."""
    from domainfm.models.wearables.mamba2 import ssd_scan, ssd_sequential

    rows = []
    g = torch.Generator().manual_seed(0)
    for length in lengths:
        X = torch.randn(batch, length, heads, headdim, generator=g)
        A = -torch.rand(batch, length, heads, generator=g) * 0.1
        B = torch.randn(batch, length, 1, d_state, generator=g)
        C = torch.randn(batch, length, 1, d_state, generator=g)
        with torch.no_grad():
            chunked = _time(lambda: ssd_scan(X, A, B, C, chunk))
            sequential = _time(lambda: ssd_sequential(X, A, B, C), repeat=1)
            err = (ssd_scan(X, A, B, C, chunk)[0] - ssd_sequential(X, A, B, C)[0]).abs().max().item()
        rows.append({"length": length, "chunked_s": round(chunked, 4), "sequential_s": round(sequential, 4),
                     "speedup": round(sequential / chunked, 1), "max_abs_diff_fp32": err})
    return rows


def bench_models(lengths=(168, 1752, 8760), batch=1) -> list[dict]:
    """Forward (inference) time of wbm-base (Mamba-2) and wbm-transformer-base at each length."""
    import domainfm

    rows = []
    models = {n: domainfm.create_model(n).eval() for n in ("wbm-base", "wbm-transformer-base")}
    g = torch.Generator().manual_seed(0)
    for length in lengths:
        values = torch.randn(batch, length, 22, generator=g)
        observed = torch.rand(batch, length, 22, generator=g) > 0.4
        row = {"hours": length}
        for name, model in models.items():
            with torch.no_grad():
                row[f"{name}_s"] = round(_time(lambda m=model: m(values, observed), repeat=3 if length <= 168 else 1), 4)
        row["transformer/mamba"] = round(row["wbm-transformer-base_s"] / row["wbm-base_s"], 2)
        rows.append(row)
    base = rows[0]
    for row in rows:
        scale = row["hours"] / base["hours"]
        row["mamba_cost_per_hour_vs_168"] = round(row["wbm-base_s"] / base["wbm-base_s"] / scale, 2)
        row["transformer_cost_per_hour_vs_168"] = round(row["wbm-transformer-base_s"] / base["wbm-transformer-base_s"]
                                                        / scale, 2)
    return rows


_HEADER = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE HealthData [
<!ELEMENT HealthData (ExportDate,Me,(Record|Workout|ActivitySummary)*)>
<!ATTLIST HealthData locale CDATA #REQUIRED>
<!ELEMENT Record ((MetadataEntry|HeartRateVariabilityMetadataList)*)>
<!ATTLIST Record type CDATA #REQUIRED unit CDATA #IMPLIED value CDATA #IMPLIED sourceName CDATA #REQUIRED
  sourceVersion CDATA #IMPLIED device CDATA #IMPLIED creationDate CDATA #IMPLIED startDate CDATA #REQUIRED
  endDate CDATA #REQUIRED>
<!ELEMENT MetadataEntry EMPTY>
<!ATTLIST MetadataEntry key CDATA #REQUIRED value CDATA #REQUIRED>
]>
<HealthData locale="en_GB">
 <ExportDate value="2025-01-01 09:00:00 +0000"/>
 <Me HKCharacteristicTypeIdentifierDateOfBirth="1980-01-01" HKCharacteristicTypeIdentifierBiologicalSex="HKBiologicalSexFemale"/>
"""
_DEVICE = ('&lt;&lt;HKDevice: 0x600003a4c0a0&gt;, name:Apple Watch, manufacturer:Apple Inc., model:Watch, '
           'hardware:Watch6,1, software:10.1&gt;')


def generate_export(path: Path, megabytes: float) -> int:
    """Write a realistic export of about ``megabytes`` MB (heart-rate samples every ~5 min with
    metadata, step and energy intervals from the Watch and the iPhone, sleep stages, mixed
    offsets); returns the number of records."""
    import random

    rng = random.Random(0)
    target = int(megabytes * 1e6)
    written = 0
    records = 0
    t = 1_577_836_800  # 2020-01-01 UTC
    with open(path, "w", encoding="utf-8") as f:
        f.write(_HEADER)
        while written < target:
            lines = []
            for _ in range(2000):
                t += rng.randint(60, 400)
                offset = 3600 if (t // 86400) % 365 > 90 else 0  # a DST-like offset change
                off = f"+0{offset // 3600}00"

                def stamp(s):
                    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s + offset)) + " " + off

                s, e = stamp(t), stamp(t + rng.randint(30, 600))
                kind = rng.random()
                if kind < 0.45:
                    lines.append(f' <Record type="HKQuantityTypeIdentifierHeartRate" sourceName="Apple Watch" '
                                 f'sourceVersion="10.1" device="{_DEVICE}" unit="count/min" creationDate="{s}" '
                                 f'startDate="{s}" endDate="{s}" value="{rng.randint(50, 150)}">\n'
                                 f'  <MetadataEntry key="HKMetadataKeyHeartRateMotionContext" value="0"/>\n </Record>\n')
                elif kind < 0.8:
                    src = "Apple Watch" if rng.random() < 0.5 else "iPhone"
                    lines.append(f' <Record type="HKQuantityTypeIdentifierStepCount" sourceName="{src}" '
                                 f'sourceVersion="17.1" unit="count" creationDate="{e}" startDate="{s}" endDate="{e}" '
                                 f'value="{rng.randint(0, 900)}"/>\n')
                elif kind < 0.95:
                    lines.append(f' <Record type="HKQuantityTypeIdentifierActiveEnergyBurned" sourceName="Apple Watch" '
                                 f'sourceVersion="10.1" device="{_DEVICE}" unit="kJ" creationDate="{e}" startDate="{s}" '
                                 f'endDate="{e}" value="{rng.uniform(0, 40):.3f}"/>\n')
                else:
                    stage = rng.choice(["AsleepCore", "AsleepDeep", "AsleepREM", "Awake", "InBed"])
                    lines.append(f' <Record type="HKCategoryTypeIdentifierSleepAnalysis" sourceName="Apple Watch" '
                                 f'sourceVersion="10.1" creationDate="{e}" startDate="{s}" endDate="{e}" '
                                 f'value="HKCategoryValueSleepAnalysis{stage}"/>\n')
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk)
            records += len(lines)
        f.write("</HealthData>\n")
    return records


_PARSE = """
import json, resource, sys, time
from domainfm.data_loaders.wearables import read_healthkit  # imports the package (and torch)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
start, cpu = time.perf_counter(), time.process_time()
table, stats = read_healthkit(sys.argv[1], return_stats=True, engine=sys.argv[2])
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({**stats, "seconds": elapsed, "cpu_seconds": cpu, "peak_rss_mb": rss, "import_rss_mb": base,
                  "hours": len(table)}))
"""


def bench_parser(sizes_mb, engines=("fast",), folder: str | None = None) -> list[dict]:
    """Each engine on a generated export of each size, each parse in a fresh subprocess: wall and CPU
    records/s, and peak RSS as the increment over the process after its imports (torch included)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="wbm_export_", dir=folder) as tmp:
        for size in sizes_mb:
            path = Path(tmp) / f"export_{int(size)}mb.xml"
            generate_export(path, size)
            for engine in engines:
                out = subprocess.run([sys.executable, "-c", _PARSE, str(path), engine], check=True,
                                     capture_output=True, text=True)
                stats = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append({"engine": stats["engine"], "file_mb": round(stats["bytes"] / 1e6, 1),
                             "records": stats["records"], "seconds": round(stats["seconds"], 2),
                             "cpu_seconds": round(stats["cpu_seconds"], 2),
                             "records_per_s": int(stats["records"] / stats["seconds"]),
                             "records_per_cpu_s": int(stats["records"] / stats["cpu_seconds"]),
                             "mb_per_s": round(stats["bytes"] / 1e6 / stats["seconds"], 1),
                             "parser_rss_mb": round(stats["peak_rss_mb"] - stats["import_rss_mb"], 1),
                             "peak_rss_mb": round(stats["peak_rss_mb"], 1), "hours": stats["hours"]})
                print("read_healthkit", rows[-1], flush=True)
            path.unlink()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export-mb", type=float, nargs="+", default=[200.0, 1000.0],
                        help="sizes of the generated exports (default: 200 MB and 1 GB)")
    parser.add_argument("--engines", nargs="+", default=["fast"], help="read_healthkit engines: fast, expat")
    parser.add_argument("--tmp", default=None, help="folder for the generated exports (default: the system's)")
    parser.add_argument("--skip-parser", action="store_true")
    parser.add_argument("--skip-models", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    results = {}
    if not args.skip_models:
        results["ssd_scan"] = bench_scan()
        for row in results["ssd_scan"]:
            print("ssd_scan", row)
        results["models"] = bench_models()
        for row in results["models"]:
            print("model", row)
    if not args.skip_parser:
        results["read_healthkit"] = bench_parser(args.export_mb, args.engines, args.tmp)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
