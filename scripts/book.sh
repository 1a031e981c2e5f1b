#!/usr/bin/env bash
# Builds the manual (docs/, mdBook) into target/book. Installs the pinned mdbook from
# crates.io first when it is missing or another version (without the serve and watch
# features, which the build does not need: a few minutes cold, nothing after).
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.5.4
bin="${CARGO_HOME:-$HOME/.cargo}/bin/mdbook"
if ! "$bin" --version 2>/dev/null | grep -qx "mdbook v$MDBOOK_VERSION"; then
  echo "== installing mdbook $MDBOOK_VERSION from crates.io"
  cargo install mdbook --locked --version "$MDBOOK_VERSION" --no-default-features --features search 2>&1
fi
# mdbook reports a missing {{#include}} file as an error but still exits 0: fail on it here.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
"$bin" build docs 2>&1 | tee "$log"
if grep -E '(ERROR|WARN)' "$log" >/dev/null; then
  echo "mdbook printed errors or warnings (above): fix them" >&2
  exit 1
fi
echo "== the book: target/book/index.html"
