#!/usr/bin/env bash
# The test command: makes sure the services and test tools are there, then runs every
# test against the real Redis and RabbitMQ. Usage: bash scripts/test.sh [cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
for deps in scripts/*-deps.sh; do [ -f "$deps" ] && bash "$deps"; done
python3 -c "import pika" 2>/dev/null || pip install -q pika 2>/dev/null || pip install -q --break-system-packages pika
cargo test --locked "$@"
