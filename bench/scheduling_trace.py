#!/usr/bin/env python3
"""Cache-aware scheduling against FCFS on a multi-tenant trace (issue 32).

The trace: 8 system prompts (about 300 tokens of dev text each) x 64 users
with short questions, arriving interleaved in a random order, plus one-off
long documents (about 600 tokens) among them, all queued at once through
`pagoda batch` on stories260K under memory pressure (a small KV pool, so
cached prefixes are evicted). For each scheduling policy: prefix hit rate,
prompt tokens computed, throughput and TTFT; the median of interleaved runs.

usage: bench/scheduling_trace.py [--pagoda build/release/pagoda] [--runs 3] [--kv-tokens 4096]
"""
import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import DEV, ROOT, STORIES, batch  # noqa: E402


def trace(seed=7, n_prompts=8, n_users=64, n_docs=32):
    words = open(DEV).read().split()
    systems = [" ".join(words[i * 120:(i + 1) * 120]) for i in range(n_prompts)]
    lines = []
    for p in range(n_prompts):
        for u in range(n_users):
            lines.append({"id": f"p{p}u{u}", "prompt": systems[p] + f"\nUser {u} asks: what happened next in story {p}?",
                          "max_tokens": 16, "temperature": 0})
    base = n_prompts * 120
    for d in range(n_docs):
        doc = " ".join(words[base + d * 240:base + (d + 1) * 240])
        lines.append({"id": f"doc{d}", "prompt": doc + "\nSummary:", "max_tokens": 16, "temperature": 0})
    random.Random(seed).shuffle(lines)
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--max-passed-steps", type=int, default=16)
    a = ap.parse_args()
    lines = trace()
    common = ["-t", "1", "--ctx", "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
              "--max-kv-tokens", str(a.kv_tokens), "--kv-cache-dtype", "f32",
              "--max-passed-steps", str(a.max_passed_steps)]
    policies = ["fcfs", "cache-aware"]
    got = {p: [] for p in policies}
    for _ in range(a.runs):
        for p in policies:
            got[p].append(batch(a.pagoda, STORIES, lines, common + ["--scheduling-policy", p]))
    med = lambda p, k: statistics.median(s[k] for s in got[p])  # noqa: E731
    print(f"{len(lines)} requests, KV pool {a.kv_tokens} tokens, median of {a.runs} interleaved runs\n")
    print("| policy | prefix hit rate | prompt tokens computed | total tok/s | TTFT p50 ms | TTFT p99 ms | evictions |")
    print("|---|---|---|---|---|---|---|")
    for p in policies:
        print(f"| {p} | {100 * med(p, 'prefix_hit_rate'):.1f}% | {med(p, 'computed_prompt_tokens'):.0f} | "
              f"{med(p, 'total_tokens_per_s'):.0f} | {1000 * med(p, 'ttft_p50_s'):.1f} | {1000 * med(p, 'ttft_p99_s'):.1f} | "
              f"{med(p, 'evictions'):.0f} |")
    f, c = med("fcfs", "total_tokens_per_s"), med("cache-aware", "total_tokens_per_s")
    print(f"\ncache-aware / fcfs throughput: {c / f:.2f}x; prompt tokens computed: "
          f"{med('cache-aware', 'computed_prompt_tokens') / med('fcfs', 'computed_prompt_tokens'):.2f}x")


if __name__ == "__main__":
    main()
