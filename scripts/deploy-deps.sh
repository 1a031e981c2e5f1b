#!/usr/bin/env bash
# Tools the deployment and metrics tests need, installed if missing:
#   promtool             (Debian package `prometheus`) tests/faces/metrics.rs checks /metrics with
#                        `promtool check metrics`; tests/deploy.rs checks and unit-tests the
#                        alert rules in deploy/prometheus/
#   kubernetes-validate  (PyPI) tests/deploy.rs validates deploy/kubernetes/ against the
#                        Kubernetes schemas it ships (no network when it runs)
#   prometheus-client    (PyPI) its strict OpenMetrics parser reads /metrics in
#                        tests/faces/metrics.rs, as promtool does the classic format
# Idempotent; scripts/test.sh runs it before `cargo test`.
set -euo pipefail

if ! command -v promtool >/dev/null; then
  echo "installing prometheus (for promtool)"
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  # promtool is in the package; its recommended exporters are not needed. Waits for a
  # dpkg lock another install holds.
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends prometheus >/dev/null
  # The package starts a Prometheus server where systemd runs; the tests need promtool only.
  if command -v systemctl >/dev/null && systemctl is-active -q prometheus 2>/dev/null; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi
if ! command -v kubernetes-validate >/dev/null; then
  echo "installing kubernetes-validate"
  pip install -q kubernetes-validate 2>/dev/null || pip install -q --break-system-packages kubernetes-validate
fi
if ! python3 -c "import prometheus_client.openmetrics.parser" 2>/dev/null; then
  echo "installing prometheus-client (Python)"
  pip install -q prometheus-client 2>/dev/null || pip install -q --break-system-packages prometheus-client
fi
echo "promtool, kubernetes-validate and prometheus-client are installed"
