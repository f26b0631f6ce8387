#!/usr/bin/env bash
# Builds Jaeger v2 from the Go module proxy (through the tools module, never
# committed) and prints the binary's path. The first build takes about 11.5
# minutes on 2 cores (a ~120 MB binary); later ones come from the Go build
# cache in seconds.
#
#   JAEGER=$(scripts/jaeger.sh)
#   "$JAEGER" --config tools/jaeger.yaml   # OTLP on 127.0.0.1:4317/4318, API on 127.0.0.1:16686
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${SETTLE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/settle-tools}"
mkdir -p "$out"
(cd "$root/tools" && go build -o "$out/jaeger" github.com/jaegertracing/jaeger/cmd/jaeger) >&2
echo "$out/jaeger"
