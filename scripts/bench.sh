#!/usr/bin/env bash
# Runs the end-to-end benchmarks (bench/engine_bench.py) and the micro-benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 bench/engine_bench.py "$@"
