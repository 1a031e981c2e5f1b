#!/usr/bin/env bash
# Starts Redis (127.0.0.1:6379) and RabbitMQ (127.0.0.1:5672) if they are not answering;
# installs them from Debian's packages first if they are missing. Idempotent.
set -euo pipefail

need_install=()
command -v redis-server >/dev/null || need_install+=(redis-server)
command -v rabbitmq-server >/dev/null || need_install+=(rabbitmq-server)
if ((${#need_install[@]})); then
  echo "installing ${need_install[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_install[@]}"
fi

if ! redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
  echo "starting redis-server"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 50); do redis-cli ping 2>/dev/null | grep -q PONG && break; sleep 0.2; done
fi
redis-cli ping | grep -q PONG || { echo "redis did not start" >&2; exit 1; }

amqp_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }
if ! amqp_up; then
  echo "starting rabbitmq-server"
  rabbitmq-server -detached || true
  for _ in $(seq 1 120); do amqp_up && break; sleep 1; done
fi
amqp_up || { echo "rabbitmq did not start" >&2; exit 1; }
rabbitmqctl await_startup >/dev/null 2>&1 || true
# The release before partitioned commands through the bundled consistent-hash exchange;
# a bridge moving a deployment off that topology unbinds it (docs/src/partitions.md,
# "Partitioned commands"). This release's partitions do not need it. Enabling an enabled plugin is a
# no-op.
rabbitmq-plugins enable rabbitmq_consistent_hash_exchange >/dev/null
echo "redis and rabbitmq are up"
