#!/usr/bin/env bash
# Runs the whole stack of docker-compose.yml (Redis, RabbitMQ, and redisched built from this
# checkout). With Docker and an image registry this is just `docker compose up --build`;
# on a Debian machine without them it first installs and starts Debian's Docker engine
# (scripts/docker-setup.sh, needs root) and builds local stand-ins for the base images
# (scripts/docker-images.sh). Arguments go to `up`:
#   bash scripts/compose-up.sh             # foreground, Ctrl-C stops the stack
#   bash scripts/compose-up.sh -d          # in the background; stop: docker compose down
# Host ports come from HOST_PORT_AMQP, HOST_PORT_MANAGEMENT, HOST_PORT_HTTP (see the file).
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

# the compose v2 plugin if the docker CLI has it, else Debian's docker-compose (v1)
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null; then
    compose=(docker-compose)
else
    echo "compose-up: neither \`docker compose\` nor docker-compose is installed" >&2
    exit 1
fi
exec "${compose[@]}" up --build "$@"
