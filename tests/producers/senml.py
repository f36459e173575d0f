"""SenML packs as the kpn-senml library writes them (issue 54): a pack with a base name, base
time and base value (the library subtracts them from each record), a child pack with its own
base name, boolean records (its string records fail on Python 3: `basestring`).

Prints JSON lines: {"message": [topic, payload]}, {"reading": [series, ts_ns, value]} and
{"rejected": reason} for what the RFC makes of the pack that bucketd must refuse, the
series named as README says (the base name without its trailing separator, "/", the record's
name with "/" turned into ".").

Usage: senml.py <topic prefix> <now in seconds>
"""

import json
import random
import sys

from kpn_senml import SenmlPack, SenmlRecord

prefix, now = sys.argv[1], int(sys.argv[2])
rng = random.Random(8428)
hour = now // 3600 * 3600 - 3600
for message in range(30):
    base_time = hour + rng.randrange(3000)
    pack = SenmlPack("urn:dev:mac:0024befffe80" + str(message % 3) + ":")
    pack.base_time = base_time
    pack.base_value = 20
    readings = []
    for i in range(3):
        t = base_time + i * 10 + rng.randrange(10)
        v = round(rng.uniform(15, 30), 2)
        pack.add(SenmlRecord("temp", value=v, time=t))
        # The library writes v - bv; the RFC's reading is bv + that (the same f64 operations).
        readings.append(("temp", t, 20 + (v - 20)))
    on = rng.random() < 0.5
    pack.add(SenmlRecord("relay/on", value=on, time=base_time))
    readings.append(("relay.on", base_time, 1.0 if on else 0.0))
    child = SenmlPack("plant/pump/")
    w = round(rng.uniform(0, 5), 3)
    child.add(SenmlRecord("power", value=w, time=base_time + 1))
    pack.add(child)
    sensor = pack.name.rstrip(":")
    for name, t, v in readings:
        print(json.dumps({"reading": [f"{sensor}/{name}", t * 1_000_000_000, float(v)]}))
    # The child pack's record: kpn-senml 1.0.1 writes its time absolute, but the parent's bt
    # still applies to it (RFC 8428 section 4.5.3: a base field applies until replaced), so it
    # resolves to about twice the epoch time: refused as out of range, and counted.
    print(json.dumps({"rejected": "timestamp_out_of_range"}))
    print(json.dumps({"message": [f"{prefix}/senml/{message}", pack.to_json()]}))
