#!/usr/bin/env bash
# Stops the dockerd that scripts/docker-setup.sh started (by its pid file; containerd goes
# with it). Leaves any other Docker engine alone.
set -u
PIDFILE=${DOCKERD_PIDFILE:-/run/dockerd-redisched.pid}
[ -f "$PIDFILE" ] || { echo "docker-stop: no $PIDFILE, nothing to stop"; exit 0; }
pid=$(cat "$PIDFILE")
kill -TERM "$pid" 2>/dev/null || { echo "docker-stop: dockerd $pid is not running"; exit 0; }
for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
if kill -0 "$pid" 2>/dev/null; then
    echo "docker-stop: dockerd $pid still running after 30 s"
    exit 1
fi
echo "docker-stop: dockerd $pid stopped"
