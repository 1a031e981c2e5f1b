#!/usr/bin/env bash
# The compose stack, for real: builds the Dockerfile and starts docker-compose.yml through the
# README's run command (scripts/compose-up.sh, which installs Docker and the base images
# where they are missing), waits for every health check, checks that the published ports
# listen on 127.0.0.1 only, schedules a job through RabbitMQ with x-delay 1000 and receives it
# on redisched.ready, checks /readyz, /metrics and the dashboard, and always tears the stack
# down (volumes too). Stops the Docker engine afterwards if it started it.
# Host ports are free ones picked at start, so the machine's own Redis/RabbitMQ do not clash.
#   bash scripts/compose-test.sh          (root; about 9 min cold, under a minute cached)
# COMPOSE_TEST_KEEP_DOCKER=1 leaves a dockerd this script started running.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
say() { echo "compose-test: [$(($(date +%s) - t0)) s] $*"; }
fail() {
    say "FAIL: $*"
    exit 1
}
LOGS=${COMPOSE_TEST_LOGS:-/var/tmp/redisched-docker}
mkdir -p "$LOGS"

docker_was_up=0
/usr/bin/docker info >/dev/null 2>&1 && docker_was_up=1
bash scripts/docker-setup.sh
DOCKER=/usr/bin/docker
export COMPOSE_PROJECT_NAME=redisched-compose-test
compose=(docker-compose)
docker compose version >/dev/null 2>&1 && compose=(docker compose)

# three free host ports, none of the machine's own services' (6379, 5672, 15672, 25672)
read -r HOST_PORT_AMQP HOST_PORT_MANAGEMENT HOST_PORT_HTTP < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export HOST_PORT_AMQP HOST_PORT_MANAGEMENT HOST_PORT_HTTP
unset HOST_ADDRESS REDISCHED_HTTP__TOKEN # the file's defaults are what is tested
say "host ports: amqp $HOST_PORT_AMQP, management $HOST_PORT_MANAGEMENT, http $HOST_PORT_HTTP"

