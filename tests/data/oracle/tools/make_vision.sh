#!/bin/sh
# Rebuilds the vision oracle files (tests/data/oracle/README.md, "Vision"): a
# random-weight idefics3 mmproj and the tiny llama text model it pairs with,
# a gemma3 mmproj and the tiny gemma3 text model it pairs with,
# both written by `pagoda synth`, two test images, and llama.cpp's mtmd
# preprocessed pixels, image embeddings and logits after the image.
#
#   tests/data/oracle/tools/make_vision.sh PAGODA LLAMA_CPP_SOURCE LLAMA_CPP_BUILD
#
# PAGODA is Pagoda's CLI (build/release/pagoda), LLAMA_CPP_SOURCE a llama.cpp
# checkout and LLAMA_CPP_BUILD its CMake build directory (with bin/libllama.so
# and bin/libmtmd.so). Run from the repository's root.
set -eu
pagoda=$1 src=$2 build=$3
dir=tests/data/oracle/vision
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
c++ -O2 -std=c++17 -I"$src/include" -I"$src/ggml/include" -I"$src/tools/mtmd" tests/data/oracle/tools/mtmd_embd.cpp \
  -L"$build/bin" -lmtmd -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$tmp/mtmd_embd"
"$pagoda" synth --preset tiny --weight-type f32 --vocab 512 --seed 1 -t 1 -o "$dir/text-tiny-F32.gguf"
"$pagoda" synth --preset tiny --mmproj --weight-type f32 --seed 1 -t 1 -o "$dir/mmproj-idefics3-F32.gguf"
# Two 8-bit RGB images (binary PPM): A is the encoder's own size (64x64, no
# resizing), B (96x80) is resized by both of idefics3's resizes.
python3 - "$dir" <<'PY'
import sys
def write(path, nx, ny):
    px = bytearray()
    for y in range(ny):
        for x in range(nx):
            px += bytes(((x * 255) // (nx - 1), (y * 255) // (ny - 1), ((x + y) * 37 + (x * y) % 7) % 256))
    with open(path, 'wb') as f:
        f.write(b'P6\n%d %d\n255\n' % (nx, ny) + bytes(px))
write(sys.argv[1] + '/image-a-64x64.ppm', 64, 64)
write(sys.argv[1] + '/image-b-96x80.ppm', 96, 80)
PY
echo "1 300 301 302" > "$dir/prompt.txt"
for img in a-64x64 b-96x80; do
  "$tmp/mtmd_embd" "$dir/text-tiny-F32.gguf" "$dir/mmproj-idefics3-F32.gguf" "$dir/image-$img.ppm" "$dir/prompt.txt" \
    "$dir/ref-$img"
done
# gemma3: a random-weight gemma3 mmproj (SigLIP ViT, 2x2 average pool: 16
# tokens per image) and the tiny gemma3 text model (sliding-window layers of
# 8 and a global one), the same images; the image decoded non-causally as
# mtmd does for Gemma 3, then three tokens after it.
"$pagoda" synth --preset tiny-gemma3 --weight-type f32 --vocab 512 --ffn 128 --seed 1 -t 1 -o "$dir/text-gemma3-F32.gguf"
"$pagoda" synth --preset tiny-gemma3 --ffn 128 --mmproj --projector gemma3 --weight-type f32 --seed 1 -t 1 \
  -o "$dir/mmproj-gemma3-F32.gguf"
echo "303 304 305" > "$tmp/after.txt"
for img in a-64x64 b-96x80; do
  "$tmp/mtmd_embd" "$dir/text-gemma3-F32.gguf" "$dir/mmproj-gemma3-F32.gguf" "$dir/image-$img.ppm" "$dir/prompt.txt" \
    "$dir/ref-gemma3-$img" "$tmp/after.txt"
done
sha256sum "$dir"/*.gguf "$dir"/*.ppm
