#!/usr/bin/env python3
"""Single-stream speed of `pagoda run` and `pagoda batch` (one request), as
llama-bench measures llama.cpp: prompt processing of 512 tokens (pp512) and
128 decode passes from an almost empty context (tg128), on the synth
Llama-3-8B 4-layer files, at 1 and 2 threads, with the machine's read
bandwidth measured in the same run.

Every configuration (binary x model x threads x mmap/--no-mmap) runs once per
round, in an order that is the same in every round, so slow phases of this
shared machine hit every configuration alike; figures are the median over the
rounds, and ratios are taken between configurations of the same run.

usage:
  bench/decode_speed.py --pagoda new=build/release/pagoda [--pagoda old=/tmp/pagoda-old]
      [--pagoda new-read=build/release/pagoda,--no-mmap]
      --model Q8_0=/tmp/l3-4l-q8_0.gguf [--model Q4_K_M=...] [--threads 1,2] [--rounds 3]
      [--batch] [--bandwidth build/release/bench/matmul_bench]
      [--llama-bench /path/to/llama-bench,-fa,off]

A binary's label may carry extra flags after commas (",--no-mmap": the weights
read into memory instead of mapped). With --llama-bench, llama.cpp's
llama-bench runs each model and thread count once per round too (one
repetition after its own warm-up), and a second table gives pagoda /
llama.cpp as the median of each round's ratio. Neither llama.cpp nor its
code is part of this project: bring your own build or distribution package.

Files: pagoda synth --preset llama3-8b --layers 4 --ffn 4096 --vocab 512
--weight-type {q8_0,Q4_K_M,Q5_K_M,q6_K} -o FILE (the oracle README's shapes).
"""
import argparse
import json
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time

# GGUF tensor types: (block elements, block bytes), for the weight bytes a
# decode pass reads.
TYPE_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
              10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
              20: (32, 18), 21: (256, 110), 23: (256, 136), 30: (1, 2), 39: (32, 17)}


def gguf_header(path):
    """The scalar metadata ({key: value}) and (name, type, n_elements) of every tensor, from the GGUF header."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)  # the header of a synth file is well under this
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = data[pos:pos + n].decode("utf-8", "replace")
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("I"), take("Q")
            for _ in range(n):
                value(et)
            return None
        return take(scalar[t])

    assert data[:4] == b"GGUF", path
    pos = 8
    n_tensors, n_kv = take("Q"), take("Q")
    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(take("I"))
    out = []
    for _ in range(n_tensors):
        name = string()
        n_dims = take("I")
        n = 1
        for _ in range(n_dims):
            n *= take("Q")
        t = take("I")
        take("Q")
        out.append((name, t, n))
    return kv, out


def decode_bytes(path):
    """Bytes a decode pass reads: every tensor but the embedding table (one row of it); of a
    mixture of experts' 3-D expert tensors, the share of the experts one token is routed to."""
    kv, tensors = gguf_header(path)
    arch = kv.get("general.architecture", "")
    n_expert, n_used = kv.get(f"{arch}.expert_count", 0), kv.get(f"{arch}.expert_used_count", 0)
    total = 0
    for name, t, n in tensors:
        if name == "token_embd.weight":
            continue
        elems, size = TYPE_SIZES[t]
        b = n // elems * size
        total += b * n_used // n_expert if "_exps." in name and n_expert else b
    return total


def sh(args, stdin=None):
    r = subprocess.run(args, capture_output=True, text=True, input=stdin)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{r.stderr}")
    return r


def prompt_of(pagoda, model, n_tokens):
    """Single letters, one token each after BOS: a prompt of exactly n_tokens."""
    text = " ".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(n_tokens - 1))
    got = len(sh([pagoda, "tokenize", "-m", model, "-p", text]).stdout.split())
    if got != n_tokens:
        sys.exit(f"the prompt has {got} tokens, not {n_tokens}")
    return text


