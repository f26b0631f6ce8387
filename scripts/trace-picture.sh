#!/usr/bin/env bash
# Regenerates docs/images/orders-trace.svg: runs Jaeger (loopback only),
# runs the orders example exporting to it, and draws the trace of order A-007
# (charged once, e-mail dead-lettered) from Jaeger's query API with the settle
# command, which also prints it as a tree.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
jaeger="$(scripts/jaeger.sh)"
work="$(mktemp -d)"
"$jaeger" --config tools/jaeger.yaml >"$work/jaeger.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
	curl -fsS http://127.0.0.1:13133/status >/dev/null 2>&1 && break
	sleep 0.1
done
service="settle-orders-$(date +%s)"
OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_SERVICE_NAME="$service" \
	SETTLE_POSTGRES_URL= SETTLE_MYSQL_URL= SETTLE_AMQP_URL= go run ./examples/orders -orders 10 -quiet
for _ in $(seq 1 100); do
	n=$(curl -fsS "http://127.0.0.1:16686/api/traces?service=$service&limit=100" | grep -o '"traceID"' | wc -l || true)
	[ "$n" -ge 10 ] && break
	sleep 0.1
done
mkdir -p docs/images
go run ./cmd/settle trace -jaeger http://127.0.0.1:16686 -service "$service" -tag order.id=A-007
go run ./cmd/settle trace -jaeger http://127.0.0.1:16686 -service "$service" -tag order.id=A-007 -svg docs/images/orders-trace.svg
