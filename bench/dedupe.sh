#!/usr/bin/env bash
# Runs the dedupe claim+confirm benchmarks (settle stores against a raw-SQL
# floor) and prints the median msgs/s of each and their ratio.
#
#   bench/dedupe.sh                 # local PostgreSQL and MariaDB on 127.0.0.1
#   BENCHTIME=2s COUNT=5 bench/dedupe.sh
#
# The raw `go test` output is kept in $OUT (default: a temporary file whose
# name is printed at the end). Takes about 2 minutes with the defaults.
set -euo pipefail

cd "$(dirname "$0")/.."

export SETTLE_POSTGRES_URL="${SETTLE_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}"
export SETTLE_MYSQL_URL="${SETTLE_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}"
# A database that cannot be reached fails the run instead of leaving a hole
# in the table.
export SETTLE_REQUIRE_INTEGRATION="${SETTLE_REQUIRE_INTEGRATION:-1}"

BENCHTIME="${BENCHTIME:-1s}"
COUNT="${COUNT:-3}"
OUT="${OUT:-$(mktemp -t settle-dedupe-bench.XXXXXX)}"

go test ./dedupe/ -run '^$' -bench 'ClaimConfirm' -benchtime "$BENCHTIME" -count "$COUNT" -timeout 20m | tee "$OUT"
echo
echo "median of $COUNT runs, -benchtime $BENCHTIME (raw output: $OUT)"
echo
go -C bench run ./ratio < "$OUT"
