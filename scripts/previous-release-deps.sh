#!/usr/bin/env bash
# Builds the previous release's `redisched` binary for tests/upgrade.rs (old and new bridges
# side by side on one Redis and broker). The release is a fixed commit of this repository,
# recorded in tests/fixtures/previous-release; the binary is cached outside the work tree
# (keyed by that commit), so a machine builds it once: ~3-5 min cold on 2 cores, nothing
# when cached. Usage: bash scripts/previous-release-deps.sh [--print-path]
# Cache folder: $PREVIOUS_RELEASE_CACHE, default ~/.cache/redisched/previous-release.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(grep -v "^#" tests/fixtures/previous-release | tr -d "[:space:]")
cache=${PREVIOUS_RELEASE_CACHE:-${HOME:-/root}/.cache/redisched/previous-release}
bin="$cache/$commit/redisched"
if [[ "${1:-}" == "--print-path" ]]; then
  echo "$bin"
  exit 0
fi
[[ -x "$bin" ]] && exit 0

if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
  echo "previous release $commit is not in this clone's history (a shallow clone?):" >&2
  echo "  fetch it with: git fetch --unshallow" >&2
  exit 1
fi
mkdir -p "$cache"
# One builder at a time (the test calls this script too when the binary is missing).
exec 9>"$cache/.lock"
flock 9
[[ -x "$bin" ]] && exit 0
work="$cache/$commit.build"
rm -rf "$work"
mkdir -p "$work/src"
git archive "$commit" | tar -x -C "$work/src"
echo "== building the previous release ($commit) for tests/upgrade.rs"
started=$(date +%s)
CARGO_TARGET_DIR="$work/target" cargo build --locked --quiet \
  --manifest-path "$work/src/Cargo.toml" --bin redisched
install -D -m 0755 "$work/target/debug/redisched" "$bin"
rm -rf "$work"
echo "== previous release built in $(( $(date +%s) - started )) s: $bin"
