#!/usr/bin/env bash
# Print jobs as they come due on redisched.ready, with amqp-consume (Debian/Ubuntu: apt
# install amqp-tools). What amqp-consume cannot do:
# - hand the job's message_id or headers to the command it runs per job: the command gets
#   the body on stdin only, so a shell consumer's jobs carry what it needs in the body;
# - keep a durable queue: bound with -e, its queue goes away with it. While no queue is
#   bound to a topic, the bridge keeps that topic's due jobs in Redis and retries them with
#   backoff (up to a minute apart), so a consumer started later still gets them.
# It acks a job once the command exits 0 (at-least-once: a job may come twice).
# Settings: AMQP_URL, READY_EXCHANGE (redisched.ready), QUEUE (emails), TOPIC (emails).
set -euo pipefail
url=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
exchange=${READY_EXCHANGE:-redisched.ready}
queue=${QUEUE:-emails}
topic=${TOPIC:-emails}

echo "waiting for jobs on queue $queue"
exec amqp-consume --url "$url" -q "$queue" -e "$exchange" -r "$topic" -- sh -c 'echo "job: $(cat)"'
