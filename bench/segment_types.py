#!/usr/bin/env python3
"""A KV type per prompt segment (KV classes, issue 12): quality and memory.

Two parts, each a table of bench/RESULTS.md ("A KV type per prompt segment"):

  quality  `pagoda perplexity --kl-divergence` on stories260K and the dev text at
           --ctx 512: the first 75% of each document in a segment type (int8,
           int4, int2 as KV classes beside f16), against the same types over
           the whole cache and f16 alone. Mean KV bytes per token, perplexity
           change, mean KL divergence and top-1 agreement against an exact f32
           cache, over every scored row and over the rows past the first 75%
           (the part that reads the compressed segment with its own K/V kept
           in f16: a question after a document).
  load     `pagoda batch`: N requests of a document (its first 75% as a prompt
           part of type int4) and a question part, a pool sized for `fit` of
           them at f16, the same bytes split between f16 blocks and an int4
           class (--kv-segment-dtype int4:FRACTION), against f16 alone: peak
           running sequences, preemptions, generated tok/s (the batch summary).

usage: bench/segment_types.py [--pagoda build/release/pagoda] [--parts quality,load]

The figures of `quality` are deterministic; `load`'s tok/s depend on the
machine's load (printed), its peak running and preemptions do not.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd):
    log("$ " + " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return r


def part_quality(a):
    base = [a.pagoda, "perplexity", "-m", a.model, "-f", a.text, "--ctx", "512", "--kl-divergence", "--json", "-t",
            str(a.threads), "--segment-fraction", "0.75"]
    rows = []
    for label, extra in [("f16 (whole cache)", ["--kv-cache-dtype", "f16"])] + \
            [(f"{t} (whole cache)", ["--kv-cache-dtype", t]) for t in ("int8", "int4", "int2")] + \
            [(f"first 75% {t}, rest f16", ["--kv-cache-dtype", "f16", "--segment-kv-type", t]) for t in ("int8", "int4", "int2")]:
        j = json.loads(run(base + extra).stdout)
        k, tail = j["kl_divergence"], j["after_segment"]
        seg = j.get("segment")
        rows.append((label, seg["layout"] + " / " + j["kv"]["layout"] if seg else j["kv"]["layout"],
                     seg["mean_bytes_per_token"] if seg else j["kv"]["bytes_per_token"], k["perplexity_change_percent"],
                     k["mean_kl"], k["top1_agreement"], tail["mean_kl"], tail["top1_agreement"], tail["rows"]))
    print("| KV | layout | bytes/token | perplexity change | mean KL | top-1 | KL past 75% | top-1 past 75% |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:+.3f}% | {r[4]:.6f} | {100 * r[5]:.2f}% | {r[6]:.6f} | "
              f"{100 * r[7]:.2f}% |")
    print(f"\nRows past 75%: {rows[0][8]} of each run's scored rows.\n")


def documents(path, n, chars):
    """n pieces of about `chars` characters of the text, cut at spaces (stories run on across separators)."""
    text = " ".join(d.strip() for d in open(path).read().split("<|endoftext|>"))
    out, at = [], 0
    while len(out) < n:
        end = text.rfind(" ", at, at + chars)
        if end <= at:
            sys.exit(f"{path}: too short for {n} pieces of {chars} characters")
        out.append(text[at:end])
        at = end + 1
    return out


def part_load(a):
    docs = documents(a.text, a.requests, a.doc_chars)
    lines = {"plain": [], "typed": []}
    for i, d in enumerate(docs):
        d = d[:a.doc_chars]
        cut = int(len(d) * 0.75)
        cut = d.rfind(" ", 0, cut) if " " in d[:cut] else cut
        question = d[cut:]
        common = {"id": i, "max_tokens": a.gen, "temperature": 0, "ignore_eos": True}
        lines["plain"].append(dict(common, prompt=d))
        lines["typed"].append(dict(common, prompt=[{"text": d[:cut], "kv": {"type": "int4"}}, {"text": question}]))
    paths = {}
    os.makedirs(a.workdir, exist_ok=True)
    for k, ls in lines.items():
        paths[k] = os.path.join(a.workdir, f"segment-{k}.jsonl")
        with open(paths[k], "w") as f:
            for line in ls:
                f.write(json.dumps(line) + "\n")
    per_req = a.prompt_tokens + a.gen
    model = a.load_model
    if not model:
        model = os.path.join(a.workdir, "l3-1l.gguf")
        if not os.path.exists(model):
            run([a.pagoda, "synth", "--preset", "llama3-8b", "--layers", "1", "--ffn", "1024", "--vocab", "512",
                 "--weight-type", "q8_0", "--ctx", str(a.ctx), "-o", model])
    common = [a.pagoda, "batch", "-m", model, "-o", os.devnull, "--json-summary", "-t", str(a.threads), "-c", str(a.ctx),
              "--kv-cache-dtype", "f16", "--max-kv-tokens", str(a.fit * per_req), "--max-num-seqs", str(a.requests),
              "--no-enable-prefix-caching"]
    variants = [("f16", ["-i", paths["plain"]]),
                (f"first 75% int4 (int4:{a.fraction})", ["-i", paths["typed"], "--kv-segment-dtype", f"int4:{a.fraction}"])]
    results = {label: [] for label, _ in variants}
    for rnd in range(a.rounds):
        for label, extra in variants:
            load0 = os.getloadavg()[0]
            results[label].append(json.loads(run(common + extra).stderr.strip().splitlines()[-1]))
            log(f"round {rnd} {label}: load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"### {a.requests} requests of about {a.prompt_tokens} + {a.gen} tokens, a pool for {a.fit} at f16 "
          f"({a.rounds} rounds, alternating; medians)\n")
    print("| KV | generated tok/s | vs f16 | peak running | preemptions | peak blocks / pool |")
    print("|---|---|---|---|---|---|")
    f16 = results[variants[0][0]]
    for label, _ in variants:
        mine = results[label]
        ratio = statistics.median(m["generation_tokens_per_s"] / f["generation_tokens_per_s"] for m, f in zip(mine, f16))
        print(f"| {label} | {statistics.median(m['generation_tokens_per_s'] for m in mine):.1f} | {ratio:.2f}x | "
              f"{max(m['peak_running'] for m in mine)} | {'/'.join(str(m['preemptions']) for m in mine)} | "
              f"{max(m['peak_blocks_used'] for m in mine)}/{mine[0]['blocks_total']} |")
    print(f"\nLoad average at the end: {os.getloadavg()[0]:.1f}.\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    p.add_argument("--model", default=os.path.join(SHARED, "models", "stories260K.gguf"), help="quality: the model")
    p.add_argument("--load-model", default="",
                   help="load: a model (default: a synth Llama-3-8B-shaped 1-layer q8_0 file, head_dim 128, made with "
                        "`pagoda synth` in the workdir)")
    p.add_argument("--ctx", type=int, default=2048, help="load: context")
    p.add_argument("--text", default=os.path.join(SHARED, "eval", "tinystories_dev.txt"))
    p.add_argument("--workdir", default="/tmp/pagoda-segment-types")
    p.add_argument("--parts", default="quality,load")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--fit", type=int, default=8, help="load: requests the pool holds at f16")
    p.add_argument("--doc-chars", type=int, default=1100, help="load: characters of each document")
    p.add_argument("--prompt-tokens", type=int, default=800, help="load: about the tokens of a prompt (pool sizing)")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="load: rounds of both variants")
    p.add_argument("--fraction", type=float, default=0.38, help="load: the int4 class's share of the pool's bytes")
    a = p.parse_args()
    parts = a.parts.split(",")
    if "quality" in parts:
        part_quality(a)
    if "load" in parts:
        part_load(a)


if __name__ == "__main__":
    main()
