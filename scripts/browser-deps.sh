#!/usr/bin/env bash
# Tools the operator-surface tests need, from Debian's packages, installed if missing:
#   chromium + chromium-driver  tests/faces/dashboard.rs drives the web dashboard headless
#   docker-compose              tests/compose.rs validates docker-compose.yml (no engine needed)
#   openssl                     tests/faults/tls.rs makes a throwaway CA and certificates
# Idempotent; scripts/test.sh runs it before `cargo test`.
set -euo pipefail

browser=()
command -v chromium >/dev/null || browser+=(chromium)
command -v chromedriver >/dev/null || browser+=(chromium-driver)
updated=""
apt_install() {
  [ -n "$updated" ] || { apt-get update -qq; updated=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
if ((${#browser[@]})); then
  echo "installing ${browser[*]}"
  apt_install "${browser[@]}"
fi
if ! command -v docker-compose >/dev/null; then
  echo "installing docker-compose"
  # Only the compose CLI: its recommended docker.io engine is not needed to validate a file.
  apt_install --no-install-recommends docker-compose
fi
if ! command -v openssl >/dev/null; then
  echo "installing openssl (tests/faults/tls.rs makes throwaway certificates)"
  apt_install openssl
fi
echo "chromium, chromedriver, docker-compose and openssl are installed"
