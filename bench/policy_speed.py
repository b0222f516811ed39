#!/usr/bin/env python3
"""KV policies through the engine: decode speed and memory (issue 12, "Measuring").

Three parts, each a section of bench/RESULTS.md ("KV policies: speed and memory"):

  speed   decode at long context on a synthetic Llama-3-8B-shaped model (1 layer,
          q8_0 weights, f16 KV) through `pagoda serve`: full attention against
          quest (budget 1/8 of the blocks) and retrieval (HNSW, IVF-PQ: k = 128
          keys per query row + 4 sinks + 64 recent slots). One server per
          context; the prompt (random token ids) is computed once, by a
          full-attention request, and every later request takes it from the
          prefix cache, so a request's first token costs one block of compute
          (plus, for retrieval, building its index over every cached key).
          Requests of every variant alternate in rounds in the same server, so
          each ratio is taken within one run. Decode time per token is measured
          on the client from the streamed tokens (first token excluded), and the
          attention time per step is the decode time minus that of a request
          with a 64-token prompt in the same round (weights, logits, sampling).
  memory  KV blocks a 32K-token sequence holds with window, h2o and snapkv at a
          25% budget against full KV: one server per policy, prefix caching off,
          the pool's used blocks read from /metrics halfway through decode, and
          the pool's peak (prefill included).
  load    `pagoda batch`: 64 long requests, a pool that holds 16 of them at full
          KV; full KV against h2o and window at 25%: generated tok/s, peak
          running sequences, preemptions (the batch summary).

usage: bench/policy_speed.py [--pagoda build/release/pagoda] [--parts speed,memory,load]
                             [--contexts 32768,131072] [--rounds 3] [--threads 1]

Prints markdown tables (and --json FILE writes every raw figure). The machine
is shared: the load average is printed before and after each part.
"""
import argparse
import http.client
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The variants of the speed part: (label, kv_policy).
SPEED_VARIANTS = [
    ("full", "none"),
    ("quest 1/8", "quest:budget=0.125"),
    ("retrieval HNSW", "retrieval:index=hnsw"),
    ("retrieval IVF-PQ", "retrieval:index=ivfpq"),
]
MEMORY_POLICIES = ["none", "window:budget=0.25", "h2o:budget=0.25", "snapkv:budget=0.25"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def load_average():
    return os.getloadavg()


def children_cpu_s():
    import resource
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def sh(args):
    """Runs a command; returns its result with .cpu_s, the CPU time it took."""
    cpu0 = children_cpu_s()
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{r.stderr}")
    r.cpu_s = children_cpu_s() - cpu0
    return r


def synth(pagoda, path, preset, layers, ctx, weight_type):
    if not os.path.exists(path):
        log(f"writing {path}")
        args = [pagoda, "synth", "--preset", preset, "--vocab", "512", "--weight-type", weight_type, "--ctx", str(ctx),
                "-o", path]
        if layers:
            args += ["--layers", str(layers)]
        sh(args)
    return path


def random_prompt(n, seed, vocab=512):
    # Ids 3.. (0-2 are <unk>, <s>, </s> in the synth vocabularies).
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# CPU time by kind, from perf samples of the decode: a symbol's kind is the
# first pattern it matches.
SYMBOL_KINDS = [
    ("selection", r"quest|hnswlib|retrieval|l2sq|mips_l2|faiss|key_summary_of|select_reads|ivfpq|key_index|top_k|"
                  r"exact_index|scattered"),
    ("attention", r"float_kv|paged_attention|gather_attention|softmax_unnormalized|gather_tiles|visible_slots|"
                  r"column_of|plan_reads|row_weights|append_slots_of_ranges|run_qk|run_av|decode_kv_rows|codec|"
                  r"score_key_rows"),
    ("weights", r"matmul|quant_cols|dequantize|rms_norm|silu_mul|add_inplace|vec_dot|rope"),
]


class perf_recorder:
    """`perf record` attached to a process, sampling only between enable() and
    disable() (perf's control FIFOs); shares() gives the fraction of samples per
    kind (SYMBOL_KINDS, and "other")."""

    def __init__(self, pid, path):
        self.path = path
        self.ctl, self.ack = path + ".ctl", path + ".ack"
        for fifo in (self.ctl, self.ack):
            if os.path.exists(fifo):
                os.remove(fifo)
            os.mkfifo(fifo)
        self.proc = subprocess.Popen(["perf", "record", "-F", "999", "-D", "-1", "--control",
                                      f"fifo:{self.ctl},{self.ack}", "-o", path, "-p", str(pid)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ctl_f = open(self.ctl, "w")
        self.ack_f = open(self.ack)
        self.command("disable")  # answered once perf is attached

    def command(self, cmd):
        self.ctl_f.write(cmd + "\n")
        self.ctl_f.flush()
        self.ack_f.readline()

    def enable(self):
        self.command("enable")

    def stop(self):
        self.command("disable")
        self.ctl_f.close()
        self.ack_f.close()
        self.proc.send_signal(2)
        self.proc.wait()
        for fifo in (self.ctl, self.ack):
            os.remove(fifo)

    def shares(self):
        out = subprocess.run(["perf", "report", "-i", self.path, "--stdio", "--no-children", "--sort", "symbol"],
                             capture_output=True, text=True).stdout
        kinds = dict.fromkeys([k for k, _ in SYMBOL_KINDS] + ["other"], 0.0)
        for line in out.splitlines():
            m = re.match(r"^\s+([\d.]+)%\s+\[[.k]\]\s+(.*)$", line)
            if not m:
                continue
            kind = next((k for k, pat in SYMBOL_KINDS if re.search(pat, m.group(2))), "other")
            kinds[kind] += float(m.group(1)) / 100
        return kinds


def have_perf():
    try:
        return subprocess.run(["perf", "--version"], capture_output=True).returncode == 0
    except OSError:
        return False


class server:
    """A `pagoda serve` process on a free port; its stderr goes to log_path."""

    def __init__(self, pagoda, args, log_path):
        self.port = free_port()
        self.log = open(log_path, "w")
        cmd = [pagoda, "serve", "--port", str(self.port), "--no-auth", "--log-stats-interval", "0"] + args
        log("$ " + " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"pagoda serve exited ({self.proc.returncode}); see {log_path}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        sys.exit(f"pagoda serve did not answer /health; see {log_path}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def metrics(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r'^([a-z_:]+)(\{[^}]*\})? ([-+0-9.eE]+|NaN|\+Inf)$', line)
            if m:  # labels without model_name: 'pagoda:kv_cache_blocks{state="used"}'
                labels = re.sub(r'model_name="[^"]*",?', "", m.group(2) or "").replace("{}", "")
                out[m.group(1) + labels] = float(m.group(3))
        return out

    def cpu_s(self):
        """The server's CPU time so far, every thread (schedstat: nanoseconds)."""
        total = 0
        task_dir = f"/proc/{self.proc.pid}/task"
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass  # a thread that just ended
        return total * 1e-9

    def stream(self, prompt, max_tokens, kv_policy, on_token=None, salt=None, perf_path=None):
        """One streamed greedy completion. Returns, per token, its arrival time
        (from the request's start) and the server's CPU time then, and the usage;
        with perf_path, the CPU shares of the decode (first token to last) by kind."""
        perf = perf_recorder(self.proc.pid, perf_path) if perf_path else None
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "kv_policy": kv_policy, "logprobs": 0,
                "return_tokens_as_token_ids": True}
        if salt:
            body["cache_salt"] = salt
        data = json.dumps(body)
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=36000)
        cpu0 = self.cpu_s()
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            sys.exit(f"HTTP {r.status}: {r.read()[:500]!r}")
        times, cpu, usage = [], [], None
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                sys.exit(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                # One chunk a step; logprobs list its tokens (text may be empty).
                n = len((ch.get("logprobs") or {}).get("tokens") or [])
                if not n:
                    continue
                now, now_cpu = time.perf_counter() - t0, self.cpu_s() - cpu0
                times.extend([now] * n)
                cpu.extend([now_cpu] * n)
                if perf and len(times) == n:
                    perf.enable()
                if on_token:
                    on_token(len(times))
        if perf:
            perf.stop()
        result = stream_result(times, cpu, usage)
        result.shares = perf.shares() if perf else None
        return result


class stream_result:
    def __init__(self, times, cpu, usage):
        self.times, self.cpu, self.usage = times, cpu, usage
        self.first_token_s = times[0]
        self.first_token_cpu_s = cpu[0]
        # Tokens 2..n: the first token's time is the prompt's (and any index build).
        n = max(len(times) - 1, 1)
        self.decode_s = (times[-1] - times[0]) / n
        self.decode_cpu_s = (cpu[-1] - cpu[0]) / n
        self.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]

    def as_dict(self):
        return {"first_token_s": self.first_token_s, "first_token_cpu_s": self.first_token_cpu_s,
                "decode_s_per_token": self.decode_s, "decode_cpu_s_per_token": self.decode_cpu_s,
                "cached_tokens": self.cached_tokens, "cpu_shares": getattr(self, "shares", None)}


# --- prefill into the disk store ----------------------------------------------------------


def speed_model(a):
    return synth(a.pagoda, os.path.join(a.workdir, "llama3-8b-1l-q8.gguf"), "llama3-8b", 1, max(a.contexts) + 4096,
                 "q8_0")


def part_prefill(a, results):
    """Computes the speed part's prompts once with `pagoda batch` and keeps their
    KV in the disk store (--kv-store), so that servers started later (and runs
    of this script after a restart) load them instead of computing them: a
    128K-token prefill of this model costs about an hour of CPU time."""
    model = speed_model(a)
    for ctx in a.contexts:
        path = os.path.join(a.workdir, f"prefill-{ctx}.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"id": ctx, "prompt": random_prompt(ctx, seed=ctx), "max_tokens": 1, "temperature": 0,
                                "ignore_eos": True}) + "\n")
        cmd = [a.pagoda, "batch", "-m", model, "-i", path, "-o", os.devnull, "--json-summary", "-t",
               str(a.prefill_threads), "--kv-cache-dtype", "f16", "--max-kv-tokens", str(ctx + 1024), "--ctx",
               str(ctx + a.gen + 64), "--kv-store", store_arg(a)]
        load0 = load_average()
        t0 = time.time()
        log("$ " + " ".join(cmd))
        r = sh(cmd)
        summary = json.loads(r.stderr.strip().splitlines()[-1])
        log(f"prefill {ctx}: {time.time() - t0:.0f} s (CPU {r.cpu_s:.0f} s), {summary['computed_prompt_tokens']} "
            f"tokens computed, load average {load0} -> {load_average()}")
        results.setdefault("prefill", []).append({"ctx": ctx, "seconds": time.time() - t0, "cpu_s": r.cpu_s,
                                                  "summary": summary, "load": [load0, load_average()]})


def store_arg(a):
    return os.path.join(a.workdir, "kvstore") + ",size=4"


# --- speed ----------------------------------------------------------------------------


def speed_variants(a):
    """SPEED_VARIANTS, those --variants names (full and any others), retrieval
    specs with --retrieval-params appended."""
    out = []
    for label, spec in SPEED_VARIANTS:
        if a.variants and label != "full" and label not in a.variants:
            continue
        if spec.startswith("retrieval") and a.retrieval_params:
            spec += "," + a.retrieval_params
        out.append((label, spec))
    return out


def part_speed(a, results):
    model = speed_model(a)
    short = random_prompt(64, seed=7)
    for ctx in a.contexts:
        prompt = random_prompt(ctx, seed=ctx)
        pool = ctx + 64 + 4 * (a.gen + 32)
        args = ["-m", model, "-t", str(a.threads), "--kv-cache-dtype", "f16", "--kv-policy", "quest:budget=0.125",
                "--max-kv-tokens", str(pool), "--max-num-seqs", "1", "--ctx", str(ctx + a.gen + 64)]
        args += ["--kv-store", store_arg(a)] if a.kv_store else ["--no-kv-store"]
        load0 = load_average()
        srv = server(a.pagoda, args, os.path.join(a.workdir, f"serve-speed-{ctx}.log"))
        try:
            log(f"ctx {ctx}: the prompt (computed, or loaded from the disk store)")
            first = srv.stream(prompt, 2, "none")
            entry = {"ctx": ctx, "first": first.as_dict(), "rounds": []}
            log(f"ctx {ctx}: prompt ready in {first.first_token_s:.1f} s ({first.cached_tokens} tokens cached)")
            for rnd in range(a.rounds):
                row = {}
                for label, spec in [("short", "none")] + speed_variants(a):
                    if spec.startswith("retrieval") and rnd >= a.retrieval_rounds:
                        continue  # an index build per request: minutes to hours on a loaded machine
                    perf_path = os.path.join(a.workdir, "perf-decode.data") if a.perf else None
                    r = srv.stream(short if label == "short" else prompt, a.gen, spec, perf_path=perf_path)
                    row[label] = r.as_dict()
                    shares = " ".join(f"{k} {100 * v:.0f}%" for k, v in (r.shares or {}).items())
                    log(f"ctx {ctx} round {rnd}: {label:18s} first token {r.first_token_s:8.2f} s "
                        f"(CPU {r.first_token_cpu_s:8.2f}), decode {1e3 * r.decode_s:8.2f} ms/token "
                        f"(CPU {1e3 * r.decode_cpu_s:8.2f}), cached {r.cached_tokens}; {shares}")
                entry["rounds"].append(row)
        finally:
            srv.stop()
        entry["load"] = [load0, load_average()]
        results.setdefault("speed", []).append(entry)
        save(a, results)
    print_speed(results["speed"])


def per_round(entry, fn, label):
    """The median over the rounds that ran `label` of fn(round)."""
    return statistics.median(fn(r) for r in entry["rounds"] if label in r)


def attention_cpu_s(r, label):
    """Attention CPU seconds per decode step (reading KV plus, for sparse
    variants, selecting what to read): perf's share of the decode's CPU time
    when recorded, else the CPU time beyond the 64-token-prompt request's."""
    x = r[label]
    if x.get("cpu_shares"):
        return x["decode_cpu_s_per_token"] * (x["cpu_shares"]["attention"] + x["cpu_shares"]["selection"])
    return x["decode_cpu_s_per_token"] - r["short"]["decode_cpu_s_per_token"]


def print_speed(entries):
    print("### Decode at long context: full attention against quest and retrieval\n")
    print("Medians over the rounds that ran the variant (n); every ratio is taken within one round (same server, "
          "minutes apart), then the median of those.\n")
    print("| context | variant | n | decode tok/s (wall) | CPU ms / token | attention CPU ms / step (reading + "
          "selecting) | attention speed-up (CPU) | decode speed-up (wall / CPU) | first token s, cached prompt "
          "(wall / CPU) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for e in entries:
        for label, _ in SPEED_VARIANTS:
            n = sum(label in r for r in e["rounds"])
            if not n:
                continue
            med = lambda fn: per_round(e, fn, label)  # noqa: E731
            attn_x = med(lambda r: attention_cpu_s(r, "full") / max(attention_cpu_s(r, label), 1e-9))
            wall_x = med(lambda r: r["full"]["decode_s_per_token"] / r[label]["decode_s_per_token"])
            cpu_x = med(lambda r: r["full"]["decode_cpu_s_per_token"] / r[label]["decode_cpu_s_per_token"])
            split = ""
            if all(r[label].get("cpu_shares") for r in e["rounds"] if label in r):
                sel = med(lambda r: r[label]["decode_cpu_s_per_token"] * r[label]["cpu_shares"]["selection"])
                read = med(lambda r: r[label]["decode_cpu_s_per_token"] * r[label]["cpu_shares"]["attention"])
                split = f" ({1e3 * read:.1f} + {1e3 * sel:.1f})"
            print(f"| {e['ctx']:,} | {label} | {n} | {1 / med(lambda r: r[label]['decode_s_per_token']):.2f} | "
                  f"{1e3 * med(lambda r: r[label]['decode_cpu_s_per_token']):.1f} | "
                  f"{1e3 * med(lambda r: attention_cpu_s(r, label)):.1f}{split} | {attn_x:.2f}x | "
                  f"{wall_x:.2f}x / {cpu_x:.2f}x | {med(lambda r: r[label]['first_token_s']):.2f} / "
                  f"{med(lambda r: r[label]['first_token_cpu_s']):.2f} |")
        med = lambda fn: per_round(e, fn, "short")  # noqa: E731
        print(f"| {e['ctx']:,} | (64-token prompt) | {len(e['rounds'])} | "
              f"{1 / med(lambda r: r['short']['decode_s_per_token']):.2f} | "
              f"{1e3 * med(lambda r: r['short']['decode_cpu_s_per_token']):.1f} | "
              f"{1e3 * med(lambda r: attention_cpu_s(r, 'short')):.1f} | | | |")
    for e in entries:
        print(f"\nContext {e['ctx']:,}: the prompt was ready after {e['first']['first_token_s']:.1f} s "
              f"({e['first']['cached_tokens']} tokens from the prefix cache or the disk store); "
              f"load average {e['load'][0][0]:.1f} before, {e['load'][1][0]:.1f} after.")
    print()


# --- memory ---------------------------------------------------------------------------


def part_memory(a, results):
    model = speed_model(a)
    ctx = a.memory_ctx
    prompt = random_prompt(ctx, seed=ctx)
    rows = []
    for spec in (a.memory_policies.split(";") if a.memory_policies else MEMORY_POLICIES):
        args = ["-m", model, "-t", str(a.threads), "--kv-cache-dtype", "f16", "--max-kv-tokens",
                str(a.memory_pool_tokens or ctx + 4 * (a.gen + 32)), "--max-num-seqs", "1", "--ctx", str(ctx + a.gen + 64),
                "--no-enable-prefix-caching", "--no-kv-store"]
        load0 = load_average()
        tag = re.sub(r"[^A-Za-z0-9.=_-]+", "_", spec)
        srv = server(a.pagoda, args, os.path.join(a.workdir, f"serve-memory-{tag}.log"))
        held = {}

        def on_token(n):
            if n == a.gen // 2:
                held.update(srv.metrics())
        try:
            r = srv.stream(prompt, a.gen, spec, on_token=on_token)
            end = srv.metrics()
        finally:
            srv.stop()
        row = {"policy": spec, **r.as_dict(),
               "blocks_held": held['pagoda:kv_cache_blocks{state="used"}'],
               "blocks_peak": end["pagoda:kv_cache_blocks_used_peak"],
               "side_blocks_peak": end.get("pagoda:kv_side_blocks_peak", 0),
               "block_size": end["pagoda:kv_cache_block_size_tokens"], "load": [load0, load_average()]}
        log(f"memory {spec}: {row}")
        rows.append(row)
    results["memory"] = {"ctx": ctx, "gen": a.gen, "rows": rows}
    print_memory(results["memory"])


def print_memory(m):
    rows = m["rows"]
    full = rows[0]
    print(f"### KV held by one {m['ctx']:,}-token sequence (f16 KV, synth Llama-3-8B shapes, 1 layer)\n")
    print("| policy | blocks held at decode token " + str(m["gen"] // 2) + " | vs full | peak blocks (prefill included) | "
          "vs full | of them side (peak) | prefill s | decode ms / token | decode speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['blocks_held']:.0f} | {r['blocks_held'] / full['blocks_held']:.3f} | "
              f"{r['blocks_peak']:.0f} | {r['blocks_peak'] / full['blocks_peak']:.3f} | "
              f"{r.get('side_blocks_peak', 0):.0f} | {r['first_token_s']:.1f} | "
              f"{1e3 * r['decode_s_per_token']:.1f} | {full['decode_s_per_token'] / r['decode_s_per_token']:.2f}x |")
    print(f"\nLoad average {rows[0]['load'][0][0]:.1f} at the start, {rows[-1]['load'][1][0]:.1f} at the end.\n")


# --- load -----------------------------------------------------------------------------


def part_load(a, results):
    model = synth(a.pagoda, os.path.join(a.workdir, "tiny-4k.gguf"), "tiny", 0, a.load_prompt + a.load_gen, "q8_0")
    per_req = a.load_prompt + a.load_gen
    path = os.path.join(a.workdir, "load.jsonl")
    with open(path, "w") as f:
        for i in range(a.load_requests):
            f.write(json.dumps({"id": i, "prompt": random_prompt(a.load_prompt, seed=1000 + i), "max_tokens": a.load_gen,
                                "temperature": 0, "ignore_eos": True}) + "\n")
    rows = []
    for rnd in range(a.load_rounds):
        for spec in a.load_policies:
            load0 = load_average()
            cmd = [a.pagoda, "batch", "-m", model, "-i", path, "-o", os.devnull, "--json-summary", "-t", str(a.threads),
                   "--kv-cache-dtype", "f16", "--max-kv-tokens", str(a.load_fit * per_req), "--max-num-seqs",
                   str(a.load_requests), "--kv-policy", spec]
            log("$ " + " ".join(cmd))
            r = sh(cmd)
            summary = json.loads(r.stderr.strip().splitlines()[-1])
            summary.update({"policy": spec, "round": rnd, "cpu_s": r.cpu_s, "load": [load0, load_average()]})
            log(f"load {spec}: {summary['generation_tokens_per_s']:.1f} tok/s, peak running {summary['peak_running']}, "
                f"preemptions {summary['preemptions']}")
            rows.append(summary)
    results["load"] = {"requests": a.load_requests, "prompt": a.load_prompt, "gen": a.load_gen, "fit": a.load_fit,
                       "rows": rows}
    print_load(results["load"])


def print_load(l):
    rows = l["rows"]
    print(f"### {l['requests']} requests of {l['prompt']} + {l['gen']} tokens, a pool for {l['fit']} at full KV\n")
    print("| policy | generated tok/s | vs full | peak running | preemptions | peak blocks / pool | seconds |")
    print("|---|---|---|---|---|---|---|")
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    full = [r for r in rows if r["policy"] == policies[0]]
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        ratio = statistics.median(m["generation_tokens_per_s"] / f["generation_tokens_per_s"] for m, f in zip(mine, full))
        print(f"| {p} | {statistics.median(m['generation_tokens_per_s'] for m in mine):.1f} | {ratio:.2f}x | "
              f"{max(m['peak_running'] for m in mine)} | {'/'.join(str(m['preemptions']) for m in mine)} | "
              f"{max(m['peak_blocks_used'] for m in mine)}/{mine[0]['blocks_total']} | "
              f"{statistics.median(m['seconds'] for m in mine):.1f} |")
    print(f"\nLoad average {rows[0]['load'][0][0]:.1f} at the start, {rows[-1]['load'][1][0]:.1f} at the end.\n")


def save(a, results):
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pagoda", default=os.path.join(ROOT, "build", "release", "pagoda"))
    p.add_argument("--workdir", default="/tmp/pagoda-policy-speed", help="models, logs, request files")
    p.add_argument("--parts", default="speed,memory,load")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", default="32768,131072", help="speed: prompt lengths")
    p.add_argument("--rounds", type=int, default=3, help="speed: rounds of every variant")
    p.add_argument("--retrieval-rounds", type=int, default=1,
                   help="speed: rounds that run the retrieval variants (each builds its index over the whole prompt)")
    p.add_argument("--gen", type=int, default=64, help="speed, memory: tokens generated per request")
    p.add_argument("--variants", default="",
                   help="speed: the variants to run besides full, by label, ';'-separated (default: all)")
    p.add_argument("--retrieval-params", default="", help="speed: appended to each retrieval spec (e.g. nprobe=8)")
    p.add_argument("--kv-store", action="store_true",
                   help="speed: keep the prompts' KV on disk, so a second run skips the cold prefill")
    p.add_argument("--prefill-threads", type=int, default=2, help="prefill: threads of the batch that fills the store")
    p.add_argument("--no-perf", dest="perf", action="store_false",
                   help="speed: skip perf's split of the decode's CPU time (attention, selection, weights)")
    p.add_argument("--memory-ctx", type=int, default=32768)
    p.add_argument("--memory-pool-tokens", type=int, default=0,
                   help="memory: the KV pool in tokens (default: the context and 4 x (gen + 32)); admission "
                        "counts a policy's side memory for the whole sequence")
    p.add_argument("--memory-policies", default="",
                   help="memory: the kv_policy specs to compare, ';'-separated (default: none and window, h2o, snapkv at 25%%)")
    p.add_argument("--load-requests", type=int, default=64)
    p.add_argument("--load-fit", type=int, default=16, help="requests the pool holds at full KV")
    p.add_argument("--load-prompt", type=int, default=3072)
    p.add_argument("--load-gen", type=int, default=1024)
    p.add_argument("--load-rounds", type=int, default=1)
    p.add_argument("--load-policies",
                   default="none;h2o:budget=0.25;window:budget=0.25;h2o:budget=0.25,slack=0;window:budget=0.25,slack=0",
                   help="load: policies separated by ';' (slack=0: a sequence never holds more than its budget; "
                        "by default up to one block more)")
    p.add_argument("--json", help="write every raw figure here")
    a = p.parse_args()
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.variants = [x for x in a.variants.split(";") if x]
    a.perf = a.perf and have_perf()
    a.load_policies = a.load_policies.split(";")
    os.makedirs(a.workdir, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a).copy()}
    parts = a.parts.split(",")
    for name, fn in [("prefill", part_prefill), ("speed", part_speed), ("memory", part_memory), ("load", part_load)]:
        if name in parts:
            log(f"--- {name}: load average {load_average()}")
            fn(a, results)
            save(a, results)


if __name__ == "__main__":
    main()
