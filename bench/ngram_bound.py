#!/usr/bin/env python3
"""What prompt lookup can gain on stories260K continuations, apart from any engine cost model.

usage: bench/ngram_bound.py [--pagoda build/release/pagoda] [--n 200] [--chars 200] [--k 5] [--row-cost 0.3]

The openings (first --chars characters) of the first N stories of tests/data/tinystories_dev.txt
continue for 128 greedy tokens (`pagoda batch`). Along each continuation it reports:
  - per length L of the longest earlier match of the text's tail (as src/spec/ngram_drafter.cpp
    ranks them), how often the first 1, 2, 3 tokens that followed that match were the next ones;
  - an oracle prompt lookup: at every step, among all earlier occurrences of the last token, the
    one whose continuation agrees longest with the true output, drafting exactly the tokens that
    will be accepted (at most k). Its step ratio is the most any n-gram drafter can save, and
    step ratio / (1 + row_cost x (rows per step - 1)) the most it can gain when each extra
    verification row costs row_cost of a decode step (bench/micro/verify_rows_bench).
A benchmark: it reports, it never asserts.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_bench import STORIES, openings  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def streams(pagoda, prompts):
    """(prompt token ids, 128 greedy continuation ids) per prompt."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 128, "temperature": 0}) + "\n")
        path = f.name
    r = subprocess.run([pagoda, "batch", "-m", STORIES, "-i", path, "-t", "2"], capture_output=True, text=True, check=True)
    os.unlink(path)
    outs = {j["id"]: j["completions"][0]["token_ids"] for j in map(json.loads, r.stdout.splitlines())}
    out = []
    for i, p in enumerate(prompts):
        ids = subprocess.run([pagoda, "tokenize", "-m", STORIES, "-p", p], capture_output=True, text=True,
                             check=True).stdout.split()
        out.append(([int(x) for x in ids], outs[f"r{i}"]))
    return out


def longest_match(tokens):
    """(L, start of what followed) of the longest earlier match of tokens' tail, newest among equals."""
    size, best = len(tokens), (0, -1)
    for j in range(size - 2, -1, -1):
        n = 0
        while j - n >= 0 and tokens[j - n] == tokens[size - 1 - n]:
            n += 1
        if n > best[0]:
            best = (n, j + 1)
    return best


def by_match_length(data):
    stat = {}
    for prompt, out in data:
        for g in range(127):
            t = prompt + out[:g + 1]
            n, at = longest_match(t)
            if n == 0:
                continue
            s = stat.setdefault(min(n, 6), [0, [0] * 3, [0] * 3])
            s[0] += 1
            for p in range(3):
                if g + 1 + p >= 128 or at + p >= len(t):
                    break
                s[2][p] += 1
                s[1][p] += t[at:at + p + 1] == out[g + 1:g + 2 + p]
    return stat


def oracle(data, k):
    steps = rows = 0
    for prompt, out in data:
        tokens = prompt + out[:1]
        g, steps, rows = 1, steps + 1, rows + 1
        while g < 128:
            kk, best = min(k, 127 - g), 0
            for j in range(len(tokens) - 2, -1, -1):
                if tokens[j] != tokens[-1]:
                    continue
                a = 0
                while a < kk and j + 1 + a < len(tokens) and tokens[j + 1 + a] == out[g + a]:
                    a += 1
                best = max(best, a)
            steps, rows = steps + 1, rows + 1 + best
            tokens += out[g:g + best + 1]
            g += best + 1
    return steps, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--chars", type=int, default=200)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--row-cost", type=float, default=0.3)
    a = ap.parse_args()
    data = streams(a.pagoda, openings(a.n, a.chars))
    print("| match length | steps | 1st draft right | first 2 right | first 3 right |")
    print("|---|---|---|---|---|")
    for n, (count, right, seen) in sorted(by_match_length(data).items()):
        cells = " | ".join(f"{100 * right[p] / max(1, seen[p]):.0f}%" for p in range(3))
        print(f"| {n if n < 6 else '>= 6'} | {count} | {cells} |")
    steps, rows = oracle(data, a.k)
    total = 128 * len(data)
    ratio, per_step = total / steps, rows / steps
    print(f"oracle lookup, k={a.k}, {a.n} openings of {a.chars} chars: steps {total} / {steps} = {ratio:.3f}x, "
          f"{per_step:.2f} rows a step, bound {ratio / (1 + a.row_cost * (per_step - 1)):.2f}x at row cost {a.row_cost}")


if __name__ == "__main__":
    main()
