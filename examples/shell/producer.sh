#!/usr/bin/env bash
# Schedule a job by the id you choose, replace it, cancel it, then schedule another (which
# consumer.sh receives), with amqp-publish and amqp-get (Debian/Ubuntu: apt install
# amqp-tools) and curl. Run `redisched run` first.
# Settings: AMQP_URL, COMMANDS_EXCHANGE (redisched.commands), TOPIC (emails),
#           HTTP_URL (http://127.0.0.1:7171: the bridge's admin API).
#
# What amqp-publish cannot do, and what stands in for it here:
# - set message_id: the job id goes in the header x-redisched-id instead;
# - wait for a publisher confirm: it returns once the command is written to the socket. The
#   bridge's reply (reply_to, read with amqp-get) is the receipt instead: it comes only
#   after Redis has applied the command. No reply within 10 s: look the job up with curl,
#   or publish the command again (it names the job by id, so a repeat does no harm);
# - set correlation_id: so one command at a time, each waiting for its reply;
# - send numbers: header values are strings, and x-delay: 3000 is read as a number.
set -euo pipefail
url=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
exchange=${COMMANDS_EXCHANGE:-redisched.commands}
topic=${TOPIC:-emails}
http=${HTTP_URL:-http://127.0.0.1:7171}

replies=$(amqp-declare-queue --url "$url" -q "") # a queue of our own, where the bridge answers
trap 'amqp-delete-queue --url "$url" -q "$replies" >/dev/null' EXIT

send() { # op id body [delay_ms]
  local headers=(-H "x-redisched-id: $2" -H "x-redisched-op: $1")
  if [ -n "${4:-}" ]; then headers+=(-H "x-delay: $4"); fi
  amqp-publish --url "$url" -e "$exchange" -r "$topic" -p -t "$replies" "${headers[@]}" -b "$3"
  for _ in $(seq 100); do
    if reply=$(amqp-get --url "$url" -q "$replies" 2>/dev/null); then
      echo "$1 $2: $reply"
      case $reply in *'"status":"invalid"'*) exit 1 ;; esac
      return
    fi
    sleep 0.1
  done
  echo "$1 $2: no reply in 10 s; is redisched run up?" >&2
  exit 1
}

send put need_some_help_email_42 "Hi 42, need some help?" 3000
send replace need_some_help_email_42 "Hi 42, need some help? Just reply." 3000
# amqp-tools cannot read a job back; the HTTP admin API can:
echo "stored: $(curl -fsS "$http/v1/topics/$topic/jobs/need_some_help_email_42")"
send delete need_some_help_email_42 "" # user 42 found their way: cancel
send put need_some_help_email_43 "Hi 43, need some help?" 3000
