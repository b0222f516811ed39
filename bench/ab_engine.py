#!/usr/bin/env python3
"""A/B of two pagoda builds on whole-engine work, interleaved so that machine
noise lands on both sides alike (bench/RESULTS.md quotes its output).

- `pagoda batch` throughput: N requests with --max-num-seqs N (N = 1, 8, 32),
  generated tokens/s over the whole run, on stories260K and on a synthetic
  Llama-3-8B-shaped model (4 layers, q8_0, FFN 4096, vocab 512).
- Whole decode steps at long context: decode_bench (one forward step of one
  sequence over 4K and 32K cached tokens, synth Llama-3-8B 2 layers q8_0).
- Whole engine steps at long context: engine_step_bench (schedule, forward
  pass and sampling, update and output step of 4 sequences decoding after a
  shared 4K or 32K prompt, stories260K: the model is small, so the engine's
  own work weighs the most).

usage: bench/ab_engine.py --old OLD_BUILD_DIR --new NEW_BUILD_DIR [--rounds 3] [--only batch,decode,engine]
       (a build dir holds pagoda, bench/decode_bench and bench/engine_step_bench, e.g. build/release;
       engine_step_bench.cpp uses engine_core's public calls only, so an older tree builds it when the
       file is copied into its bench/micro)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(ROOT, "models", "stories260K.gguf")


def sh(args, env=None):
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{r.stderr}")
    return r


def batch_tps(pagoda, model, n, gen, threads):
    lines = [{"id": str(i), "prompt": f"Once upon a time, story number {i} began", "max_tokens": gen,
              "temperature": 0} for i in range(n)]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
        path = f.name
    r = sh([pagoda, "batch", "-m", model, "-i", path, "-o", "/dev/null", "--json-summary", "-t", str(threads),
            "--ctx", "512", "--max-num-batched-tokens", "2048", "--max-num-seqs", str(n)])
    os.unlink(path)
    return json.loads(r.stderr.strip().splitlines()[-1])["generation_tokens_per_s"]


def section_batch(old, new, rounds, synth8):
    print("### `pagoda batch` throughput, old vs new (generated tok/s, median of interleaved rounds)\n")
    print("| model | threads | N | old | new | new/old |")
    print("|---|---|---|---|---|---|")
    for name, model, gen, threads in [("stories260K", STORIES, 128, 1), ("synth llama3-8b 4L q8_0", synth8, 64, 2)]:
        for n in (1, 8, 32):
            a, b = [], []
            for _ in range(rounds):
                a.append(batch_tps(os.path.join(old, "pagoda"), model, n, gen, threads))
                b.append(batch_tps(os.path.join(new, "pagoda"), model, n, gen, threads))
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"| {name} | {threads} | {n} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} |")
    print()


def decode_steps(build, model, filt):
    env = dict(os.environ, PAGODA_DECODE_MODEL=model)
    r = sh([os.path.join(build, "bench", "decode_bench"), f"--benchmark_filter={filt}", "--benchmark_format=json"],
           env=env)
    out = {}
    for b in json.loads(r.stdout)["benchmarks"]:
        out[b["name"]] = b["items_per_second"] if "items_per_second" in b else b.get("tokens/s", 0)
    return out


def section_decode(old, new, rounds, synth2):
    print("### Whole decode steps at long context, old vs new (decode_bench, steps/s, median of interleaved rounds)\n")
    print("| benchmark | old | new | new/old |")
    print("|---|---|---|---|")
    filt = "decode_step/(f16|int8)/ctx:(4096|32768)/threads:1"
    a, b = {}, {}
    for _ in range(rounds):
        for k, v in decode_steps(old, synth2, filt).items():
            a.setdefault(k, []).append(v)
        for k, v in decode_steps(new, synth2, filt).items():
            b.setdefault(k, []).append(v)
    for k in sorted(a):
        ma, mb = statistics.median(a[k]), statistics.median(b.get(k, [0]))
        print(f"| {k} | {ma:.2f} | {mb:.2f} | {mb / ma:.3f} |")
    print()


def engine_steps(build):
    r = sh([os.path.join(build, "bench", "engine_step_bench"), "--benchmark_format=json"])
    return {b["name"]: b["steps/s"] for b in json.loads(r.stdout)["benchmarks"]}


def section_engine(old, new, rounds):
    print("### Whole engine steps at long context, old vs new (engine_step_bench, steps/s, median of interleaved rounds)\n")
    print("| benchmark | old | new | new/old |")
    print("|---|---|---|---|")
    a, b = {}, {}
    for _ in range(rounds):
        for k, v in engine_steps(old).items():
            a.setdefault(k, []).append(v)
        for k, v in engine_steps(new).items():
            b.setdefault(k, []).append(v)
    for k in sorted(a):
        ma, mb = statistics.median(a[k]), statistics.median(b.get(k, [0]))
        print(f"| {k} | {ma:.2f} | {mb:.2f} | {mb / ma:.3f} |")
    print()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="batch,decode,engine")
    a = ap.parse_args()
    new_pagoda = os.path.join(a.new, "pagoda")
    synth8 = "/tmp/pagoda-synth-llama3-8b-4l-q8.gguf"
    synth2 = "/tmp/llama3-8b-2l-q8.gguf"
    if not os.path.exists(synth8):
        sh([new_pagoda, "synth", "--preset", "llama3-8b", "--layers", "4", "--ffn", "4096", "--vocab", "512",
            "--weight-type", "q8_0", "-o", synth8])
    if not os.path.exists(synth2):
        sh([new_pagoda, "synth", "--preset", "llama3-8b", "--layers", "2", "--weight-type", "q8_0", "--vocab", "512",
            "--ctx", "65536", "-o", synth2])
    only = a.only.split(",")
    if "batch" in only:
        section_batch(a.old, a.new, a.rounds, synth8)
    if "decode" in only:
        section_decode(a.old, a.new, a.rounds, synth2)
    if "engine" in only:
        section_engine(a.old, a.new, a.rounds)


if __name__ == "__main__":
    main()
