#!/usr/bin/env python3
"""docs/EDGE.md, "Memory": 5,000 sensors x 2 metrics, `rounds` rounds of readings (QoS 1), to <prefix>devices/<s>/telemetry."""
import sys, time, json
import paho.mqtt.client as mqtt
prefix = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"load10k-{time.time()}")
c.max_inflight_messages_set(100)
c.connect("127.0.0.1", 1883); c.loop_start()
now = int(time.time() * 1000)
for r in range(rounds):
    infos = []
    for s in range(5000):
        payload = json.dumps({"ts": now - (rounds - r) * 60_000 + s, "t": 20 + (s + r) % 7, "h": 50 + r})
        infos.append(c.publish(f"{prefix}devices/s{s}/telemetry", payload, qos=1))
    for i in infos: i.wait_for_publish()
    print("round", r, flush=True)
c.loop_stop(); c.disconnect()
