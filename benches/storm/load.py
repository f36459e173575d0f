#!/usr/bin/env python3
"""Publishes 3,001 series (1,000 sensors x 3 metrics + 1) with readings over the last 2 hours
to devices/<s>/telemetry on 127.0.0.1:1883 via mosquitto_pub -l."""
import subprocess, time, json, sys
prefix = sys.argv[1] if len(sys.argv) > 1 else ""
now = int(time.time() * 1000)
lines = []
for s in range(1000):
    for k in range(12):
        ts = now - 7_200_000 + k * 600_000 + s
        lines.append(json.dumps({"ts": ts, "t": 20 + (s + k) % 7, "h": 50 + k, "m0": s}))
    p = subprocess.run(["mosquitto_pub", "-q", "1", "-t", f"{prefix}devices/s{s}/telemetry", "-l"],
                       input="\n".join(lines) + "\n", text=True)
    lines = []
subprocess.run(["mosquitto_pub", "-q", "1", "-t", f"{prefix}devices/extra/telemetry", "-m", json.dumps({"ts": now, "x": 1})])
