#!/usr/bin/env bash
# The test command: makes sure the services and test tools are there, then runs every test
# against the real Redis and RabbitMQ: what `cargo test` runs (the fast tier), plus the
# tests marked #[ignore = "slow: ..."] (chaos, faults, soak, upgrade, recurring lateness
# and the bridge's longest and timed tests). This is what CI runs.
# Usage: bash scripts/test.sh [cargo test args] [-- test binary args]
#   e.g. bash scripts/test.sh --test bridge -- webhooks::
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
for deps in scripts/*-deps.sh; do [ -f "$deps" ] && bash "$deps"; done

# Ignored for another reason than "slow:": run by hand, never here (tests/tidy.rs checks
# that every ignored test is one or the other).
BY_HAND=(unlimited_path_cost a_retry_storm_leaves_first_attempts_p99_within_twice_its_lateness_alone partitioned_chaos_without_broker_restarts_keeps_the_promise)

cargo_args=() test_args=()
while (($#)); do
  if [ "$1" = "--" ]; then
    shift
    test_args=("$@")
    break
  fi
  cargo_args+=("$1")
  shift
done
skips=()
for name in "${BY_HAND[@]}"; do skips+=(--skip "$name"); done
cargo test --locked "${cargo_args[@]}" -- --include-ignored "${skips[@]}" "${test_args[@]}"
