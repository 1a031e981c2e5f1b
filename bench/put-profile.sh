#!/usr/bin/env bash
# Where put.lua's time goes, in a figure that does not depend on the machine's load:
# user-space instructions Redis executes per EVALSHA (valgrind callgrind's Ir), for the
# bare ZADD+HSET script and for put.lua with one piece taken out at a time.
#
#   bench/put-profile.sh [calls] [git-rev-of-an-earlier-put.lua]
#   bench/put-profile.sh 10000 0cecb51
#
# Each variant runs on a fresh private redis-server under callgrind, called by
# redis-benchmark (-P 50, one connection) with the Store's 8 keys and 11 arguments and a
# fresh random id per call; the instructions of a run that only loaded the script are
# subtracted. Needs redis-server, redis-benchmark (redis-tools) and valgrind.
set -euo pipefail
calls=${1:-10000}
before=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
put="$root/lua/put.lua"

# cut <out> <pattern> <replacement>: put.lua with one line replaced; fails if absent.
cut() {
  grep -qF -- "$2" "$put" || { echo "put-profile: '$2' not found in put.lua" >&2; exit 1; }
  awk -v from="$2" -v to="$3" 'index($0, from) == 1 && !done { print to; done = 1; next } { print }' "$put" > "$work/$1"
}
echo "redis.call('ZADD', KEYS[1], ARGV[6], ARGV[1]) redis.call('HSET', KEYS[3], ARGV[1], ARGV[2]) return 1" > "$work/bare.lua"
cp "$put" "$work/put.lua"
[ -n "$before" ] && git -C "$root" show "$before:lua/put.lua" > "$work/put-$before.lua"
cut put-no-clock.lua "local now = now_ms()" "local now = 1764547200000"
cut put-no-head-check.lua "if channel and #channel > 0 and redis.call('ZRANK', scheduled, id) == 0 then" "if false then"
# Validation out: everything from the id check to the body limit becomes plain tonumber.
awk '/^if not valid_id\(id\) then/ { skip = 1 }
     /^local now = now_ms\(\)/ { if (skip) print "local when_ms, max_delay, history_max, spec = tonumber(when), tonumber(ARGV[7]), 1000, ARGV[10] or \x27\x27"; skip = 0 }
     !skip { print }' "$put" > "$work/put-no-validation.lua"
grep -q '^local when_ms, max_delay, history_max' "$work/put-no-validation.lua" || { echo "put-profile: validation block not found" >&2; exit 1; }
# The reply as the bare script's (1), the contract's { 'scheduled', due_at } aside.
cut put-reply-1.lua "return { 'scheduled', due }" "return 1"
# The writes as the bare script's (body as value, the delay as score): no record built.
awk '/^local due_s = fmt\(due\)/ { print "local due_s, record = ARGV[6], body"; found = 1; next }
     /^local record = new_record/ { next }
     { print } END { exit !found }' "$put" > "$work/put-bare-writes.lua" ||
  { echo "put-profile: the record lines not found" >&2; exit 1; }
# The script's fixed part: header, shared helpers and valid_id, then the bare writes.
awk '/^local full, bad_keys/ { exit } { print }' "$put" > "$work/shared-block-then-bare.lua"
cat "$work/bare.lua" >> "$work/shared-block-then-bare.lua"

body=$(printf 'a%.0s' $(seq 1 100))
keys=()
for k in scheduled reserved jobs seq damaged paused history failing; do keys+=("p:{t}:$k"); done

# instructions <script> <calls>: total Ir of a fresh server that ran <calls> EVALSHAs.
instructions() {
  local port out
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  out="$work/callgrind.$port"
  valgrind --tool=callgrind --callgrind-out-file="$out" \
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null 2>&1 &
  local pid=$!
  for _ in $(seq 1 200); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  local sha
  sha=$(redis-cli -p "$port" script load "$(cat "$1")")
  if [ "$2" -gt 0 ]; then
    redis-benchmark -p "$port" -n "$2" -P 50 -c 1 -r 100000000 -q EVALSHA "$sha" 8 "${keys[@]}" \
      "job-__rand_int__" "$body" '' nx delay 3600000 10000000000000 1048576 p:notify '' 1000 >/dev/null 2>&1
    local failed
    failed=$(redis-cli -p "$port" info commandstats | sed -n 's/^cmdstat_evalsha:.*failed_calls=\([0-9]*\).*/\1/p')
    [ "${failed:-0}" = 0 ] || { echo "put-profile: $failed failed calls of $1" >&2; exit 1; }
  fi
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$pid" || true
  awk '/^(summary|totals):/ { print $2; exit }' "$out"
}

printf '| script (%s calls) | instructions per call |\n|---|---:|\n' "$calls"
for f in bare.lua shared-block-then-bare.lua put.lua ${before:+put-$before.lua} \
  put-no-clock.lua put-no-head-check.lua put-no-validation.lua put-reply-1.lua put-bare-writes.lua; do
  with=$(instructions "$work/$f" "$calls")
  without=$(instructions "$work/$f" 0)
  printf '| %s | %d |\n' "${f%.lua}" $(((with - without) / calls))
done
