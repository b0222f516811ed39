#!/usr/bin/env bash
# The KV quantization quality table of bench/RESULTS.md (issue 4): every codec
# and the K/V mixes on stories260K, dev text, --ctx 512. Each row is one
# `pagoda perplexity --kl-divergence` run, which scores the exact (f32) KV cache
# and the configured one in the same run.
#
#   scripts/kv_quality_table.sh [BUILD_DIR] > table.md
#
# Columns: bits per stored element (codes + scales + padding, without the f16
# window), bytes per token (all layers, K and V), the f16 window a sequence
# holds for sealed formats, perplexity change against f32 KV, mean KL(exact ||
# quantized) in nats per token, and top-1 agreement of the next-token argmax.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
pagoda="$build/pagoda"
model="$root/models/stories260K.gguf"
text="$root/tests/data/tinystories_dev.txt"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

[ -x "$pagoda" ] || { echo "kv_quality_table: no $pagoda (build first)" >&2; exit 1; }

# Static scales: exact ranges and 99.9th-percentile clipping.
"$pagoda" calibrate -m "$model" -f "$text" --ctx 512 -o "$work/max.json" 2>/dev/null
"$pagoda" calibrate -m "$model" -f "$text" --ctx 512 --clip p99.9 -o "$work/p999.json" 2>/dev/null

row() {  # row LABEL ARGS...
  local label="$1"
  shift
  "$pagoda" perplexity -m "$model" -f "$text" --ctx 512 --truncate --kl-divergence --json "$@" 2>/dev/null |
    node -e '
      let s = ""; process.stdin.on("data", d => s += d).on("end", () => {
        const j = JSON.parse(s), k = j.kl_divergence, kv = j.kv;
        const fmt = (x, n) => x.toFixed(n);
        console.log(`| ${process.argv[1]} | \`${kv.layout}\` | ${fmt(kv.bits_per_element, 2)} | ${fmt(kv.bytes_per_token, 0)} | ` +
                    `${kv.staging_bytes_per_sequence} | ${k.perplexity_change_percent >= 0 ? "+" : ""}${fmt(k.perplexity_change_percent, 3)} | ` +
                    `${k.mean_kl.toExponential(2)} | ${fmt(100 * k.top1_agreement, 2)} |`);
      });' "$label"
}

echo "| configuration | formats (K+V) | bits/element | bytes/token | f16 window (B/seq) | perplexity change % | mean KL (nats) | top-1 agreement % |"
echo "|---|---|---|---|---|---|---|---|"
row "f32 (reference)" --kv-cache-dtype f32
row "f16" --kv-cache-dtype f16
row "bf16" --kv-cache-dtype bf16
row "fp8 e4m3, dynamic per token" --kv-cache-dtype fp8
row "fp8 e4m3, scale 1 (vLLM default)" --kv-cache-dtype fp8/none
row "fp8 e5m2, dynamic per token" --kv-cache-dtype fp8_e5m2
row "int8, per token (K and V)" --kv-cache-dtype int8
row "int8, per-channel K, per-token V" --kv-cache-dtype int8/channel+int8
row "int8, per channel (K and V)" --kv-cache-dtype int8/channel
row "int8, groups of 4 channels" --kv-cache-dtype int8/g4
row "int4 KIVI (per-channel K, per-token V)" --kv-cache-dtype int4
row "int4, per-token K and V" --kv-cache-dtype int4/token
row "int2 KIVI (per-channel K, per-token V)" --kv-cache-dtype int2
row "int2, per-token K and V" --kv-cache-dtype int2/token
row "q8_0 (ggml, head_dim padded to 32)" --kv-cache-dtype q8_0
row "q4_0 (ggml, head_dim padded to 32)" --kv-cache-dtype q4_0
row "q8_0 K + q4_0 V" --kv-cache-dtype q8_0+q4_0
row "q4_0 K alone" --kv-cache-dtype q4_0+f32
row "K8V4, per-token K" --kv-cache-dtype k8v4
row "K8V4, per-channel K" --kv-cache-dtype int8/channel+int4
row "K4V2, per-channel K" --kv-cache-dtype k4v2
row "K4V2, per-token K" --kv-cache-dtype int4/token+int2
row "K8V2, per-token K" --kv-cache-dtype k8v2
row "K8V2, per-channel K" --kv-cache-dtype int8/channel+int2
row "K4V4, per-channel K (= int4 KIVI)" --kv-cache-dtype k4v4
row "K4V4, per-token K" --kv-cache-dtype int4/token+int4
row "int4 KIVI, block 64" --kv-cache-dtype int4 --block-size 64
row "int2 KIVI, block 64" --kv-cache-dtype int2 --block-size 64
row "int8 static (exact ranges)" --kv-cache-dtype int8 --kv-scales "$work/max.json"
row "int8 static (p99.9 clip)" --kv-cache-dtype int8 --kv-scales "$work/p999.json"
row "fp8 e4m3 static per head (exact)" --kv-cache-dtype fp8 --kv-scales "$work/max.json"
row "fp8 e4m3 static per head (p99.9)" --kv-cache-dtype fp8 --kv-scales "$work/p999.json"
row "int4 static (exact ranges)" --kv-cache-dtype int4 --kv-scales "$work/max.json"
row "int4 static (p99.9 clip)" --kv-cache-dtype int4 --kv-scales "$work/p999.json"
row "K8V4 static (p99.9)" --kv-cache-dtype k8v4 --kv-scales "$work/p999.json"
row "K8 static + V4 dynamic per token" --kv-cache-dtype int8+int4/token --kv-scales "$work/p999.json"
row "layers 0-1 f16, 2-4 int4 KIVI" --kv-cache-dtype f32 --kv-layer-types 0-1:f16,2-:int4