teardown() {
    local status=$?
    set +e
    if [ "$status" != 0 ]; then
        say "failed: state and logs of the stack"
        "${compose[@]}" ps
        "${compose[@]}" logs --no-color --tail=60
    fi
    "${compose[@]}" down --volumes --remove-orphans --timeout 20 >"$LOGS/compose-down.log" 2>&1 \
        || { say "compose down failed:"; cat "$LOGS/compose-down.log"; }
    local project="label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" left
    left=$({
        $DOCKER ps -aq --filter "$project"
        $DOCKER volume ls -q --filter "$project"
    } | tr '\n' ' ')
    if [ -n "$left" ]; then
        say "containers or volumes left behind: $left"
        [ "$status" != 0 ] || status=1
    fi
    if [ "$docker_was_up" = 0 ] && [ "${COMPOSE_TEST_KEEP_DOCKER:-0}" != 1 ]; then
        bash scripts/docker-stop.sh
    fi
    say "done (exit $status)"
    exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM
python3 -c 'import pika' 2>/dev/null || pip install -q pika 2>/dev/null \
    || pip install -q --break-system-packages pika
# a stack left by a killed earlier run would hold the names and volumes
"${compose[@]}" down --volumes --remove-orphans >/dev/null 2>&1 || true

say "base images and build (the README's run command, creating the containers only)"
bash scripts/compose-up.sh --no-start >"$LOGS/compose-build.log" 2>&1 \
    || { tail -40 "$LOGS/compose-build.log"; fail "build failed, log $LOGS/compose-build.log"; }
grep -E '^docker-(setup|images):' "$LOGS/compose-build.log" || true
say "built: image redisched:latest $($DOCKER image inspect -f '{{.Size}}' redisched:latest | numfmt --to=si --round=nearest --format=%.1f)B," \
    "binary $($DOCKER run --rm --entrypoint stat redisched:latest -c %s /usr/local/bin/redisched | numfmt --to=si --round=nearest --format=%.1f)B"

say "starting the stack"
"${compose[@]}" up -d >"$LOGS/compose-up.log" 2>&1 \
    || { cat "$LOGS/compose-up.log"; fail "compose up failed"; }
mapfile -t containers < <("${compose[@]}" ps -q)
[ "${#containers[@]}" = 3 ] || fail "expected 3 containers, got ${#containers[@]}"
deadline=$(($(date +%s) + 240))
while :; do
    states=$($DOCKER inspect -f '{{.Name}}={{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{else}}no-healthcheck{{end}}' "${containers[@]}")
    unhealthy=$(grep -v '=running/healthy$' <<<"$states" || true)
    [ -z "$unhealthy" ] && break
    grep -qE '/unhealthy$|=(exited|dead)/' <<<"$unhealthy" && fail "$(tr '\n' ' ' <<<"$unhealthy")"
    [ "$(date +%s)" -lt "$deadline" ] || fail "not healthy within 240 s: $(tr '\n' ' ' <<<"$unhealthy")"
    sleep 1
done
say "all healthy: $(tr '\n' ' ' <<<"$states")"

# published ports: on 127.0.0.1 only, and on the chosen host ports
for published in "rabbitmq 5672 $HOST_PORT_AMQP" "rabbitmq 15672 $HOST_PORT_MANAGEMENT" \
    "redisched 7171 $HOST_PORT_HTTP"; do
    read -r service port host_port <<<"$published"
    bound=$("${compose[@]}" port "$service" "$port")
    [ "$bound" = "127.0.0.1:$host_port" ] || fail "$service:$port is published on $bound, want 127.0.0.1:$host_port"
done
say "published ports listen on 127.0.0.1 only"

say "scheduling a job through RabbitMQ (x-delay 1000)"
AMQP_PORT=$HOST_PORT_AMQP python3 - <<'EOF'
import os, sys, time, uuid
import pika

params = pika.ConnectionParameters(
    "127.0.0.1", int(os.environ["AMQP_PORT"]), "/",
    pika.PlainCredentials("redisched", "redisched"),
    connection_attempts=5, retry_delay=1)
connection = pika.BlockingConnection(params)
channel = connection.channel()
channel.confirm_delivery()
topic = "compose.test"
queue = channel.queue_declare("", exclusive=True).method.queue
channel.queue_bind(queue, "redisched.ready", routing_key=topic)
job_id = "compose-test-" + uuid.uuid4().hex
body = ("scheduled by scripts/compose-test.sh, " + job_id).encode()
sent = time.monotonic()
# mandatory + confirms: an unroutable command (no commands queue bound) raises here
channel.basic_publish(
    "redisched.commands", topic, body,
    pika.BasicProperties(message_id=job_id, delivery_mode=2, headers={"x-delay": 1000}),
    mandatory=True)
for method, props, got in channel.consume(queue, auto_ack=True, inactivity_timeout=1):
    waited = time.monotonic() - sent
    if method is None:
        if waited > 30:
            sys.exit("compose-test: FAIL: the job did not arrive within 30 s")
        continue
    if props.message_id != job_id or got != body:
        sys.exit(f"compose-test: FAIL: got {props.message_id!r} {got!r}, want {job_id!r} {body!r}")
    if waited < 1.0:
        sys.exit(f"compose-test: FAIL: delivered after {waited:.3f} s, before its 1 s delay")
    if waited > 10:
        sys.exit(f"compose-test: FAIL: delivered only after {waited:.3f} s")
    print(f"compose-test: job {job_id} arrived on redisched.ready {waited:.3f} s after the put")
    break
connection.close()
EOF

http="http://127.0.0.1:$HOST_PORT_HTTP"
ready=$(curl -sS -w ' %{http_code}' "$http/readyz")
if ! [[ "$ready" == *'"ready":true'* && "$ready" == *'"redis":"ok"'* && "$ready" == *'"amqp":"ok"'* \
    && "$ready" == *" 200" ]]; then
    fail "/readyz: $ready"
fi
say "/readyz: $ready"
dispatched=$(curl -fsS "$http/metrics" | awk '/^redisched_jobs_dispatched_total/ {n += $NF} END {print n + 0}')
[ "$dispatched" -ge 1 ] || fail "/metrics counts $dispatched dispatched jobs, want at least 1"
say "/metrics: $dispatched job(s) dispatched"
dashboard=$(curl -sS -w '\n%{http_code} %{content_type}' "$http/")
status=$(tail -1 <<<"$dashboard")
[[ "$status" == "200 text/html"* ]] || fail "dashboard: $status"
grep -q '<title>redisched</title>' <<<"$dashboard" || fail "dashboard page has no redisched title"
say "dashboard: $status, $(wc -c <<<"$dashboard") bytes"
say "PASS"
