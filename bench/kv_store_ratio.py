#!/usr/bin/env python3
"""How much zstd saves on stored KV blocks, per KV type (bench/RESULTS.md,
"KV warehouse"): `pagoda batch` computes the first documents of the dev text
with `--kv-store` into a fresh directory, and `pagoda kv stats` reports the
encoded records' bytes against the blocks' own bytes. A record is stored
compressed only when zstd saves at least 1/16, so a ratio near 1 means zstd
was skipped for most blocks.

Models: stories260K (trained weights: real KV) and a synth Llama-3-8B (random
weights, 2 layers), whose KV is close to noise.

usage: bench/kv_store_ratio.py [--pagoda build/release/pagoda] [--docs 24]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPES = ["f32", "f16", "bf16", "fp8", "int8", "k8v4", "int4", "int2", "q8_0", "q4_0"]


def ratio(pagoda, model, docs, kv_type, work):
    store = os.path.join(work, "kv-" + kv_type.replace("/", "_"))
    shutil.rmtree(store, ignore_errors=True)
    lines = os.path.join(work, "in.jsonl")
    with open(lines, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": str(i), "prompt": d, "max_tokens": 1, "temperature": 0}) + "\n")
    subprocess.run([pagoda, "batch", "-m", model, "-i", lines, "-o", "/dev/null", "--kv-cache-dtype", kv_type,
                    "--block-size", "16", "--ctx", "512", "--kv-store", store], check=True, capture_output=True)
    out = subprocess.run([pagoda, "kv", "stats", "--store", store], check=True, capture_output=True, text=True).stdout
    total = next(l for l in out.splitlines() if l.startswith("total"))
    cols = re.split(r"\s{2,}", total.strip())
    return int(cols[1]), cols[3], cols[4], float(cols[5])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    ap.add_argument("--docs", type=int, default=24)
    args = ap.parse_args()
    text = open(os.path.join(ROOT, "tests", "data", "tinystories_dev.txt")).read()
    docs = [d.strip() for d in text.split("<|endoftext|>") if d.strip()][: args.docs]
    work = tempfile.mkdtemp(prefix="pagoda_kvratio_")
    try:
        synth = os.path.join(work, "synth.gguf")
        subprocess.run([args.pagoda, "synth", "--preset", "llama3-8b", "--layers", "2", "--weight-type", "q8_0",
                        "--vocab", "512", "-o", synth], check=True, capture_output=True)
        print("| KV type | stories260K blocks | stored | KV | stored/KV | synth 8B blocks | stored | KV | stored/KV |")
        print("|---|---|---|---|---|---|---|---|---|")
        for t in TYPES:
            a = ratio(args.pagoda, os.path.join(ROOT, "models", "stories260K.gguf"), docs, t, work)
            b = ratio(args.pagoda, synth, docs[: max(2, args.docs // 8)], t, work)
            print(f"| {t} | {a[0]} | {a[1]} | {a[2]} | {a[3]:.3f} | {b[0]} | {b[1]} | {b[2]} | {b[3]:.3f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
