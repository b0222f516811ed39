#!/usr/bin/env python3
"""KV bytes of an image against the text of the same request (issue 37).

SmolVLM-256M's shapes with random weights: the text model is `pagoda synth
--preset smollm2-135m` (SmolLM2-135M: 30 layers, 3 KV heads of 64), the
mmproj an idefics3 tower with SmolVLM's image geometry (512x512 chunks of
patch 16, pixel shuffle x4: 64 tokens per chunk, longest edge 2048: a square
image is 4x4 slices and the overview, 1,088 image tokens) but a one-block,
narrow ViT, since only the number of image tokens matters for the KV and
the encoder's time is measured elsewhere (bench/micro/vision_bench.cpp).

For each image KV configuration, a `pagoda serve` on loopback answers one chat
request (the image, then a question of about 200 tokens, max_tokens 1); the
request's usage gives its image and text tokens and what an eviction
policy kept (`kv_tokens_kept`), `/metrics` the blocks each KV class holds
after it (`pagoda:kv_class_blocks`, used + cached: the request's blocks stay
in the prefix cache). The image class takes whole blocks of image tokens;
image tokens in a block shared with marker tokens stay in the text's type,
and are counted at it. With an eviction policy, bytes are the tokens kept at
the image's type (the blocks of an evicting sequence are not cached after
it). Bytes per token per type from `pagoda info`.

usage: bench/image_kv.py [--pagoda build/release/pagoda] [--dir /tmp/image_kv]

Every figure is deterministic (token counts and blocks, not times).
"""
import argparse
import base64
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16

CONFIGS = [
    # (label, serve flags)
    ("f16 (the text's type)", []),
    ("int8", ["--kv-image-type", "int8"]),
    ("int4", ["--kv-image-type", "int4"]),
    ("f16, window:budget=0.25", ["--kv-image-policy", "window:budget=0.25"]),
    ("int4, window:budget=0.25", ["--kv-image-type", "int4", "--kv-image-policy", "window:budget=0.25"]),
]

QUESTION = ("Look at the picture above carefully. " * 4 +
            "Describe every object you can see in it, where each one is, what colour it has, "
            "and what the people in it might be doing, and then write a short story about it. " * 3)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read().decode()


def bytes_per_token(pagoda, model, mmproj, kv_type):
    """B/token of a KV type from `pagoda info --mmproj --kv-image-type` (its image row)."""
    out = run([pagoda, "info", "-m", model, "--mmproj", mmproj, "--kv-image-type", kv_type])
    for line in out.splitlines():
        if line.strip().startswith("--kv-image-type"):
            return float(line.split()[2])
    raise RuntimeError(f"no --kv-image-type row for {kv_type} in:\n{out}")


def metrics(port):
    text = http(f"http://127.0.0.1:{port}/metrics")
    classes, evicted = {}, 0.0
    for line in text.splitlines():
        m = re.match(r'pagoda:kv_class_blocks\{[^}]*type="([^"]+)",state="(used|cached)"\} (\S+)', line)
        if m:
            classes[m.group(1)] = classes.get(m.group(1), 0) + int(float(m.group(3)))
        m = re.match(r"pagoda:kv_policy_evicted_slots_total(\{[^}]*\})? (\S+)", line)
        if m:
            evicted += float(m.group(2))
    return classes, evicted


def measure(pagoda, model, mmproj, image, flags):
    port = free_port()
    cmd = [pagoda, "serve", "-m", model, "--mmproj", mmproj, "--no-kv-store", "--port", str(port),
           "--ctx", "4096", "--max-json-string-bytes", str(8 << 20), "--max-body-bytes", str(8 << 20)] + flags
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                http(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                if srv.poll() is not None:
                    raise RuntimeError("serve stopped: " + srv.stderr.read())
                time.sleep(0.2)
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}],
            "max_tokens": 1, "temperature": 0}
        usage = json.loads(http(f"http://127.0.0.1:{port}/v1/chat/completions", body))["usage"]
        classes, evicted = metrics(port)
        return usage, classes, evicted
    finally:
        srv.terminate()
        srv.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", default=os.path.join(ROOT, "build/release/pagoda"))
    ap.add_argument("--dir", default="/tmp/image_kv")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    model = os.path.join(args.dir, "smollm2-135m-q8_0.gguf")
    mmproj = os.path.join(args.dir, "mmproj-smolvlm-geometry.gguf")
    if not os.path.exists(model):
        log("writing " + model)
        run([args.pagoda, "synth", "--preset", "smollm2-135m", "--weight-type", "q8_0", "-o", model])
    if not os.path.exists(mmproj):
        log("writing " + mmproj)
        run([args.pagoda, "synth", "--preset", "smollm2-135m", "--mmproj", "--weight-type", "f32", "--image-size", "512",
             "--patch-size", "16", "--scale-factor", "4", "--longest-edge", "2048", "--vision-layers", "1",
             "--vision-embd", "64", "-o", mmproj])
    with open(os.path.join(ROOT, "tests/fuzz/corpus/image/rgb.png"), "rb") as f:
        image = f.read()

    bpt = {t: bytes_per_token(args.pagoda, model, mmproj, t) for t in ("f16", "int8", "int4")}
    log(f"bytes per token: {bpt}")
    print("| image KV | image tokens | text tokens | image KV held | image KV | text KV | image / text KV "
          "| image KV / f16's |")
    print("|---|---|---|---|---|---|---|---|")
    f16_image = None
    for label, flags in CONFIGS:
        usage, classes, evicted = measure(args.pagoda, model, mmproj, image, flags)
        n_img = usage["prompt_tokens_details"]["image_tokens"]
        n_txt = usage["prompt_tokens"] - n_img
        img_type = flags[flags.index("--kv-image-type") + 1] if "--kv-image-type" in flags else None
        # The policies act on the image only: the text is all kept.
        kept = usage.get("kv_tokens_kept", usage["prompt_tokens"]) - n_txt
        # The text's KV: its tokens (the question, the chat markup and the
        # image's marker tokens) at f16.
        txt_bytes = n_txt * bpt["f16"]
        if img_type and evicted == 0:
            # As the pool holds them: the image class takes whole blocks of
            # image tokens; the image tokens in blocks shared with marker
            # tokens stay in the text's type.
            img_blocks = classes.get(img_type, 0)
            in_class = img_blocks * BLOCK
            img_bytes = in_class * bpt[img_type] + (kept - in_class) * bpt["f16"]
            blocks = f"{in_class} in {img_blocks} {img_type} blocks, {kept - in_class} in shared f16 blocks"
        else:
            # After eviction the sequence's blocks are not kept: by tokens
            # kept, at the image's type.
            img_bytes = kept * bpt[img_type or "f16"]
            blocks = f"{kept} tokens kept ({img_type or 'f16'})"
        if f16_image is None:
            f16_image = img_bytes
        print(f"| {label} | {n_img} | {n_txt} | {blocks} | {img_bytes / 2**20:.2f} MiB | {txt_bytes / 2**20:.2f} MiB "
              f"| {img_bytes / max(txt_bytes, 1):.2f} | {img_bytes / f16_image:.2f} |")
        log(f"{label}: usage {usage}, classes {classes}, evicted {evicted}")


if __name__ == "__main__":
    main()
