#!/usr/bin/env bash
# What tests/bridge/webhooks.rs runs beside the bridge, from PyPI, installed if missing:
#   standardwebhooks  verifies the bridge's webhook-signature with an implementation we
#                     did not write (two secrets during a rotation)
#   hypercorn         an HTTP/2 server over TLS (ALPN), to see the client use HTTP/2
#                     when the server offers it
# Idempotent; scripts/test.sh runs it before `cargo test`.
set -euo pipefail
STANDARDWEBHOOKS_VERSION=1.1.0
HYPERCORN_VERSION=0.18.0

pip_install() {
  pip install -q "$@" 2>/dev/null || pip install -q --break-system-packages "$@"
}
if ! python3 -c "import standardwebhooks" 2>/dev/null; then
  echo "installing standardwebhooks $STANDARDWEBHOOKS_VERSION"
  pip_install "standardwebhooks==$STANDARDWEBHOOKS_VERSION"
fi
if ! python3 -c "import hypercorn" 2>/dev/null; then
  echo "installing hypercorn $HYPERCORN_VERSION"
  pip_install "hypercorn==$HYPERCORN_VERSION"
fi
echo "standardwebhooks and hypercorn are installed"