def run_once(pagoda, model, threads, prompt_file, n_gen):
    args = [pagoda[0], "run", "-m", model, "-f", prompt_file, "-n", str(n_gen), "--temp", "0", "-t", str(threads),
            "--ignore-eos", "--json"] + pagoda[1:]
    return json.loads(sh(args).stdout)["timings"]


def batch_once(pagoda, model, threads, n_gen, tmp):
    req = os.path.join(tmp, "one.jsonl")
    with open(req, "w") as f:
        f.write(json.dumps({"id": 1, "prompt": "hello", "max_tokens": n_gen, "temperature": 0, "ignore_eos": True}) + "\n")
    args = [pagoda[0], "batch", "-m", model, "-i", req, "-o", os.devnull, "-t", str(threads), "--json-summary"] + \
        pagoda[1:]
    err = sh(args).stderr
    line = [l for l in err.splitlines() if l.startswith("{")][-1]
    return json.loads(line)["decode_tokens_per_s"]


def llama_bench_once(llama, model, threads, n_gen, no_prompt):
    """llama-bench's pp512 and tg<n_gen> tokens/s (one repetition after its warm-up run)."""
    args = [llama[0], "-m", model, "-p", "0" if no_prompt else "512", "-n", str(n_gen), "-t", str(threads),
            "-r", "1", "-o", "json"] + llama[1:]
    out = {}
    for test in json.loads(sh(args).stdout):
        out["pp" if test["n_prompt"] else "tg"] = test["avg_ts"]
    return out


def bandwidth(bench, threads):
    """The larger of matmul_bench's read bandwidths in 4 KiB and in 2 MiB pages."""
    if not bench:
        return None
    r = sh([bench, f"--benchmark_filter=read_bandwidth(_huge)?/threads:{threads}/", "--benchmark_min_time=0.3"])
    found = [float(x) for x in re.findall(r"GB/s=([0-9.]+)", r.stdout)]
    return max(found) if found else None


def paired(res, a, b):
    """The median over rounds of a / b, each round's two figures taken minutes apart at most."""
    return statistics.median(x / y for x, y in zip(res[a], res[b]))


