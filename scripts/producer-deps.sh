#!/usr/bin/env bash
# What the producer examples (examples/) and their tests need, installed if missing:
#   amqp-tools, curl  (Debian) examples/shell/; tests/bridge/producers.rs also publishes
#                     with amqp-publish, as a shell script or a cron job would
#   nodejs, npm       (Debian) examples/node/, whose amqplib comes from the npm registry by
#                     `npm ci` (exactly package-lock.json's versions, from npm's cache when
#                     it has them), run again only when the lockfile changes
#   pika              (PyPI, examples/python/requirements.txt) examples/python/, and
#                     tests/bridge/{bad_input,poison}.rs publish with it
# tests/bridge/examples.rs runs every example against a bridge. Idempotent; scripts/test.sh
# runs it before `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v amqp-publish >/dev/null || missing+=(amqp-tools)
command -v curl >/dev/null || missing+=(curl)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if ((${#missing[@]})); then
  echo "installing ${missing[*]}"
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${missing[@]}" >/dev/null
fi

lock=examples/node/package-lock.json
stamp=examples/node/node_modules/.lockfile.sha256
want=$(sha256sum "$lock" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing examples/node's packages (npm ci)"
  npm ci --prefix examples/node --no-audit --no-fund --loglevel=error
  echo "$want" >"$stamp"
fi

if ! python3 -c "import pika" 2>/dev/null; then
  echo "installing pika"
  requirements=examples/python/requirements.txt
  pip install -q -r "$requirements" 2>/dev/null || pip install -q --break-system-packages -r "$requirements"
fi
echo "amqp-tools, curl, node with amqplib, and pika are installed"
