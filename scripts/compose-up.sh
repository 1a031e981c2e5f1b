#!/usr/bin/env bash
# Runs the whole stack of docker-compose.yml (Redis, RabbitMQ, and redisched built from this
# checkout). With Docker and an image registry this is just `docker compose up --build`;
# on a Debian machine without them it first installs and starts Debian's Docker engine
# (scripts/docker-setup.sh, needs root) and builds local stand-ins for the base images
# (scripts/docker-images.sh). Arguments go to `up`:
#   bash scripts/compose-up.sh             # foreground, Ctrl-C stops the stack
#   bash scripts/compose-up.sh -d          # in the background; stop: docker compose down
# Host ports come from HOST_PORT_AMQP, HOST_PORT_MANAGEMENT, HOST_PORT_HTTP (defaults 5672,
# 15672, 7171, on 127.0.0.1); one left unset whose default is taken (say by the local RabbitMQ
# the tests use) moves to the next free port, and the script says which.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! docker info >/dev/null 2>&1 && ! /usr/bin/docker info >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        bash scripts/docker-setup.sh
    else
        echo "compose-up: no Docker engine answers; install Docker (or run this as root on Debian)" >&2
        exit 1
    fi
fi
bash scripts/docker-images.sh

taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for spec in HOST_PORT_AMQP:5672:AMQP HOST_PORT_MANAGEMENT:15672:management HOST_PORT_HTTP:7171:HTTP; do
    IFS=: read -r var port what <<<"$spec"
    [ -z "${!var:-}" ] || continue
    if taken "$port"; then
        free=$port
        while taken "$free" && [ "$free" -lt $((port + 100)) ]; do free=$((free + 1)); done
        echo "compose-up: 127.0.0.1:$port is taken: $what on 127.0.0.1:$free ($var=$free)"
        export "$var=$free"
    fi
done

# the compose v2 plugin if the docker CLI has it, else Debian's docker-compose (v1)
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null; then
    compose=(docker-compose)
else
    echo "compose-up: neither \`docker compose\` nor docker-compose is installed" >&2
    exit 1
fi
token="change-me (set REDISCHED_HTTP__TOKEN for your own)"
[ -z "${REDISCHED_HTTP__TOKEN:-}" ] || token="your REDISCHED_HTTP__TOKEN"
echo "compose-up: dashboard http://127.0.0.1:${HOST_PORT_HTTP:-7171}/ (token: $token)," \
    "AMQP amqp://redisched:redisched@127.0.0.1:${HOST_PORT_AMQP:-5672}," \
    "management http://127.0.0.1:${HOST_PORT_MANAGEMENT:-15672}/"
exec "${compose[@]}" up --build "$@"
