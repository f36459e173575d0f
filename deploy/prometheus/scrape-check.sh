#!/usr/bin/env bash
# End-to-end check that a real Prometheus scrapes bucketd: starts bucketd (fresh database,
# free HTTP port) against the MQTT broker on localhost:1883, publishes a few readings, starts
# Prometheus (Debian's `prometheus`) on a free port scraping it every second, and queries `up`
# and `bucketd_readings_ingested_total` from Prometheus's HTTP API.
#
#   deploy/prometheus/scrape-check.sh            # builds bucketd first (cargo build --release)
#
# Needs: prometheus, mosquitto_pub (mosquitto-clients), curl, a broker on localhost:1883.
set -euo pipefail
cd "$(dirname "$0")/../.."
for tool in prometheus mosquitto_pub curl; do
  command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install prometheus mosquitto-clients curl)" >&2; exit 1; }
done
cargo build --release --quiet
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

api_port=$(free_port)
prom_port=$(free_port)
topic_prefix="scrapecheck$$"
cat > "$work/bucketd.toml" <<TOML
[mqtt]
client_id = "bucketd-scrape-check-$$"
[store]
path = "$work/bucketd.redb"
[batch]
flush_interval = "200ms"
[http]
bind = "127.0.0.1:$api_port"
[[subscriptions]]
filter = "$topic_prefix/sensors/+/+"
template = "$topic_prefix/sensors/{sensor}/{metric}"
format = "value"
TOML
./target/release/bucketd run --config "$work/bucketd.toml" 2>"$work/bucketd.log" &
pids+=($!)
for _ in $(seq 100); do curl -sf "127.0.0.1:$api_port/readyz" >/dev/null && break; sleep 0.1; done
curl -sf "127.0.0.1:$api_port/readyz" >/dev/null || { cat "$work/bucketd.log"; exit 1; }
for v in 20.5 21 21.5 22 22.5; do mosquitto_pub -q 1 -t "$topic_prefix/sensors/kitchen/temperature" -m "$v"; done

cat > "$work/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: bucketd
    static_configs:
      - targets: ["127.0.0.1:$api_port"]
YAML
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" >"$work/prometheus.log" 2>&1 &
pids+=($!)

query() { curl -sf "127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$1"; }
for _ in $(seq 60); do
  out=$(query 'bucketd_readings_ingested_total' 2>/dev/null || true)
  if [[ "$out" == *'"5"'* ]]; then break; fi
  sleep 0.5
done
echo "prometheus $(prometheus --version 2>&1 | head -1 | awk '{print $3}') on 127.0.0.1:$prom_port scraping bucketd on 127.0.0.1:$api_port"
echo "query up:"
query 'up{job="bucketd"}'; echo
echo "query bucketd_readings_ingested_total:"
query 'bucketd_readings_ingested_total'; echo
[[ "$(query 'bucketd_readings_ingested_total')" == *'"5"'* ]] || { echo "FAILED: Prometheus did not see 5 ingested readings" >&2; exit 1; }
echo "OK"
