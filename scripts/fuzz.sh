#!/usr/bin/env bash
# Runs the GGUF reader's libFuzzer target (tests/fuzz/gguf_fuzz.cpp, ASan +
# UBSan) for a long time, by hand. The test suite runs it for only ~20 s.
#
# usage: scripts/fuzz.sh [SECONDS] [extra libFuzzer flags...]
#   SECONDS    default 600
#   BUILD_DIR  default build/fuzz (configured here if needed)
#   JOBS       parallel fuzzing processes, default 1
# New interesting inputs accumulate in $BUILD_DIR/fuzz-corpus/gguf (seeded from
# tests/fuzz/corpus/gguf); crashing inputs land in $BUILD_DIR/fuzz-artifacts/.
# To keep a small new input as a regression seed, copy it into tests/fuzz/corpus/gguf.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-600}"
shift || true
build="${BUILD_DIR:-$root/build/fuzz}"
jobs="${JOBS:-1}"

"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGODA_BENCH=OFF -DPAGODA_FUZZ=ON >/dev/null
cmake --build "$build" --target gguf_libfuzzer

corpus="$build/fuzz-corpus/gguf"
artifacts="$build/fuzz-artifacts"
mkdir -p "$corpus" "$artifacts"

flags=(-max_total_time="$seconds" -max_len=16384 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
       -artifact_prefix="$artifacts/")
if [ "$jobs" -gt 1 ]; then
  flags+=(-fork="$jobs")
fi
exec "$build/tests/fuzz/libfuzzer/gguf_fuzz" "${flags[@]}" "$@" "$corpus" "$root/tests/fuzz/corpus/gguf"
