#!/usr/bin/env bash
# Tools the producer tests need, from Debian's packages, installed if missing:
#   amqp-tools  tests/bridge/producers.rs schedules and cancels with amqp-publish, as a shell
#               script or a cron job would
# Idempotent; scripts/test.sh runs it before `cargo test`.
set -euo pipefail
if ! command -v amqp-publish >/dev/null; then
  echo "installing amqp-tools"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq amqp-tools >/dev/null
fi
echo "amqp-publish is installed"
