#!/usr/bin/env python3
"""Decode at a deep context against llama.cpp, in the same rounds: Pagoda's
whole decode step (`decode_bench`: every layer's matmuls, the KV write,
attention over `--depth` cached tokens, the logits) per KV configuration,
against llama.cpp's `llama-bench -d DEPTH -n N -p 0` with f16 KV, flash
attention off and on (its best of the two per round is the reference).

Each round measures the machine's read bandwidth (matmul_bench), then every
configuration once, in the same order; ratios are the median of each round's
ratio. The bandwidth limit of a configuration is read bandwidth / bytes a
decode step reads (the weights once, plus the KV it reads: all of it, or 1/8
for quest 1/8, whose key bounds are not counted), so "of limit" says how close
a step comes to memory speed.

Pagoda's cache is filled with random K/V (decode_bench), llama.cpp's by a real
prefill of DEPTH tokens: neither changes what a decode step of a random-weight
model costs. With "+quest" the random keys make Quest pick scattered blocks,
the worst case for locality.

usage:
  pagoda synth --preset llama3-8b --layers 2 --ffn 4096 --weight-type q8_0 --vocab 512 --ctx 135168 -o /tmp/l3-2l-ffn4k-q8.gguf
  bench/long_context.py --decode-bench build/release/bench/decode_bench --model /tmp/l3-2l-ffn4k-q8.gguf
      --llama-bench /path/to/llama-bench [--bandwidth build/release/bench/matmul_bench]
      [--threads 1,2] [--rounds 3] [--depth 32768] [--n-gen 32] [--configs f16,int4/token,f16+quest] [--no-mmap]

--no-mmap: both read the weights into memory instead of mapping the file
(Pagoda's --no-mmap, in huge pages where the kernel gives them; llama-bench
-mmp 0), so that neither depends on the page cache's folio sizes.

llama.cpp is not part of this project: bring your own build (for this CPU:
cmake -DGGML_NATIVE=ON).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_speed import bandwidth, decode_bytes, load_average, sh  # noqa: E402


def llama_tg(llama, model, threads, depth, n_gen, no_mmap):
    """{(threads, "off" | "on"): tok/s}: one llama-bench run per round over every thread count and flash
    attention off and on; it fills the DEPTH-token cache once and restores it for the other tests."""
    args = [llama, "-m", model, "-p", "0", "-n", str(n_gen), "-d", str(depth), "-t", ",".join(map(str, threads)),
            "-r", "1", "-fa", "off,on", "-ctk", "f16", "-ctv", "f16", "-mmp", "0" if no_mmap else "1", "-o", "json"]
    out = {}
    for t in json.loads(sh(args).stdout):
        if t["n_gen"]:
            fa = t.get("flash_attn")
            out[(t["n_threads"], "on" if fa in (True, 1, "on", "enabled") else "off")] = t["avg_ts"]
    return out


def pagoda_tg(bench, model, cfg, threads, depth, no_mmap):
    """decode_bench's tokens/s and the KV MiB of the configuration (all of the cache)."""
    flt = f"^decode_step/{re.escape(cfg)}/ctx:{depth}/threads:{threads}/"
    r = subprocess.run([bench, f"--benchmark_filter={flt}", "--benchmark_format=json"] + (["--no_mmap"] if no_mmap else []),
                       capture_output=True, text=True,
                       env=dict(os.environ, PAGODA_DECODE_MODEL=model))
    if r.returncode != 0:
        sys.exit(f"decode_bench failed for {cfg}:\n{r.stderr}")
    runs = json.loads(r.stdout)["benchmarks"]
    if not runs or runs[0].get("error_occurred"):
        sys.exit(f"decode_bench ran nothing for {flt}: {runs[0].get('error_message') if runs else ''}")
    return runs[0]["tokens/s"], runs[0]["KV_MiB"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-bench", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--bandwidth", help="matmul_bench binary: the read bandwidth of each round")
    ap.add_argument("--threads", default="2,1", help="llama-bench fills the cache with the first thread count")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depth", type=int, default=32768)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--configs", default="f16,int4/token,f16+quest")
    ap.add_argument("--no-mmap", action="store_true", help="both read the weights into memory (see above)")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    configs = a.configs.split(",")
    weights = decode_bytes(a.model)

    res = {}  # (what, threads) -> [per round]
    kv_mib = {}
    bw = {t: [] for t in threads}
    loads = [load_average()]
    t0 = time.time()
    for rnd in range(a.rounds):
        for (t, fa), v in sorted(llama_tg(a.llama_bench, a.model, threads, a.depth, a.n_gen, a.no_mmap).items()):
            res.setdefault((f"llama.cpp fa {fa}", t), []).append(v)
            print(f"llama.cpp, {t} thread(s), FA {fa}: {v:.2f} tok/s", file=sys.stderr, flush=True)
        for t in threads:
            v = bandwidth(a.bandwidth, t)
            if v:
                bw[t].append(v)
            for cfg in configs:
                tg, mib = pagoda_tg(a.decode_bench, a.model, cfg, t, a.depth, a.no_mmap)
                res.setdefault((cfg, t), []).append(tg)
                print(f"pagoda {cfg}, {t} thread(s): {tg:.2f} tok/s", file=sys.stderr, flush=True)
                kv_mib[cfg] = mib
        loads.append(load_average())
        print(f"round {rnd + 1}/{a.rounds} done, {time.time() - t0:.0f} s, load {loads[-1]:.1f}", file=sys.stderr)

    print(f"depth {a.depth}, {a.n_gen} decode tokens (llama-bench), rounds: {a.rounds}, weights "
          f"{'read into memory (--no-mmap)' if a.no_mmap else 'mapped'}; load average at the start and "
          "after each round: " + ", ".join(f"{x:.1f}" for x in loads))
    print(f"weights read per decode step: {weights / 1e6:.1f} MB")
    for t in threads:
        if bw[t]:
            print(f"read bandwidth, {t} thread(s): " + ", ".join(f"{x:.1f}" for x in bw[t]) +
                  f" GB/s (median {statistics.median(bw[t]):.1f})")
    print()
    print("| threads | configuration | tok/s | vs llama.cpp's best (median of rounds) | MB read per token | "
          "GB/s | of limit | limit / llama.cpp |")
    print("|---|---|---|---|---|---|---|---|")
    for t in threads:
        best = [max(x, y) for x, y in zip(res[("llama.cpp fa off", t)], res[("llama.cpp fa on", t)])]
        limit_bw = statistics.median(bw[t]) if bw[t] else None
        for fa in ("off", "on"):
            v = statistics.median(res[(f"llama.cpp fa {fa}", t)])
            print(f"| {t} | llama.cpp, f16 KV, FA {fa} | {v:.1f} | - | - | - | - | - |")
        for cfg in configs:
            tg = res[(cfg, t)]
            kv = kv_mib[cfg] * (1 << 20) * (0.125 if cfg.endswith("+quest") else 1.0)
            mb = (weights + kv) / 1e6
            med = statistics.median(tg)
            ratio = statistics.median(x / y for x, y in zip(tg, best))
            gbs = med * mb * 1e-3
            lim = f"{100 * gbs / limit_bw:.0f}%" if limit_bw else "-"
            lim_ratio = f"{limit_bw * 1e3 / mb / statistics.median(best):.2f}x" if limit_bw else "-"
            print(f"| {t} | pagoda {cfg} | {med:.1f} | **{ratio:.2f}x** | {mb:.0f} | {gbs:.1f} | {lim} | {lim_ratio} |")
    print()
    print(f"Against Pagoda's own {configs[0]} step (median of each round's ratio):")
    print()
    for t in threads:
        for cfg in configs[1:]:
            r = statistics.median(x / y for x, y in zip(res[(cfg, t)], res[(configs[0], t)]))
            print(f"- {t} thread(s): {cfg} {r:.2f}x {configs[0]}")
    print()
    print("raw (every round, in order):")
    for k, v in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  {k}: " + ", ".join(f"{x:.1f}" for x in v))


if __name__ == "__main__":
    main()
