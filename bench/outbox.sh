#!/usr/bin/env bash
# Runs the outbox benchmark (bench/outbox): a direct publish, Watermill's
# bare forwarder over watermill-sql and settle's outbox relay, side by side in
# one run, on the local PostgreSQL into GoChannel and RabbitMQ, and prints the
# median of each cell and the ratio settle/bare.
#
#   bench/outbox.sh                  # local PostgreSQL and RabbitMQ on 127.0.0.1
#   N=20000 RUNS=5 POLL=20ms bench/outbox.sh
#
# Three invocations:
#   1. GoChannel and RabbitMQ with watermill-amqp's durable-queue config as it
#      is (a channel opened and closed per Publish);
#   2. RabbitMQ with a pool of 4 publishing channels (Publish.ChannelPoolSize);
#   3. the paced scenario again with settle's default PollInterval (50ms).
# The per-run lines go to $OUT (default: a temporary file whose name is
# printed at the end). Takes about 7 minutes with the defaults.
set -euo pipefail

# The harness's own module (bench/go.mod).
cd "$(dirname "$0")"

export SETTLE_POSTGRES_URL="${SETTLE_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}"
export SETTLE_AMQP_URL="${SETTLE_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/}"

N="${N:-10000}"
RUNS="${RUNS:-3}"
POLL="${POLL:-10ms}"
RATE="${RATE:-1000}"
PACED="${PACED:-5s}"
OUT="${OUT:-$(mktemp -t settle-outbox-bench.XXXXXX)}"

go build -o "$OUT.bin" ./outbox
trap 'rm -f "$OUT.bin"' EXIT
common=(-n "$N" -runs "$RUNS" -rate "$RATE" -paced "$PACED")

{
	echo "## 1. GoChannel and RabbitMQ (durable-queue config), PollInterval $POLL"
	"$OUT.bin" "${common[@]}" -poll "$POLL" -broker gochannel,amqp
	echo
	echo "## 2. RabbitMQ, 4 pooled publishing channels, PollInterval $POLL"
	"$OUT.bin" "${common[@]}" -poll "$POLL" -broker amqp -amqp-pool 4
	echo
	echo "## 3. paced, settle's default PollInterval 50ms"
	"$OUT.bin" "${common[@]}" -poll 50ms -broker gochannel,amqp -amqp-pool 4 -scenarios paced
} 2> >(tee "$OUT" >&2)
echo
echo "per-run figures: $OUT"
