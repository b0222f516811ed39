#!/usr/bin/env python3
"""Decode attention cost per KV format relative to f16: the speed profile
`pagoda plan` reads (docs/plan.md).

Runs attention_bench's decode benchmark (bench/micro/attention_bench.cpp: one
query token of 32 heads, GQA 4, head_dim 128, over CTX cached tokens of one
layer, blocks of 16, a fresh pool) for every format it registers, in one run,
and writes each format's median decode step time (1 / its steps/s
counter, the median over --repetitions runs) over f16's, keyed by the layout
name plan and `pagoda info` print (the benchmark's label, e.g.
"int8/token+int8/token").

    python3 bench/attention_profile.py --bench build/release/bench/attention_bench \
        -o profiles/attention_speed.json [--ctx 4096] [--threads 1]
"""
import argparse
import datetime
import json
import os
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, help="the attention_bench binary")
    ap.add_argument("-o", "--output", required=True, help="the speed profile to write")
    ap.add_argument("--ctx", type=int, default=4096, choices=[1024, 4096, 16384, 32768])
    ap.add_argument("--threads", type=int, default=1, choices=[1, 2])
    ap.add_argument("--min-time", default="0.3", help="seconds per benchmark (--benchmark_min_time)")
    ap.add_argument("--repetitions", type=int, default=5, help="runs of each; their median is kept")
    args = ap.parse_args()
    filt = f"^decode/.*/ctx:{args.ctx}/threads:{args.threads}/shuffled:0/manual_time$"
    cmd = [args.bench, f"--benchmark_filter={filt}", "--benchmark_format=json",
           f"--benchmark_min_time={args.min_time}", f"--benchmark_repetitions={args.repetitions}",
           "--benchmark_report_aggregates_only=true"]
    print("attention_profile: " + " ".join(cmd), file=sys.stderr)
    load_before = os.getloadavg()[0]
    run = subprocess.run(cmd, check=True, capture_output=True, text=True)
    load_after = os.getloadavg()[0]
    doc = json.loads(run.stdout)
    times = {}
    simd_level = ""
    for b in doc["benchmarks"]:
        # The median of the repetitions' steps/s: each run's median decode step (the benchmark's own
        # figure; its reported time also holds the bandwidth passes between steps).
        if b.get("aggregate_name") != "median" or "label" not in b or "steps/s" not in b:
            continue
        layout, _, simd = b["label"].partition(" simd ")  # "int8/token+int8/token simd avx512"
        times[layout] = 1e6 / b["steps/s"]
        simd_level = simd
    f16 = times.get("f16+f16")
    if not f16:
        sys.exit("attention_profile: no f16 run in the benchmark's output")
    profile = {
        "pagoda_profile": 1,
        "speed_source": {
            "benchmark": "bench/micro/attention_bench.cpp decode",
            "command": " ".join(cmd),
            "shape": f"32 query heads, 8 KV heads, head_dim 128, block 16, ctx {args.ctx}, "
                     f"{args.threads} thread(s), fresh pool",
            "simd": simd_level,
            "date": datetime.date.today().isoformat(),
            "host": doc.get("context", {}).get("host_name", ""),
            # A shared machine: other work moves the ratios (see docs/plan.md).
            "load_average": [round(load_before, 2), round(load_after, 2)],
        },
        "speed": [{"kv": k, "decode_attention_vs_f16": round(t / f16, 3), "step_us": round(t, 3)}
                  for k, t in sorted(times.items(), key=lambda kv: kv[1])],
    }
    with open(args.output, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    print(f"attention_profile: wrote {args.output} ({len(times)} formats)", file=sys.stderr)


if __name__ == "__main__":
    main()
