#!/usr/bin/env bash
# Serving benchmark: starts `pagoda serve` on MODEL (a free loopback port),
# drives it with bench/serve/loadgen.mjs at 1, 8 and 32 concurrent clients,
# then measures time to first token of a long prompt on a prefix-cache miss
# and on a hit; prints each result as JSON and a markdown table at the end.
#
# Usage: scripts/serve_bench.sh MODEL [options] [-- extra pagoda serve flags]
#   --requests N       requests per client (default 4)
#   --max-tokens N     tokens generated per request (default 64)
#   --prompt-chars N   prompt length in characters (default 400)
#   --long-chars N     the long prompt of the prefix test (default 3500)
#   --trials N         prompts in the prefix test (default 5)
#   --clients "1 8 32" concurrency levels
# Environment: PAGODA (the binary, default build/release/pagoda).
set -euo pipefail
cd "$(dirname "$0")/.."

model=${1:?usage: scripts/serve_bench.sh MODEL [options] [-- serve flags]}
shift
requests=4 max_tokens=64 prompt_chars=400 long_chars=3500 trials=5 clients="1 8 32"
serve_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) requests=$2; shift 2 ;;
    --max-tokens) max_tokens=$2; shift 2 ;;
    --prompt-chars) prompt_chars=$2; shift 2 ;;
    --long-chars) long_chars=$2; shift 2 ;;
    --trials) trials=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --) shift; serve_flags=("$@"); break ;;
    *) echo "serve_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
pagoda=${PAGODA:-build/release/pagoda}
[ -x "$pagoda" ] || { echo "serve_bench: $pagoda not built (make build, or set PAGODA)" >&2; exit 1; }

log=$(mktemp)
out=$(mktemp)
"$pagoda" serve -m "$model" --host 127.0.0.1 --port 0 "${serve_flags[@]}" >"$out" 2>"$log" &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -f "$log" "$out"' EXIT
for _ in $(seq 600); do
  grep -q "listening on" "$out" && break
  kill -0 $server 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.1
done
url=$(grep -o 'http://[^ ]*' "$out")
echo "serve_bench: $(head -1 "$log")" >&2
echo "serve_bench: $url" >&2

results=()
for c in $clients; do
  r=$(node bench/serve/loadgen.mjs --url "$url" --mode load --concurrency "$c" --requests "$requests" \
        --max-tokens "$max_tokens" --prompt-chars "$prompt_chars")
  echo "$r"
  results+=("$r")
done
p=$(node bench/serve/loadgen.mjs --url "$url" --mode prefix --prompt-chars "$long_chars" --trials "$trials")
echo "$p"

printf '%s\n' "${results[@]}" "$p" | node -e '
const lines = require("fs").readFileSync(0, "utf8").trim().split("\n").map(JSON.parse);
const load = lines.filter((l) => l.mode === "load");
const base = load.find((l) => l.concurrency === 1) || load[0];
console.log("\n| clients | requests | prompt tok | gen tok/s | x 1 client | prompt+gen tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |");
console.log("|---|---|---|---|---|---|---|---|");
for (const l of load)
  console.log(`| ${l.concurrency} | ${l.requests} | ${l.mean_prompt_tokens} | ${l.output_tokens_per_s} | ` +
    `${(l.output_tokens_per_s / base.output_tokens_per_s).toFixed(1)} | ${l.total_tokens_per_s} | ${l.ttft_p50_ms} / ${l.ttft_p99_ms} | ` +
    `${l.itl_p50_ms} / ${l.itl_p99_ms} |`);
for (const p of lines.filter((l) => l.mode === "prefix"))
  console.log(`\nLong prompt (${p.prompt_tokens} tokens, ${p.trials} prompts): TTFT p50 miss ${p.ttft_miss_p50_ms} ms, ` +
    `hit ${p.ttft_hit_p50_ms} ms (${p.cached_tokens_on_hit} tokens cached): miss/hit = ${p.miss_over_hit}x`);
'
