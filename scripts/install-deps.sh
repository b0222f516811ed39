#!/usr/bin/env bash
# Installs every dependency Pagoda needs, from Debian only. Idempotent: packages
# already present are skipped, and nothing runs apt when all are there.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libboost-dev libcpp-httplib-dev libcli11-dev
  libfmt-dev libspdlog-dev libxxhash-dev libzstd-dev liblmdb-dev
  libpcre2-dev libhnswlib-dev libfaiss-dev libhiredis-dev redis-server
  libssl-dev openssl libcurl4-openssl-dev
  libpng-dev libturbojpeg0-dev  # images in requests (src/vision/image_decode.h)
  clang libclang-rt-14-dev
  nodejs
  chromium  # the dashboard test drives it headless (tests/server/dashboard_test.cpp)
  python3 python3-jsonschema
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian's own nodejs ships npm as a separate package; NodeSource's bundles it.
if ! command -v npm >/dev/null 2>&1; then
  $sudo apt-get install -y -qq --no-install-recommends npm >/dev/null
fi

# The npm packages of the OpenAI SDK test (tests/server/openai_sdk_test.cpp),
# exactly as package-lock.json pins them; tests never reach the registry.
"$(dirname "$0")/install-node-test-deps.sh"
