#!/usr/bin/env python3
"""Side memory against the KV pool (issue 29): a `pagoda serve` with
--kv-policy retrieval and a small pool, N concurrent completions; reports the
most side memory (retrieval indexes) /metrics showed against the pool's bytes,
and the server's peak RSS. A benchmark: it reports, it asserts nothing.

  bench/side_memory.py BINARY [--pool-mib 8] [--clients 8] [--prompt-reps 20] [--max-tokens 64]
"""
import argparse, json, os, subprocess, sys, threading, time, urllib.request

def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()

def metrics(port):
    out = {}
    for line in get(f"http://127.0.0.1:{port}/metrics").splitlines():
        if not line or line.startswith("#"): continue
        name, _, value = line.rpartition(" ")
        name = name.replace('model_name="stories260K",', "").replace('{model_name="stories260K"}', "")
        out[name.split("{model_name")[0] if "{model_name" in name else name] = float(value)
    return out

def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"): return int(line.split()[1]) * 1024
    return 0

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--pool-mib", type=float, default=8)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-reps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18429)
    a = ap.parse_args()
    model = os.path.join(os.path.dirname(__file__), "..", "models", "stories260K.gguf")
    srv = subprocess.Popen([a.binary, "serve", "-m", model, "--ctx", "512", "--threads", "1", "--kv-cache-dtype", "f32",
                            "--no-kv-store", "--no-auth", "--port", str(a.port), "--kv-policy", "retrieval",
                            "--kv-cache-size", str(a.pool_mib), "--log-stats-interval", "0"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                get(f"http://127.0.0.1:{a.port}/health"); break
            except Exception: time.sleep(0.05)
        m0 = metrics(a.port)
        block_bytes = a.pool_mib * 2**20 / max(m0["pagoda:kv_cache_num_blocks"], 1)
        pool_bytes = m0["pagoda:kv_cache_num_blocks"] * block_bytes
        idle_rss = rss(srv.pid)
        codes = []
        def client(i):
            body = json.dumps({"prompt": f"{i} " + "Once upon a time there was a girl. " * a.prompt_reps,
                               "max_tokens": a.max_tokens, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{a.port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r: codes.append(r.status)
            except urllib.error.HTTPError as e: codes.append(e.code)
        t0 = time.time()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for t in threads: t.start()
        peak_sel = peak_side = peak_rss = peak_kv_side = 0.0
        while any(t.is_alive() for t in threads):
            m = metrics(a.port)
            peak_sel = max(peak_sel, m.get("pagoda:kv_selector_memory_bytes", 0))
            peak_side = max(peak_side, m.get("pagoda:kv_side_blocks", 0))
            used = m['pagoda:kv_cache_blocks{state="used"}']
            kv_only = used - m.get("pagoda:kv_side_blocks", 0)
            peak_kv_side = max(peak_kv_side, kv_only * block_bytes + m.get("pagoda:kv_selector_memory_bytes", 0))
            peak_rss = max(peak_rss, rss(srv.pid))
            time.sleep(0.01)
        wall = time.time() - t0
        print(json.dumps({"binary": a.binary, "pool_mib": a.pool_mib, "pool_blocks": m0["pagoda:kv_cache_num_blocks"],
                          "clients": a.clients, "codes": sorted(codes), "wall_s": round(wall, 2),
                          "peak_index_mib": round(peak_sel / 2**20, 2),
                          "peak_index_over_pool": round(peak_sel / pool_bytes, 3),
                          "peak_kv_plus_index_over_pool": round(peak_kv_side / pool_bytes, 3),
                          "peak_side_blocks": peak_side,
                          "idle_rss_mib": round(idle_rss / 2**20, 1), "peak_rss_mib": round(peak_rss / 2**20, 1)}))
    finally:
        srv.terminate(); srv.wait()

if __name__ == "__main__":
    main()
