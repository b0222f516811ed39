#!/usr/bin/env bash
# Installs the npm packages the Node tests use (tests/server/node: the openai
# SDK), exactly as tests/server/node/package-lock.json pins them. Idempotent:
# nothing runs when the installed tree already matches the lock file.
set -euo pipefail

dir="$(cd "$(dirname "$0")/../tests/server/node" && pwd)"
want="$(node -e 'console.log(require(process.argv[1]).packages["node_modules/openai"].version)' "$dir/package-lock.json")"
have="$(node -e 'try { console.log(require(process.argv[1]).version) } catch { console.log("") }' \
  "$dir/node_modules/openai/package.json")"
if [ "$have" = "$want" ]; then
  exit 0
fi
echo "install-node-test-deps: npm ci in $dir (openai $want)" >&2
# flock: two installs (release and asan setups) never write the folder at once.
(cd "$dir" && flock . npm ci --no-audit --no-fund --loglevel=error)
