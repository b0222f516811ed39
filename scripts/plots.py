#!/usr/bin/env python3
"""Turns the benchmark tables of bench/RESULTS.md (and bench/history/*.md) into SVG plots.

usage: scripts/plots.py [--out bench/plots]

Each plot reads one table, found by the heading above it (the first table
after that heading: the newest run of its section), so rerunning a benchmark
and recording its table is all it takes to redraw. Python's standard library
only (no plotting package): a small SVG writer below. Plots:

  kv_codecs_kl_vs_bits.svg     KL against stored bits per element, per KV codec (stories260K)
  decode_vs_context.svg        whole decode steps: tokens/s against context, per KV type
  batch_throughput.svg         pagoda batch: generated tok/s against concurrent sequences
  ttft_by_tier.svg             time to first token after a cold miss and from each store tier
  policy_quality_vs_budget.svg KV policies: KL against the budget kept
"""
import argparse
import glob
import html
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7", "#bab0ac"]


def read_results():
    files = [os.path.join(ROOT, "bench", "RESULTS.md")] + sorted(glob.glob(os.path.join(ROOT, "bench", "history", "*.md")))
    return "\n".join(open(f, encoding="utf-8").read() for f in files if os.path.exists(f))


def table_after(text, heading):
    """The first markdown table after the line `heading` (a heading's text, without its #s)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.lstrip("#").strip() == heading and line.startswith("#"):
            rows = []
            for line2 in lines[i + 1:]:
                if line2.startswith("|"):
                    cells = [c.strip() for c in line2.strip().strip("|").split("|")]
                    if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                        rows.append(cells)
                elif rows:
                    break
            if rows:
                return rows[0], rows[1:]
    sys.exit(f"plots.py: no table after the heading '{heading}' in bench/RESULTS.md or bench/history/")


def number(cell):
    """The first number of a cell ("35.77 (1.00x)" -> 35.77, "12.5%" -> 12.5, "1.65e-6" -> 1.65e-06)."""
    m = re.search(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", cell.replace(",", ""))
    return float(m.group(0)) if m else None


class chart:
    """One SVG chart: axes (linear or log), series of points as lines, markers or bars."""

    W, H, L, R, T, B = 820, 460, 78, 270, 46, 58

    def __init__(self, title, xlabel, ylabel, xlog=False, ylog=False):
        self.title, self.xlabel, self.ylabel, self.xlog, self.ylog = title, xlabel, ylabel, xlog, ylog
        self.series = []  # (name, [(x, y, label)], style)
        self.xticks = None  # [(x, text)] for categorical axes

    def add(self, name, points, style="line"):
        self.series.append((name, [p for p in points if p[1] is not None and (not self.ylog or p[1] > 0)], style))

    def _range(self, values, log):
        lo, hi = min(values), max(values)
        if log:
            lo, hi = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
            return lo, hi if hi > lo else lo + 1
        if lo > 0 and lo < 0.3 * hi:
            lo = 0
        pad = (hi - lo) * 0.06 or 1
        return lo - (pad if lo != 0 else 0), hi + pad

    def svg(self):
        xs = [p[0] for _, pts, _ in self.series for p in pts]
        ys = [p[1] for _, pts, _ in self.series for p in pts]
        x0, x1 = self._range(xs, self.xlog)
        n_bars = sum(1 for _, _, s in self.series if s == "bar")
        if n_bars:  # categories 0 .. n-1, each a group of bars
            x0, x1 = -0.5, max(xs) + 0.5
        y0, y1 = self._range(ys, self.ylog)
        pw, ph = self.W - self.L - self.R, self.H - self.T - self.B

        def px(x):
            v = math.log10(x) if self.xlog else x
            return self.L + pw * (v - x0) / (x1 - x0)

        def py(y):
            v = math.log10(y) if self.ylog else y
            return self.T + ph * (1 - (v - y0) / (y1 - y0))

        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.W}" height="{self.H}" font-family="sans-serif" font-size="12">',
               f'<rect width="{self.W}" height="{self.H}" fill="#fff"/>',
               f'<text x="{self.L}" y="24" font-size="15" font-weight="bold">{html.escape(self.title)}</text>']
        # Grid and ticks.
        def ticks(lo, hi, log):
            if log:
                return [10 ** e for e in range(int(lo), int(hi) + 1)]
            step = 10 ** math.floor(math.log10((hi - lo) / 5 or 1))
            for m in (1, 2, 5, 10):
                if (hi - lo) / (step * m) <= 7:
                    step *= m
                    break
            first = math.ceil(lo / step) * step
            return [first + i * step for i in range(int((hi - first) / step) + 1)]

        def fmt(v):
            if v == 0:
                return "0"
            if abs(v) >= 1e4 or abs(v) < 1e-2:
                return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
            return f"{v:g}"

        for t in ticks(y0, y1, self.ylog):
            y = py(t)
            out.append(f'<line x1="{self.L}" x2="{self.L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e6e6e6"/>')
            out.append(f'<text x="{self.L - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
        xt = self.xticks or [(t, fmt(t)) for t in ticks(x0, x1, self.xlog)]
        for t, text in xt:
            x = px(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{self.T}" y2="{self.T + ph}" stroke="#f0f0f0"/>')
            out.append(f'<text x="{x:.1f}" y="{self.T + ph + 16}" text-anchor="middle">{html.escape(text)}</text>')
        out.append(f'<rect x="{self.L}" y="{self.T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
        out.append(f'<text x="{self.L + pw / 2}" y="{self.H - 14}" text-anchor="middle">{html.escape(self.xlabel)}</text>')
        out.append(f'<text transform="translate(18,{self.T + ph / 2}) rotate(-90)" text-anchor="middle">{html.escape(self.ylabel)}</text>')
        # Series.
        bar_i = 0
        for i, (name, pts, style) in enumerate(self.series):
            c = COLOURS[i % len(COLOURS)]
            if style == "line" and len(pts) > 1:
                d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in pts)
                out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{d}"/>')
            for x, y, label in pts:
                if style == "bar":
                    slot = 0.8 / n_bars  # of a category's width (1)
                    bx = px(x - 0.4 + bar_i * slot)
                    bw = px(slot) - px(0)
                    base = py(10 ** y0) if self.ylog else py(max(y0, 0))
                    out.append(f'<rect x="{bx:.1f}" y="{py(y):.1f}" width="{bw:.1f}" height="{base - py(y):.1f}" fill="{c}"><title>{html.escape(name)}: {y:g}</title></rect>')
                else:
                    out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{c}"><title>{html.escape(label or name)}: {x:g}, {y:g}</title></circle>')
                    if label and style == "labelled":
                        out.append(f'<text x="{px(x) + 6:.1f}" y="{py(y) - 5:.1f}" font-size="10" fill="#444">{html.escape(label)}</text>')
            if style == "bar":
                bar_i += 1
            ly = self.T + 14 + 18 * i
            out.append(f'<rect x="{self.L + pw + 14}" y="{ly - 9}" width="12" height="12" fill="{c}"/>')
            out.append(f'<text x="{self.L + pw + 32}" y="{ly + 1}">{html.escape(name[:42])}</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"


def group_by(rows, key):
    """Rows in a dict by key(row), in first-seen order; rows whose key is None are left out."""
    out = {}
    for r in rows:
        k = key(r)
        if k is not None:
            out.setdefault(k, []).append(r)
    return out


def short_formats(formats):
    return formats.strip("`").replace("/channel", "/ch").replace("/token", "/tok").replace("/static", "/st")


# The rows of the codec table named on the plot (the others are points with a tooltip).
LABELLED = {"f16", "bf16", "fp8 e4m3, dynamic per token", "int8, per token (K and V)",
            "int8, per-channel K, per-token V", "K8V4, per-channel K", "int4 KIVI (per-channel K, per-token V)",
            "int4, per-token K and V", "int2 KIVI (per-channel K, per-token V)", "q8_0 (ggml, head_dim padded to 32)",
            "q4_0 (ggml, head_dim padded to 32)", "K8V4 static (p99.9)", "int4 static (p99.9 clip)"}


def kv_codecs(text):
    head, rows = table_after(text, "Quality: stories260K, `tests/data/tinystories_dev.txt`, `--ctx 512`")
    c = chart("KV codecs: quality against size (stories260K)", "stored bits per element (codes, scales, padding)",
              "mean KL to the exact cache (nats, log)", ylog=True)
    groups, seen = {}, set()
    for r in rows:
        kind = "static scales" if "static" in r[1] else "ggml q-formats" if "q4_0" in r[1] or "q8_0" in r[1] else \
            "per-channel K (KIVI)" if "/channel" in r[1] else "per token / float"
        point = (number(r[2]), number(r[6]))
        if point in seen:  # the same configuration under another name (K4V4 = int4 KIVI)
            continue
        seen.add(point)
        groups.setdefault(kind, []).append((*point, short_formats(r[1]) if r[0] in LABELLED else ""))
    for kind, pts in groups.items():
        c.add(kind, pts, "labelled")
    return c


def decode_vs_context(text):
    head, rows = table_after(text, "Whole decode steps at long context")
    contexts = [number(h) * 1024 for h in head[1:4]]
    c = chart("Whole decode step against context, 1 thread (synth Llama-3-8B shapes)", "context (tokens, log)",
              "decode tokens/s", xlog=True)
    c.xticks = [(x, f"{int(x / 1024)}K") for x in contexts]
    for r in rows:
        c.add(r[0], [(x, number(v), None) for x, v in zip(contexts, r[1:4])])
    return c


def batch_throughput(text):
    head, rows = table_after(text, "Continuous batching throughput (`pagoda batch`)")
    c = chart("Continuous batching: throughput against concurrency", "sequences at once (log)",
              "generated tokens/s (log)", xlog=True, ylog=True)
    for model, rs in group_by(rows, lambda r: r[0]).items():
        c.add(f"{model}: at once", [(number(r[2]), number(r[4]), None) for r in rs])
        c.add(f"{model}: one at a time", [(number(r[2]), number(r[3]), None) for r in rs])
    ns = sorted({number(r[2]) for r in rows})
    c.xticks = [(n, f"{n:g}") for n in ns]
    return c


def ttft_by_tier(text):
    head, rows = table_after(text, "Time to first token by tier")
    c = chart("Time to first token: cold prompt against each KV tier", "prompt tokens", "seconds (log)", ylog=True)
    xs = list(range(len(rows)))
    c.xticks = [(x, r[0]) for x, r in zip(xs, rows)]
    for col, name in [(1, "cold miss"), (2, "memory hit"), (3, "disk hit"), (4, "Redis hit")]:
        c.add(name, [(x, number(r[col]), None) for x, r in zip(xs, rows)], "bar")
    return c


def policy_quality(text):
    head, rows = table_after(text, "Quality under a budget")
    c = chart("KV policies: quality against budget (stories260K)", "budget kept (% of tokens, log)",
              "mean KL to full KV (nats, log)", xlog=True, ylog=True)
    # Rows with a budget in percent, on f16 KV (quest's row reads a fraction, keeps everything).
    by_policy = group_by(rows, lambda r: r[0] if r[1].endswith("%") and "f16" in r[2] else None)
    for name, rs in by_policy.items():
        c.add(name, sorted((number(r[1]), number(r[6]), None) for r in rs))
    budgets = sorted({number(r[1]) for rs in by_policy.values() for r in rs})
    c.xticks = [(b, f"{b:g}%") for b in budgets]
    return c


PLOTS = {"kv_codecs_kl_vs_bits.svg": kv_codecs, "decode_vs_context.svg": decode_vs_context,
         "batch_throughput.svg": batch_throughput, "ttft_by_tier.svg": ttft_by_tier,
         "policy_quality_vs_budget.svg": policy_quality}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "plots"))
    args = ap.parse_args()
    text = read_results()
    os.makedirs(args.out, exist_ok=True)
    for name, make in PLOTS.items():
        path = os.path.join(args.out, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(make(text).svg())
        print(f"plots.py: wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
