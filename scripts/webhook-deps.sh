#!/usr/bin/env bash
# What tests/bridge/webhooks.rs and webhook_identity.rs run beside the bridge, installed if
# missing (tests/common/verifiers.rs runs the three verifiers):
#   standardwebhooks  (PyPI) verifies the bridge's webhook-signature with an implementation
#                     we did not write (two secrets during a rotation; an expired one)
#   svix              (PyPI) the same check with Svix's verifier
#   standardwebhooks  (npm, tests/verifiers/package-lock.json) the same check in Node, by
#                     `npm ci` (from npm's cache when it has them), again only when the
#                     lockfile changes
#   hypercorn         an HTTP/2 server over TLS (ALPN), to see the client use HTTP/2
#                     when the server offers it
# Idempotent; scripts/test.sh runs it before `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
STANDARDWEBHOOKS_VERSION=1.1.0
SVIX_VERSION=2.9.1
HYPERCORN_VERSION=0.18.0

pip_install() {
  pip install -q "$@" 2>/dev/null || pip install -q --break-system-packages "$@"
}
if ! python3 -c "import standardwebhooks" 2>/dev/null; then
  echo "installing standardwebhooks $STANDARDWEBHOOKS_VERSION"
  pip_install "standardwebhooks==$STANDARDWEBHOOKS_VERSION"
fi
if ! python3 -c "import svix" 2>/dev/null; then
  echo "installing svix $SVIX_VERSION"
  pip_install "svix==$SVIX_VERSION"
fi
if ! python3 -c "import hypercorn" 2>/dev/null; then
  echo "installing hypercorn $HYPERCORN_VERSION"
  pip_install "hypercorn==$HYPERCORN_VERSION"
fi
lock=tests/verifiers/package-lock.json
stamp=tests/verifiers/node_modules/.lockfile.sha256
want=$(sha256sum "$lock" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  command -v npm >/dev/null || bash scripts/producer-deps.sh
  echo "installing tests/verifiers' packages (npm ci)"
  npm ci --prefix tests/verifiers --no-audit --no-fund --loglevel=error --prefer-offline
  echo "$want" >"$stamp"
fi
echo "standardwebhooks (PyPI and npm), svix and hypercorn are installed"
