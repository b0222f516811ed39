#!/usr/bin/env python3
"""The KV-aware router against round-robin on the same trace (issue 32, part 4).

Three `pagoda serve` replicas (stories260K, one thread each, a KV pool of
--kv-tokens tokens, no store tier: hits are the pool's) behind `pagoda
router`. The trace: 8 system prompts (about 300 tokens of dev text each) x 32
users with short questions, in a random interleaved order, sent by
--clients concurrent clients as streamed completions. Per policy (prefix,
round-robin; fresh replicas and router for each, policies interleaved over
--runs): the prefix hit rate (cached / prompt tokens, from each stream's
usage) and TTFT (first streamed event, measured at the client) p50/p99; the
median over runs.

usage: bench/router_trace.py [--pagoda build/release/pagoda] [--runs 3] [--kv-tokens 1536] [--clients 6]
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import DEV, ROOT, STORIES  # noqa: E402


def trace(seed=11, n_prompts=8, n_users=32):
    words = open(DEV).read().replace("<|endoftext|>", " ").split()
    systems = [" ".join(words[i * 120:(i + 1) * 120]) for i in range(n_prompts)]
    reqs = [systems[p] + f"\nUser {u} asks: what happened next in story {p}?"
            for p in range(n_prompts) for u in range(n_users)]
    random.Random(seed).shuffle(reqs)
    return reqs


class process:
    """A pagoda subcommand that prints 'listening on http://HOST:PORT' on stdout."""

    def __init__(self, pagoda, command, args):
        self.p = subprocess.Popen([pagoda, command, "--port", "0"] + args, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        line = self.p.stdout.readline()
        if "listening on http://" not in line:
            sys.exit(f"pagoda {command} did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        self.p.wait()


def stream(port, prompt):
    """One streamed greedy completion: (TTFT s, prompt tokens, cached tokens)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, usage = None, None
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        ev = json.loads(line[6:])
        if ttft is None and ev.get("choices"):
            ttft = time.perf_counter() - t0
        if ev.get("usage"):
            usage = ev["usage"]
    c.close()
    return ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def run(pagoda, policy, reqs, a):
    replicas = [process(pagoda, "serve", ["-m", STORIES, "-t", "1", "--no-kv-store", "--admin-key", "bench",
                                          "--max-kv-tokens", str(a.kv_tokens), "--block-size", "16",
                                          "--no-access-log", "--log-stats-interval", "0"]) for _ in range(3)]
    args = ["-m", STORIES, "--admin-key", "bench", "--policy", policy, "--poll-ms", str(a.poll_ms), "--no-access-log"]
    for r in replicas:
        args += ["--replica", f"http://127.0.0.1:{r.port}"]
    router = process(pagoda, "router", args)
    try:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
            got = list(pool.map(lambda p: stream(router.port, p), reqs))
        wall = time.perf_counter() - t0
    finally:
        router.stop()
        for r in replicas:
            r.stop()
    ttfts = sorted(g[0] for g in got)
    return {"hit_rate": sum(g[2] for g in got) / sum(g[1] for g in got),
            "ttft_p50": ttfts[len(ttfts) // 2], "ttft_p99": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
            "req_per_s": len(reqs) / wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=1536)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--poll-ms", type=int, default=100)
    a = ap.parse_args()
    reqs = trace()
    policies = ["round-robin", "prefix"]
    got = {p: [] for p in policies}
    for _ in range(a.runs):
        for p in policies:
            got[p].append(run(a.pagoda, p, reqs, a))
    med = lambda p, k: statistics.median(s[k] for s in got[p])  # noqa: E731
    print(f"{len(reqs)} requests, 3 replicas, KV pool {a.kv_tokens} tokens each, {a.clients} clients, "
          f"median of {a.runs} interleaved runs\n")
    print("| policy | prefix hit rate | TTFT p50 ms | TTFT p99 ms | requests/s |")
    print("|---|---|---|---|---|")
    for p in policies:
        print(f"| {p} | {100 * med(p, 'hit_rate'):.1f}% | {1000 * med(p, 'ttft_p50'):.1f} | "
              f"{1000 * med(p, 'ttft_p99'):.1f} | {med(p, 'req_per_s'):.1f} |")
    rr, px = "round-robin", "prefix"
    print(f"\nprefix / round-robin: TTFT p50 {med(px, 'ttft_p50') / med(rr, 'ttft_p50'):.2f}x, "
          f"p99 {med(px, 'ttft_p99') / med(rr, 'ttft_p99'):.2f}x, throughput "
          f"{med(px, 'req_per_s') / med(rr, 'req_per_s'):.2f}x")


if __name__ == "__main__":
    main()
