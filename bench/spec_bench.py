#!/usr/bin/env python3
"""Speculative decoding (ngram) against plain decoding on stories260K.

usage: bench/spec_bench.py [--pagoda build/release/pagoda] [--n 32] [--threads 1] [--spec ngram:k=5,n=3]

Prompts: the openings (first 200 characters) of the first N stories of
tests/data/tinystories_dev.txt; each continues for 128 tokens, greedy. The
same requests run through `pagoda batch` twice in the same invocation, plain
and with --speculative, alternating, best of two per side. Reports the
acceptance rate, the mean accepted length (tokens per verification step) and
generated tokens/s, as a ratio to plain. A benchmark: it reports, it never
asserts a time.
"""
import argparse
import json
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(ROOT, "models", "stories260K.gguf")
DEV = os.path.join(ROOT, "tests", "data", "tinystories_dev.txt")


def openings(n):
    text = open(DEV).read()
    out = []
    for story in text.split("<|endoftext|>"):
        story = story.strip()
        if story:
            out.append(story[:200])
        if len(out) == n:
            break
    return out


def batch(pagoda, path, threads, extra):
    r = subprocess.run([pagoda, "batch", "-m", STORIES, "-i", path, "-o", "/dev/null", "--json-summary", "-t",
                        str(threads)] + extra, capture_output=True, text=True, check=True)
    return json.loads(r.stderr.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spec", default="ngram:k=5,n=3")
    a = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i, p in enumerate(openings(a.n)):
            f.write(json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 128, "temperature": 0}) + "\n")
        path = f.name
    plain, spec = [], []
    for _ in range(2):
        plain.append(batch(a.pagoda, path, a.threads, []))
        spec.append(batch(a.pagoda, path, a.threads, ["--speculative", a.spec]))
    os.unlink(path)
    p = max(plain, key=lambda j: j["generation_tokens_per_s"])
    s = max(spec, key=lambda j: j["generation_tokens_per_s"])
    d = next(iter(s["speculative"].values()))
    print(f"| requests | drafter | acceptance | mean accepted length | steps plain / spec | tok/s plain | tok/s spec | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {a.n} | {a.spec} | {100 * d['acceptance_rate']:.1f}% | {d['mean_accepted_length']:.2f} | "
          f"{p['steps']} / {s['steps']} | {p['generation_tokens_per_s']:.0f} | {s['generation_tokens_per_s']:.0f} | "
          f"{s['generation_tokens_per_s'] / p['generation_tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    main()