def load_average():
    return os.getloadavg()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pagoda", action="append", required=True, help="LABEL=PATH[,FLAG...] of a pagoda binary")
    ap.add_argument("--model", action="append", required=True, help="LABEL=PATH of a GGUF file")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", action="store_true", help="also `pagoda batch` with one request")
    ap.add_argument("--no-prompt", action="store_true", help="skip pp512")
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--bandwidth", help="matmul_bench binary for the read bandwidth of each round")
    ap.add_argument("--llama-bench", help="PATH[,ARG...] of llama.cpp's llama-bench, run in the same rounds "
                    "(pp512 and tg128 of each model and thread count, one repetition per round)")
    a = ap.parse_args()
    binaries = [(p.split("=", 1)[0], p.split("=", 1)[1].split(",")) for p in a.pagoda]
    llama = a.llama_bench.split(",") if a.llama_bench else None
    models = [m.split("=", 1) for m in a.model]
    threads = [int(t) for t in a.threads.split(",")]

    tmp = tempfile.mkdtemp(prefix="decode_speed_")
    p512 = os.path.join(tmp, "p512.txt")
    with open(p512, "w") as f:
        f.write(prompt_of(binaries[0][1][0], models[0][1], 512))
    short = os.path.join(tmp, "short.txt")
    with open(short, "w") as f:
        f.write("hello")

    res = {}  # (what, binary, model, threads) -> [values]
    bw = {t: [] for t in threads}
    loads = [load_average()]
    t0 = time.time()
    for rnd in range(a.rounds):
        for t in threads:
            v = bandwidth(a.bandwidth, t)
            if v:
                bw[t].append(v)
        for ml, mp in models:
            for t in threads:
                for bl, bp in binaries:
                    key = (bl, ml, t)
                    tg = run_once(bp, mp, t, short, a.n_gen + 1)
                    res.setdefault(("tg",) + key, []).append(tg["generation_tokens_per_s"])
                    if "generation_cpu_ms" in tg:  # decode tokens per second of the process's CPU time
                        res.setdefault(("tg_cpu",) + key, []).append(
                            tg["generation_tokens"] / max(tg["generation_cpu_ms"] * 1e-3, 1e-9))
                    if not a.no_prompt:
                        pp = run_once(bp, mp, t, p512, 1)
                        res.setdefault(("pp",) + key, []).append(pp["prompt_tokens_per_s"])
                    if a.batch:
                        res.setdefault(("batch",) + key, []).append(batch_once(bp, mp, t, a.n_gen + 1, tmp))
                if llama:
                    for what, v in llama_bench_once(llama, mp, t, a.n_gen, a.no_prompt).items():
                        res.setdefault((what, "llama.cpp", ml, t), []).append(v)
        loads.append(load_average())
        print(f"round {rnd + 1}/{a.rounds} done, {time.time() - t0:.0f} s, load {loads[-1]:.1f}", file=sys.stderr)

    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"rounds: {a.rounds}; load average (1 min) at the start and after each round: "
          + ", ".join(f"{x:.1f}" for x in loads))
    for t in threads:
        if bw[t]:
            print(f"read bandwidth, {t} thread(s): " + ", ".join(f"{x:.1f}" for x in bw[t]) +
                  f" GB/s (median {statistics.median(bw[t]):.1f})")
    print()
    print("| weights | threads | binary | decode MB/token | prompt 512 tok/s | decode tok/s (run) | "
          "decode GB/s | of read bandwidth | decode tok per CPU-second (1 thread) |" +
          (" decode tok/s (batch, 1 request) | batch / run |" if a.batch else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if a.batch else ""))
    for ml, mp in models:
        mb = decode_bytes(mp)
        for t in threads:
            for bl, _ in binaries:
                key = (bl, ml, t)
                tg = med[("tg",) + key]
                gbs = tg * mb * 1e-9
                limit = statistics.median(bw[t]) if bw[t] else None
                cpu = med.get(("tg_cpu",) + key)
                row = [ml, str(t), bl, f"{mb / 1e6:.1f}", f"{med[('pp',) + key]:.1f}" if not a.no_prompt else "-",
                       f"{tg:.1f}", f"{gbs:.1f}", f"{100 * gbs / limit:.0f}%" if limit else "-",
                       f"{cpu:.1f}" if cpu and t == 1 else "-"]
                if a.batch:
                    b = med[("batch",) + key]
                    row += [f"{b:.1f}", f"{b / tg:.2f}"]
                print("| " + " | ".join(row) + " |")
    if llama:
        print()
        print("Against llama.cpp (llama-bench in the same rounds): medians, and the median of each round's "
              "ratio (pagoda / llama.cpp).")
        print()
        print("| weights | threads | binary | decode tok/s (run) | llama.cpp tg | run / llama.cpp |" +
              (" batch / llama.cpp |" if a.batch else "") +
              (" prompt 512 tok/s | llama.cpp pp512 | prompt / llama.cpp |" if not a.no_prompt else ""))
        print("|---|---|---|---|---|---|" + ("---|" if a.batch else "") + ("---|---|---|" if not a.no_prompt else ""))
        for ml, _ in models:
            for t in threads:
                lk = ("llama.cpp", ml, t)
                for bl, _ in binaries:
                    key = (bl, ml, t)
                    row = [ml, str(t), bl, f"{med[('tg',) + key]:.1f}", f"{med[('tg',) + lk]:.1f}",
                           f"{paired(res, ('tg',) + key, ('tg',) + lk):.2f}x"]
                    if a.batch:
                        row.append(f"{paired(res, ('batch',) + key, ('tg',) + lk):.2f}x")
                    if not a.no_prompt:
                        row += [f"{med[('pp',) + key]:.1f}", f"{med[('pp',) + lk]:.1f}",
                                f"{paired(res, ('pp',) + key, ('pp',) + lk):.2f}x"]
                    print("| " + " | ".join(row) + " |")
    print()
    print("raw (every round, in order):")
    for k, v in sorted(res.items()):
        print(f"  {k}: " + ", ".join(f"{x:.1f}" for x in v))


if __name__ == "__main__":
    main()
