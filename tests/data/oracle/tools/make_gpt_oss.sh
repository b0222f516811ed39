#!/bin/sh
# Rebuilds the gpt-oss oracle files (tests/data/oracle/README.md, "gpt-oss"):
# a random-weight tiny gpt-oss model written by `pagoda synth` in F32, its
# MXFP4 copy made by llama.cpp's llama-quantize (experts MXFP4, the other
# matrices Q8_0), and llama.cpp's logits and greedy tokens for both.
#
#   tests/data/oracle/tools/make_gpt_oss.sh PAGODA LLAMA_CPP_SOURCE LLAMA_CPP_BUILD
#
# PAGODA is Pagoda's CLI (build/release/pagoda), LLAMA_CPP_SOURCE a llama.cpp
# checkout and LLAMA_CPP_BUILD its CMake build directory (with bin/libllama.so
# and bin/llama-quantize). Run from the repository's root.
set -eu
pagoda=$1 src=$2 build=$3
dir=tests/data/oracle
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
c++ -O2 -std=c++17 -I"$src/include" -I"$src/ggml/include" "$dir/tools/llama_logits.cpp" -L"$build/bin" \
  -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$tmp/llama_logits"
python3 -c "import json; print(*json.load(open('$dir/prompt.json'))['ids'])" > "$tmp/ids.txt"
"$pagoda" synth --preset tiny-gpt-oss --weight-type f32 --vocab 512 --seed 1 -t 1 -o "$dir/gguf/gpt-oss-F32.gguf"
"$build/bin/llama-quantize" "$dir/gguf/gpt-oss-F32.gguf" "$dir/gguf/gpt-oss-MXFP4.gguf" MXFP4_MOE 1
"$tmp/llama_logits" "$dir/gguf/gpt-oss-F32.gguf" "$tmp/ids.txt" 32 "$dir/ref/gpt-oss-F32" gpt-oss-F32 arch
"$tmp/llama_logits" "$dir/gguf/gpt-oss-MXFP4.gguf" "$tmp/ids.txt" 32 "$dir/ref/gpt-oss-MXFP4" gpt-oss-MXFP4 gpt-oss-quant
sha256sum "$dir/gguf/gpt-oss-F32.gguf" "$dir/gguf/gpt-oss-MXFP4.gguf"
