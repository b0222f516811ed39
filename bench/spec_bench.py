#!/usr/bin/env python3
"""Speculative decoding (any drafter) against plain decoding on stories260K.

usage: bench/spec_bench.py [--pagoda build/release/pagoda] [--n 32] [--threads 1] [--spec ngram:k=5,n=3]
                           [--chars 200] [--max-num-seqs S] [--rounds 2] [--draft-model PATH]

Prompts: the openings (first --chars characters) of the first N stories of
tests/data/tinystories_dev.txt; each continues for 128 tokens, greedy. The
same requests run through `pagoda batch` --rounds times in the same
invocation, plain and with --speculative, alternating, best round per side.
--max-num-seqs 1 runs the N requests one after another (single-stream decoding
over many stories, rather than one 10 ms story). Reports the
acceptance rate, the mean accepted length (tokens per verification step) and
generated tokens/s, as a ratio to plain; beside it the ratio of the best
process CPU times (plain / speculative, one engine thread), which other jobs'
time slices on a shared machine do not inflate as they do wall clock. A
benchmark: it reports, it never asserts a time.
"""
import argparse
import json
import os
import resource
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(ROOT, "models", "stories260K.gguf")
DEV = os.path.join(ROOT, "tests", "data", "tinystories_dev.txt")


def openings(n, chars=200):
    text = open(DEV).read()
    out = []
    for story in text.split("<|endoftext|>"):
        story = story.strip()
        if story:
            out.append(story[:chars])
        if len(out) == n:
            break
    return out


def cpu_seconds():
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def batch(pagoda, path, threads, extra):
    """The summary, with the process's CPU time (model load included) as "cpu_seconds"."""
    before = cpu_seconds()
    r = subprocess.run([pagoda, "batch", "-m", STORIES, "-i", path, "-o", "/dev/null", "--json-summary", "-t",
                        str(threads)] + extra, capture_output=True, text=True, check=True)
    j = json.loads(r.stderr.strip().splitlines()[-1])
    j["cpu_seconds"] = cpu_seconds() - before
    return j


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--spec", default="ngram:k=5,n=3")
    ap.add_argument("--chars", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft-model", default="", help="a draft GGUF for --spec draft (passed as --draft-model)")
    a = ap.parse_args()
    common = ["--max-num-seqs", str(a.max_num_seqs)] if a.max_num_seqs > 0 else []
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i, p in enumerate(openings(a.n, a.chars)):
            f.write(json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 128, "temperature": 0}) + "\n")
        path = f.name
    plain, spec = [], []
    for _ in range(a.rounds):
        plain.append(batch(a.pagoda, path, a.threads, common))
        draft = ["--draft-model", a.draft_model] if a.draft_model else []
        spec.append(batch(a.pagoda, path, a.threads, common + draft + ["--speculative", a.spec]))
    os.unlink(path)
    p = max(plain, key=lambda j: j["generation_tokens_per_s"])
    s = max(spec, key=lambda j: j["generation_tokens_per_s"])
    cpu_ratio = min(j["cpu_seconds"] for j in plain) / min(j["cpu_seconds"] for j in spec)
    d = next(iter(s["speculative"].values()))
    print(f"| requests | at once | opening | drafter | acceptance | mean accepted length | steps plain / spec | tok/s plain | tok/s spec | ratio | CPU time ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {a.n} | {a.max_num_seqs or a.n} | {a.chars} | {a.spec} | {100 * d['acceptance_rate']:.1f}% | {d['mean_accepted_length']:.2f} | "
          f"{p['steps']} / {s['steps']} | {p['generation_tokens_per_s']:.0f} | {s['generation_tokens_per_s']:.0f} | "
          f"{s['generation_tokens_per_s'] / p['generation_tokens_per_s']:.2f}x | {cpu_ratio:.2f}x |")


if __name__ == "__main__":
    main()
