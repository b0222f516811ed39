#!/usr/bin/env python3
"""Cross-layer KV sharing: what `--kv-share reuse` and `minicache` cost in quality (issue 31).

`reuse:from=L` and `minicache:from=L` for every starting layer of stories260K (5 layers: from=0..4)
beside the KV codecs and the KV policies at about the same bytes per token,
so that one table says which saving costs least. Every row is one
`pagoda perplexity --truncate --kl-divergence --json` run on the dev text at
--ctx 512 (bench/policy_quality.py's method and cache of runs: each run scores
the configured cache and an exact, f32, full, unshared twin on the same steps).

Bytes per token are the layout's (`kv.bytes_per_token` of the run) times the
mean fraction of tokens a policy keeps; the "of f16" column divides by the
unshared f16 cache's. reuse:from=L keeps 5 - floor((5 - L) / 2) of the 5 KV
layers: 0.6 of the bytes at from=0 and 1, 0.8 at from=2 and 3, all at from=4
(nothing to pair: the unshared run). minicache keeps the same KV layers plus
its side data (per-slot ratios and 1/16 of the tokens retained: about 0.1 of
a merged layer at f16). The policies run at budgets 0.6 and 0.8
to match (policy_quality.py's setting: 16 tokens a step, slack=0).

usage: bench/kv_share_quality.py [--pagoda build/release/pagoda] [--docs N]
                                 [--jobs 2] [--out table.md] [--kinds codec,reuse,minicache,policy]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import policy_quality as pq  # noqa: E402

N_LAYERS = 5  # stories260K
POLICY_BUDGETS = [0.6, 0.8]
POLICIES = [("window", "window:positions=keep"), ("h2o", "h2o"), ("snapkv", "snapkv"), ("cluster", "cluster")]
# (label, --kv-cache-dtype)
CODECS = [("f16", "f16"), ("int8", "int8"), ("fp8 e4m3", "fp8"), ("K8V4", "k8v4"), ("int4 KIVI", "int4")]


def make_jobs(policy_step):
    jobs = []
    for label, dtype in CODECS:
        jobs.append(dict(kind="codec", name=f"KV type {label}", kv=label, dtype=dtype, spec="none", step=policy_step))
    for frm in range(N_LAYERS):
        jobs.append(dict(kind="reuse", name=f"reuse:from={frm}", kv="f16", dtype="f16", spec="none", step=policy_step,
                         share=f"reuse:from={frm}"))
    # MiniCache: the same pairs, one merged KV each (defaults t=0.6, retain=1/16), then its knobs at from=1.
    for frm in range(N_LAYERS):
        jobs.append(dict(kind="minicache", name=f"minicache:from={frm}", kv="f16", dtype="f16", spec="none",
                         step=policy_step, share=f"minicache:from={frm}"))
    for knob in ["retain=0", "retain=0.25", "t=0.5,retain=0"]:
        jobs.append(dict(kind="minicache", name=f"minicache:from=1,{knob}", kv="f16", dtype="f16", spec="none",
                         step=policy_step, share=f"minicache:from=1,{knob}"))
    # Sharing and a codec together: the two savings multiply.
    jobs.append(dict(kind="reuse", name="reuse:from=1 + int8", kv="int8", dtype="int8", spec="none", step=policy_step,
                     share="reuse:from=1"))
    # MiniCache over quantized KV: per-token int8, and sealed int4 (KIVI: per-channel keys, merged before sealing).
    for frm, label, dtype in [(1, "int8", "int8"), (3, "int8", "int8"), (1, "int4 KIVI", "int4"), (3, "int4 KIVI", "int4")]:
        jobs.append(dict(kind="minicache", name=f"minicache:from={frm} + {label}", kv=label, dtype=dtype, spec="none",
                         step=policy_step, share=f"minicache:from={frm}"))
    for b in POLICY_BUDGETS:
        for name, prefix in POLICIES:
            jobs.append(dict(kind="policy", name=f"{name} at {pq.percent(b)}", kv="f16", dtype="f16",
                             spec=pq.with_params(prefix, f"budget={b},slack=0"), step=policy_step))
    return jobs


def bytes_per_token(r):
    kept = r["kv_policy"]["mean_kept_fraction"] if "kv_policy" in r else 1.0
    return r["kv"]["bytes_per_token"] * kept


def table(jobs, results):
    f16 = next(bytes_per_token(r) for j, r in zip(jobs, results) if j["kind"] == "codec" and j["dtype"] == "f16")
    rows = sorted(zip(jobs, results), key=lambda jr: (-round(bytes_per_token(jr[1]) / f16, 2),
                                                      jr[1]["kl_divergence"]["mean_kl"]))
    lines = ["| saving | KV layout | bytes/token (of f16) | perplexity change % | mean KL (nats) | top-1 agreement % |",
             "|---|---|---|---|---|---|"]
    for j, r in rows:
        k = r["kl_divergence"]
        bpt = bytes_per_token(r)
        lines.append(f"| {j['name']} | `{r['kv']['layout']}` | {bpt:.0f} ({bpt / f16:.2f}) "
                     f"| {k['perplexity_change_percent']:+.3f} | {k['mean_kl']:.3e} | {100 * k['top1_agreement']:.2f} |")
    return "\n".join(lines)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pagoda", default=os.path.join(pq.ROOT, "build", "release", "pagoda"))
    ap.add_argument("--model", default=os.path.join(pq.ROOT, "models", "stories260K.gguf"))
    ap.add_argument("--text", default=os.path.join(pq.ROOT, "tests", "data", "tinystories_dev.txt"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--docs", type=int, default=0, help="the first N documents only (0: all)")
    ap.add_argument("--policy-step", type=int, default=16, help="tokens a step (every row, as policy_quality.py)")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="documents scored at once (speed only)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (a shared 2-core machine: at most 2)")
    ap.add_argument("--results", default=os.path.join(pq.ROOT, "build", "policy_quality"), help="cache of runs")
    ap.add_argument("--out", default="", help="write the table here (default: stdout)")
    ap.add_argument("--kinds", default="codec,reuse,minicache,policy",
                    help="which rows to run: comma-separated of codec, reuse, minicache, policy (codec f16 always)")
    return ap.parse_args()


def main():
    args = parse_args()
    if not os.access(args.pagoda, os.X_OK):
        sys.exit(f"kv_share_quality: no {args.pagoda} (build first)")
    kinds = set(args.kinds.split(","))
    jobs = [j for j in make_jobs(args.policy_step) if j["kind"] in kinds or (j["kind"] == "codec" and j["dtype"] == "f16")]
    results = pq.run_jobs(args, jobs, pq.documents(args), range(len(jobs)))
    pq.write_out(args, table(jobs, results))


if __name__ == "__main__":
    main()
