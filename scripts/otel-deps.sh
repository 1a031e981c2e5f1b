#!/usr/bin/env bash
# What the OpenTelemetry tests run beside the bridge, from PyPI, pinned, installed if missing:
#   opentelemetry-proto   decodes the bridge's OTLP/HTTP export (ExportTraceServiceRequest) in
#                         the receiver tests/common/otlp_receiver.py, so the bridge's spans are
#                         read by a decoder we did not write
#   opentelemetry-sdk     the tracer of the instrumented producer and consumer
#   opentelemetry-instrumentation-pika
#                         instruments pika on both sides (tests/bridge/trace_context.rs): the
#                         producer injects traceparent, the consumer's span continues it
# Idempotent; scripts/test.sh runs it before `cargo test`.
set -euo pipefail
OTEL_VERSION=1.45.1
OTEL_CONTRIB_VERSION=0.66b1
PIKA_VERSION=1.4.4

pip_install() {
  pip install -q "$@" 2>/dev/null || pip install -q --break-system-packages "$@"
}
installed() {
  python3 - "$1" "$2" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version(sys.argv[1]) == sys.argv[2] else 1)
PY
}
want=()
for pinned in \
  "opentelemetry-api==$OTEL_VERSION" \
  "opentelemetry-sdk==$OTEL_VERSION" \
  "opentelemetry-proto==$OTEL_VERSION" \
  "opentelemetry-instrumentation-pika==$OTEL_CONTRIB_VERSION"; do
  installed "${pinned%%==*}" "${pinned##*==}" || want+=("$pinned")
done
if ! python3 -c "import pika" 2>/dev/null; then
  want+=("pika==$PIKA_VERSION")
fi
if [ ${#want[@]} -gt 0 ]; then
  echo "installing ${want[*]}"
  pip_install "${want[@]}"
fi
echo "opentelemetry $OTEL_VERSION (proto, sdk) and opentelemetry-instrumentation-pika $OTEL_CONTRIB_VERSION are installed"
