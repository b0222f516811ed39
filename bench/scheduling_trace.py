#!/usr/bin/env python3
"""Scheduling and prefix-cache eviction on a multi-tenant trace (issue 32).

The trace: 8 system prompts (about 300 tokens of dev text each) x 64 users
with short questions, arriving interleaved in a random order, plus one-off
long documents (about 600 tokens) among them, all queued at once through
`pagoda batch` on stories260K under memory pressure (a small KV pool, so
cached prefixes are evicted). For each scheduling policy (fcfs,
cache-aware) and prefix-cache eviction (lru, lfu): prefix hit rate, prompt
tokens computed, throughput and TTFT; the median of interleaved runs.

usage: bench/scheduling_trace.py [--pagoda build/release/pagoda] [--runs 3] [--kv-tokens 4096]
                                 [--docs 32] [--only fcfs+lru,cache-aware+lfu,...]
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
    ap.add_argument("--docs", type=int, default=32, help="one-off long documents among the 512 user requests")
    ap.add_argument("--only", default="fcfs+lru,cache-aware+lru,cache-aware+lfu,fcfs+lfu",
                    help="comma-separated SCHEDULING+EVICTION configurations, the first the baseline")
    a = ap.parse_args()
    lines = trace(n_docs=a.docs)
    common = ["-t", "1", "--ctx", "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
              "--max-kv-tokens", str(a.kv_tokens), "--kv-cache-dtype", "f32",
              "--max-passed-steps", str(a.max_passed_steps)]
    configs = a.only.split(",")
    got = {c: [] for c in configs}
    for _ in range(a.runs):
        for c in configs:
            sched, evict = c.split("+")
            got[c].append(batch(a.pagoda, STORIES, lines,
                                common + ["--scheduling-policy", sched, "--prefix-cache-eviction", evict]))
    med = lambda c, k: statistics.median(s[k] for s in got[c])  # noqa: E731
    print(f"{len(lines)} requests, KV pool {a.kv_tokens} tokens, median of {a.runs} interleaved runs\n")
    print("| scheduling + eviction | prefix hit rate | prompt tokens computed | total tok/s | TTFT p50 ms | "
          "TTFT p99 ms | evictions | preemptions | vs " + configs[0] + ": prompt tokens | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = configs[0]
    for c in configs:
        print(f"| {c} | {100 * med(c, 'prefix_hit_rate'):.1f}% | {med(c, 'computed_prompt_tokens'):.0f} | "
              f"{med(c, 'total_tokens_per_s'):.0f} | {1000 * med(c, 'ttft_p50_s'):.1f} | {1000 * med(c, 'ttft_p99_s'):.1f} | "
              f"{med(c, 'evictions'):.0f} | {med(c, 'preemptions'):.0f} | "
              f"{med(c, 'computed_prompt_tokens') / med(base, 'computed_prompt_tokens'):.2f}x | "
              f"{med(c, 'total_tokens_per_s') / med(base, 'total_tokens_per_s'):.2f}x |")


if __name__ == "__main__":
    main()
