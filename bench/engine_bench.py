#!/usr/bin/env python3
"""End-to-end engine benchmarks for bench/RESULTS.md (issues 2 and 3).

Runs the pagoda binary on stories260K and on a synthetic Llama-3-8B-shaped model
(4 layers, q8_0, FFN 4096, 512-token vocabulary: the shape of the llama.cpp
figures quoted in issue 2) and prints markdown tables. Every ratio is taken
within one run of this script, so machine noise affects both sides alike.

usage: bench/engine_bench.py [--pagoda build/release/pagoda] [--only run,ppl,batch,prefix]
       [--batch-model LABEL=PATH[,FLAG...] ...] [--batch-sizes 1,8,32,64] [--batch-threads 2]

--batch-model replaces the batch section's two models (stories260K at 1 thread,
the synth file at 2) with the given files, each at --batch-threads, flags after
commas passed to `pagoda batch` (e.g. ",--no-mmap").
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(ROOT, "models", "stories260K.gguf")
DEV = os.path.join(ROOT, "tests", "data", "tinystories_dev.txt")


def sh(args, stdin=None):
    r = subprocess.run(args, capture_output=True, text=True, input=stdin)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{r.stderr}")
    return r


def synth(pagoda, path):
    if not os.path.exists(path):
        sh([pagoda, "synth", "--preset", "llama3-8b", "--layers", "4", "--ffn", "4096", "--vocab", "512",
            "--weight-type", "q8_0", "-o", path])
    return path


def prompt_text(n_words):
    words = open(DEV).read().replace("<|endoftext|>", " ").split()
    return " ".join(words[:n_words])


def best_of(n, fn):
    runs = [fn() for _ in range(n)]
    return max(runs, key=lambda r: r[0] + r[1])


def bench_run(pagoda, model, threads, prompt, n_gen):
    def once():
        r = sh([pagoda, "run", "-m", model, "-p", prompt, "-n", str(n_gen), "--temp", "0", "-t", str(threads), "--json",
                "--ctx", "4096"])
        j = json.loads(r.stdout)
        return j["timings"]["prompt_tokens_per_s"], j["timings"]["generation_tokens_per_s"], len(j["prompt_tokens"])
    return best_of(3, once)


def section_run(pagoda, synth_model):
    print("### Prompt and generation speed (`pagoda run`, greedy, best of 3)\n")
    print("| model | threads | prompt tokens | prompt tok/s | generation tok/s |")
    print("|---|---|---|---|---|")
    for name, model, words, n_gen in [("stories260K", STORIES, 300, 256), ("synth llama3-8b 4L q8_0", synth_model, 400, 64)]:
        p = prompt_text(words)
        for t in (1, 2):
            pp, tg, n = bench_run(pagoda, model, t, p, n_gen)
            print(f"| {name} | {t} | {n} | {pp:.1f} | {tg:.1f} |")
    print()


def section_ppl(pagoda):
    print("### Perplexity throughput (stories260K, tinystories_dev.txt, --ctx 512, f32 KV)\n")
    print("| threads | tokens/s | mean NLL |")
    print("|---|---|---|")
    for t in (1, 2):
        r = sh([pagoda, "perplexity", "-m", STORIES, "-f", DEV, "--ctx", "512", "--kv-cache-dtype", "f32", "--json",
                "--truncate", "-t", str(t)])
        j = json.loads(r.stdout)
        print(f"| {t} | {j['tokens_per_s']:.0f} | {j['mean_nll']:.5f} |")
    print()


def batch(pagoda, model, lines, extra):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")
        path = f.name
    r = sh([pagoda, "batch", "-m", model, "-i", path, "-o", "/dev/null", "--json-summary"] + extra)
    os.unlink(path)
    return json.loads(r.stderr.strip().splitlines()[-1])


def section_batch(pagoda, synth_model, models=None, sizes=(1, 8, 32, 64)):
    print("### Continuous batching throughput (`pagoda batch`)\n")
    print("N requests run with `--max-num-seqs N` against the same N requests with `--max-num-seqs 1`")
    print("(one at a time). Generated tokens/s over the whole run (prefill included); fragmentation is the mean")
    print("over steps, usage the peak. Each request generates 128 tokens (greedy), so that decoding, not the")
    print("one prefill step of all N prompts, dominates. Best of two alternating runs per side.\n")
    print("| model | threads | N | tok/s one at a time | tok/s concurrent | ratio | peak KV usage | mean fragmentation |")
    print("|---|---|---|---|---|---|---|---|")
    # (label, path, tokens generated, threads, extra flags)
    models = models or [("stories260K", STORIES, 128, 1, []), ("synth llama3-8b 4L q8_0", synth_model, 128, 2, [])]
    for name, model, gen, threads, flags in models:
        for n in sizes:
            lines = [{"id": str(i), "prompt": f"Once upon a time, story number {i} began", "max_tokens": gen,
                      "temperature": 0} for i in range(n)]
            common = ["-t", str(threads), "--ctx", "512", "--max-num-batched-tokens", "2048"] + flags
            # Best of two, alternating, so a burst of load from the machine's
            # other tenants does not land on one side of the ratio only.
            runs = [(batch(pagoda, model, lines, common + ["--max-num-seqs", "1"]),
                     batch(pagoda, model, lines, common + ["--max-num-seqs", str(n)])) for _ in range(2)]
            seq = max((r[0] for r in runs), key=lambda s: s["generation_tokens_per_s"])
            con = max((r[1] for r in runs), key=lambda s: s["generation_tokens_per_s"])
            a, b = seq["generation_tokens_per_s"], con["generation_tokens_per_s"]
            print(f"| {name} | {threads} | {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {100 * con['peak_kv_usage']:.1f}% "
                  f"| {100 * con['fragmentation_mean']:.1f}% |")
    print()


def section_prefix(pagoda):
    print("### Shared-prefix memory (stories260K, 32 requests, 256-token shared prefix + short suffix, 16 new tokens)\n")
    words = open(DEV).read().split()
    prefix = " ".join(words[:230])
    lines = [{"id": str(i), "prompt": prefix + f" and then number {i} said", "max_tokens": 16, "temperature": 0}
             for i in range(32)]
    print("| prefix caching | peak blocks used | prefix hit rate | prompt tokens computed | tok/s |")
    print("|---|---|---|---|---|")
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        s = batch(pagoda, STORIES, lines, ["-t", "1", "--max-num-seqs", "32", flag])
        print(f"| {'on' if flag.startswith('--enable') else 'off'} | {s['peak_blocks_used']} | "
              f"{100 * s['prefix_hit_rate']:.1f}% | {s['computed_prompt_tokens']} | {s['generation_tokens_per_s']:.1f} |")
    print()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    ap.add_argument("--synth", default="/tmp/pagoda_bench_llama3_8b_4l_q8_0.gguf")
    ap.add_argument("--only", default="run,ppl,batch,prefix")
    ap.add_argument("--batch-model", action="append", default=[], help="LABEL=PATH[,FLAG...] for the batch section")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--batch-threads", type=int, default=2)
    a = ap.parse_args()
    only = a.only.split(",")
    batch_models = [(m.split("=", 1)[0], m.split("=", 1)[1].split(",")[0], 128, a.batch_threads,
                     m.split("=", 1)[1].split(",")[1:]) for m in a.batch_model]
    need_synth = "run" in only or ("batch" in only and not batch_models)
    synth_model = synth(a.pagoda, a.synth) if need_synth else None
    if "run" in only:
        section_run(a.pagoda, synth_model)
    if "ppl" in only:
        section_ppl(a.pagoda)
    if "batch" in only:
        section_batch(a.pagoda, synth_model, batch_models, [int(x) for x in a.batch_sizes.split(",")])
    if "prefix" in only:
        section_prefix(a.pagoda)


if __name__ == "__main__":
    main()
