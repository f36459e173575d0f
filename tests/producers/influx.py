"""Line protocol as the InfluxDB Python client writes it (issue 54): points built with
`influxdb_client.Point` and rendered by its own line-protocol writer, several lines a message,
escapes in names and tag values, every field type, nanosecond timestamps.

Prints JSON lines: {"message": [topic, payload]} and {"reading": [series, ts_ns, value]}, the
series named as README says (the measurement, its tags sorted by key, "/", the field key).

Usage: influx.py <topic prefix> <now in seconds>
"""

import json
import random
import sys

from influxdb_client import Point, WritePrecision

prefix, now = sys.argv[1], int(sys.argv[2])
rng = random.Random(54)
hour = now // 3600 * 3600 - 3600
sites = [("north", "a b"), ("south,east", "x=y")]
for message in range(40):
    lines = []
    for site, area in sites:
        ts = (hour + rng.randrange(3600)) * 1_000_000_000 + rng.randrange(1_000_000_000)
        temp = round(rng.uniform(-20, 40), 3)
        hum = rng.randrange(0, 100)
        count = rng.randrange(0, 2**40)
        ok = rng.random() < 0.5
        point = (
            Point("weather station")
            .tag("site", site)
            .tag("area", area)
            .field("temp", temp)
            .field("hum", hum)  # an int: the client writes 40i
            .field("ok", ok)
            .field("note", f'said "hi", {message}')
            .time(ts, WritePrecision.NS)
        )
        if message % 3 == 0:
            point = point.field("count", count)
        lines.append(point.to_line_protocol())
        sensor = ",".join(["weather station"] + [f"{k}={v}" for k, v in sorted([("site", site), ("area", area)])])
        fields = [("temp", temp), ("hum", float(hum)), ("ok", 1.0 if ok else 0.0)]
        if message % 3 == 0:
            fields.append(("count", float(count)))
        for name, value in fields:
            print(json.dumps({"reading": [f"{sensor}/{name}", ts, value]}))
    print(json.dumps({"message": [f"{prefix}/telegraf", "\n".join(lines)]}))
