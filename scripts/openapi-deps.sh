#!/usr/bin/env bash
# Tools tests/faces/openapi.rs runs against the live API, from PyPI, installed if missing or
# at another version:
#   openapi-spec-validator  validates the served OpenAPI document
#   schemathesis            generates requests from the document and checks the answers
# Pinned: schemathesis 3.x and 4.x take different command-line flags.
# Idempotent; scripts/test.sh runs it before `cargo test`.
set -euo pipefail
SCHEMATHESIS_VERSION=4.32.5
OPENAPI_SPEC_VALIDATOR_VERSION=0.9.0

pip_install() {
  pip install -q "$@" 2>/dev/null || pip install -q --break-system-packages "$@"
}
have_version() { # command, version
  command -v "$1" >/dev/null && "$1" --version 2>/dev/null | grep -q "$2"
}
if ! have_version schemathesis "$SCHEMATHESIS_VERSION"; then
  echo "installing schemathesis $SCHEMATHESIS_VERSION"
  pip_install "schemathesis==$SCHEMATHESIS_VERSION"
fi
if ! command -v openapi-spec-validator >/dev/null; then
  echo "installing openapi-spec-validator $OPENAPI_SPEC_VALIDATOR_VERSION"
  pip_install "openapi-spec-validator==$OPENAPI_SPEC_VALIDATOR_VERSION"
fi
echo "schemathesis $SCHEMATHESIS_VERSION and openapi-spec-validator are installed"
