#!/usr/bin/env python3
"""Time to first token by where a prompt's KV comes from (bench/RESULTS.md,
"KV warehouse"): a cold miss (computed), a hit in the pool (memory), a hit on
disk after a restart (page cache dropped where the machine allows), and a hit
in Redis on a replica that never saw the prompt.

Per prompt length and round: a fresh random prompt of token ids; server A
(disk + Redis tiers) computes it (cold) and serves it again (memory); A is
stopped (its write-back drains), the page cache is dropped, A restarts and
serves it from disk; replica B (Redis only) serves it from Redis. Every
measured request is preceded, on the same server process, by a short request
of its own prompt, so that the model's weights are paged in for all of them
alike. A request is `max_tokens` 1, greedy; its usage says where the cached
tokens came from, and the script checks it is the tier being measured.
Each server runs with the same thread count; the model is a synth
Llama-3-8B (2 layers, q8_0, vocab 512) with an f16 KV cache unless told.

Also: the disk's sequential read bandwidth (dd of the store's data file with
a cold page cache) against the bandwidth of the disk loads (KV bytes loaded /
(disk-hit TTFT - memory-hit TTFT)).

usage: bench/kv_store_ttft.py [--pagoda build/release/pagoda] [--lengths 2048,8192] [--rounds 3] [--threads 2]
"""
import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def drop_page_cache():
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class server:
    def __init__(self, pagoda, args):
        self.p = subprocess.Popen([pagoda, "serve", "--port", "0"] + args, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        line = self.p.stdout.readline()
        if "listening on http://" not in line:
            sys.exit(f"pagoda serve did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])

    def complete(self, ids, max_tokens=1):
        body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return time.perf_counter() - t0, out

    def stop(self):
        self.p.send_signal(signal.SIGTERM)  # graceful: the write-back queue drains
        self.p.wait()


def by_tier(out):
    d = out["usage"]["prompt_tokens_details"]
    return d.get("cached_tokens_by_tier", {}), d["cached_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="f16")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    work = tempfile.mkdtemp(prefix="pagoda_kvttft_")
    model = os.path.join(work, "synth.gguf")
    subprocess.run([args.pagoda, "synth", "--preset", "llama3-8b", "--layers", str(args.layers), "--weight-type",
                    "q8_0", "--vocab", "512", "--ctx", str(2 * max(lengths)), "-o", model], check=True,
                   stdout=subprocess.DEVNULL)
    rport = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lfu"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    disk = os.path.join(work, "kv")
    common = ["-m", model, "-t", str(args.threads), "--ctx", str(2 * max(lengths)), "--kv-cache-dtype",
              args.kv_cache_dtype, "--max-num-seqs", "4", "--max-kv-tokens", str(4 * max(lengths))]
    a_args = common + ["--kv-store", disk, "--kv-store-remote", f"redis://127.0.0.1:{rport}"]
    b_args = common + ["--no-kv-store", "--kv-store-remote", f"redis://127.0.0.1:{rport}"]
    dropped = True
    results = {}
    rng = random.Random(7)

    def warmup(s):
        s.complete([rng.randrange(3, 512) for _ in range(32)])

    def timed(s, ids, tier):
        """TTFT of ids on s; checks that its cached tokens came from `tier` (None: nothing cached)."""
        t, out = s.complete(ids)
        tiers, cached = by_tier(out)
        if tier is None:
            assert cached == 0, out["usage"]
        else:
            assert tiers.get(tier, 0) == cached > 0, out["usage"]
        return t

    try:
        for n in lengths:
            rows = {"cold": [], "memory": [], "disk": [], "redis": []}
            for r in range(args.rounds):
                ids = [rng.randrange(3, 512) for _ in range(n)]
                a = server(args.pagoda, a_args)
                warmup(a)
                rows["cold"].append(timed(a, ids, None))
                rows["memory"].append(timed(a, ids, "memory"))
                a.stop()
                dropped = drop_page_cache() and dropped
                for tier, srv_args in (("disk", a_args), ("redis", b_args)):
                    s = server(args.pagoda, srv_args)
                    warmup(s)
                    rows[tier].append(timed(s, ids, tier))
                    s.stop()
                print(f"  {n} tokens, round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in rows.items()),
                      file=sys.stderr)
            results[n] = {k: statistics.median(v) for k, v in rows.items()}

        # The disk: its sequential read bandwidth with a cold page cache.
        data = os.path.join(disk, "data.mdb")
        size = os.path.getsize(data)
        drop_page_cache()
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={data}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
        disk_gbps = size / (time.perf_counter() - t0) / 1e9
    finally:
        redis.terminate()
        redis.wait()
        shutil.rmtree(work, ignore_errors=True)

    kv_bytes_per_token = args.layers * 2 * 8 * 128 * (2 if args.kv_cache_dtype == "f16" else 4)
    print(f"synth llama3-8b {args.layers} layers q8_0, KV {args.kv_cache_dtype} ({kv_bytes_per_token} bytes/token), "
          f"{args.threads} threads, medians of {args.rounds} rounds; page cache "
          f"{'dropped before each disk hit' if dropped else 'NOT dropped (no permission)'}\n")
    print("| prompt tokens | cold miss | memory hit | disk hit | Redis hit | memory/miss | disk/miss | Redis/miss |")
    print("|---|---|---|---|---|---|---|---|")
    for n, m in results.items():
        c = m["cold"]
        print(f"| {n} | {c:.3f} s | {m['memory']:.3f} s | {m['disk']:.3f} s | {m['redis']:.3f} s | "
              f"{m['memory'] / c:.3f} | {m['disk'] / c:.3f} | {m['redis'] / c:.3f} |")
    print()
    for n, m in results.items():
        load_s = max(m["disk"] - m["memory"], 1e-9)
        print(f"- {n} tokens: disk loads {n * kv_bytes_per_token / 1e6:.1f} MB of KV in about {load_s:.3f} s beyond "
              f"a memory hit: {n * kv_bytes_per_token / load_s / 1e9:.2f} GB/s, against the disk's "
              f"{disk_gbps:.2f} GB/s sequential read ({n * kv_bytes_per_token / load_s / 1e9 / disk_gbps:.0%})")


if __name__ == "__main__":
    main()
