#!/bin/sh
# Regenerates the shipped profiles `pagoda plan` reads (docs/plan.md):
#   profiles/stories260K.json  quality: `pagoda perplexity --kl-divergence
#                              --profile-out` for every configuration plan lists
#                              for stories260K at --ctx 512 (plan it at --ctx 512), over
#                              the first 100 stories of tests/data/tinystories_dev.txt;
#   profiles/attention_speed.json  speed: bench/attention_profile.py (attention_bench).
# Usage: profiles/make_profiles.sh [BUILD_DIR]   (default build/release)
set -eu
cd "$(dirname "$0")/.."
build=${1:-build/release}
pagoda="$build/pagoda"
model=models/stories260K.gguf
text=tests/data/tinystories_dev.txt
out=profiles/stories260K.json
rm -f "$out"
measure() {
  echo "profiles: $*" >&2
  "$pagoda" perplexity -m "$model" -f "$text" --ctx 512 --chunks 100 -t 1 --kl-divergence --profile-out "$out" "$@" >/dev/null
}
for t in f32 f16 bf16 fp8_e4m3 fp8_e5m2 int8 int4 int2 q8_0 q4_0 \
         int8/channel+int8/token int4/channel+int4/token int4/token+int4 int2/token+int2 int8+int4 int4+int2 int8+int2; do
  measure --kv-cache-dtype "$t"
done
measure --kv-layer-types "0-1:f16,2-:int4"
# plan's eviction rows: a quarter of the context (512 / 4 = 128 tokens).
for p in window:budget=128 h2o:budget=128; do measure --kv-cache-dtype f16 --kv-policy "$p"; done
for s in reuse:from=0 minicache:from=0; do measure --kv-cache-dtype f16 --kv-share "$s"; done
if [ -x "$build/bench/attention_bench" ]; then
  python3 bench/attention_profile.py --bench "$build/bench/attention_bench" -o profiles/attention_speed.json
fi
