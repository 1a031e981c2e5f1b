#!/usr/bin/env bash
# Makes a Docker engine available for the compose test: installs Debian's docker.io,
# docker-compose (v1) and debootstrap if missing, and starts dockerd in the background when
# none answers (these machines have no systemd). Idempotent. Needs root and the Debian archive.
#   bash scripts/docker-setup.sh
# Stop the daemon it started with scripts/docker-stop.sh.
set -euo pipefail
DOCKER=/usr/bin/docker # Debian's CLI, matching Debian's daemon (/usr/local/bin/docker may be newer)
STATE=${DOCKER_STATE_DIR:-/var/tmp/redisched-docker}
PIDFILE=${DOCKERD_PIDFILE:-/run/dockerd-redisched.pid}
mkdir -p "$STATE"
t0=$(date +%s)

if [ ! -x /usr/sbin/dockerd ] || [ ! -x $DOCKER ] || ! command -v docker-compose >/dev/null \
    || ! command -v debootstrap >/dev/null; then
    echo "docker-setup: installing docker.io docker-compose debootstrap"
    apt-get update -q >/dev/null
    # another job may hold the dpkg lock: wait for it rather than fail
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -q \
        docker.io docker-compose debootstrap >"$STATE/apt.log" 2>&1 \
        || { tail -20 "$STATE/apt.log"; exit 1; }
fi

if $DOCKER info >/dev/null 2>&1; then
    echo "docker-setup: dockerd already answers"
else
    setsid /usr/sbin/dockerd --pidfile "$PIDFILE" >"$STATE/dockerd.log" 2>&1 </dev/null &
    daemon=$!
    for _ in $(seq 60); do
        $DOCKER info >/dev/null 2>&1 && break
        kill -0 "$daemon" 2>/dev/null || break # it exited: waiting longer is pointless
        sleep 1
    done
    if ! $DOCKER info >/dev/null 2>&1; then
        echo "docker-setup: dockerd did not start, see $STATE/dockerd.log"
        tail -30 "$STATE/dockerd.log"
        exit 1
    fi
    echo "docker-setup: dockerd started (pid $(cat "$PIDFILE"), log $STATE/dockerd.log)"
fi
$DOCKER info 2>/dev/null | grep -E 'Server Version|Storage Driver' || true
echo "docker-setup: $(($(date +%s) - t0)) s"
