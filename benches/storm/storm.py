#!/usr/bin/env python3
"""Query storm against a running bucketd: RSS before, during (peak), 10 s and 20 s after.

docs/PERFORMANCE.md, "Memory after a query storm": 8 clients looping
index-defeating PromQL (regexes over every series, {__name__=~".+"}, step 1s over raw windows)
and accepted ones over hundreds of series.

usage: storm.py <pid> <http addr> [seconds] [clients] [--warm]
(--warm: each query once first, the store cache warmed, then 10 s idle)
"""
import sys, time, threading, urllib.request, urllib.parse, json

pid, addr = int(sys.argv[1]), sys.argv[2]
secs = float(sys.argv[3]) if len(sys.argv) > 3 else 20
clients = int(sys.argv[4]) if len(sys.argv) > 4 else 8

def rss_kib(field="VmRSS:"):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith(field):
            return int(l.split()[1])

now = int(time.time())
QUERIES = [
    ("query_range", {"query": '{__name__=~".+"}', "start": now - 3600, "end": now, "step": 1}),
    ("query_range", {"query": 'max_over_time(bucketd_reading{sensor=~"s.*"}[5m])', "start": now - 3600, "end": now, "step": 1}),
    ("query_range", {"query": 'avg_over_time(bucketd_reading{series=~".*t.*"}[10m])', "start": now - 7200, "end": now, "step": 5}),
    ("query", {"query": 'quantile_over_time(0.99, bucketd_reading{metric=~"m.*"}[2h])', "time": now}),
    ("query_range", {"query": 'sum by (sensor) (rate(bucketd_reading{sensor=~".+"}[1m]))', "start": now - 3600, "end": now, "step": 1}),
    ("query_range", {"query": 'count_over_time({__name__=~"bucketd_.*", sensor=~".*"}[30m])', "start": now - 3600, "end": now, "step": 1}),
    ("query_range", {"query": 'max_over_time(bucketd_reading{sensor=~"s1.*"}[5m])', "start": now - 3600, "end": now, "step": 15}),
    ("query_range", {"query": 'rate(bucketd_reading{sensor=~"s2.*"}[10m])', "start": now - 7200, "end": now, "step": 30}),
    ("query_range", {"query": 'bucketd_bucket_p99{sensor=~"s[3-9].*"}', "start": now - 7200, "end": now, "step": 60}),
]
stop = False
codes = {}
lock = threading.Lock()

def client(k):
    i = k
    while not stop:
        kind, params = QUERIES[i % len(QUERIES)]
        i += 1
        url = f"http://{addr}/prom/api/v1/{kind}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                r.read(); code = r.status
        except urllib.error.HTTPError as e:
            e.read(); code = e.code
        except Exception as e:
            code = type(e).__name__
        with lock:
            codes[code] = codes.get(code, 0) + 1

if "--warm" in sys.argv:
    # Each query once, one at a time: the store's cache (store.cache_size) warmed, as on a
    # gateway that has been answering queries, so that "before" is not a cold process.
    for kind, params in QUERIES:
        url = f"http://{addr}/prom/api/v1/{kind}?" + urllib.parse.urlencode(params)
        try:
            urllib.request.urlopen(url, timeout=30).read()
        except urllib.error.HTTPError as e:
            e.read()
    time.sleep(10)
before = rss_kib()
before_anon = rss_kib("RssAnon:")
ts = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
for t in ts: t.start()
peak = before
t0 = time.time()
while time.time() - t0 < secs:
    peak = max(peak, rss_kib()); time.sleep(0.1)
stop = True
for t in ts: t.join()
end = rss_kib()
time.sleep(10)
after = rss_kib()
after_anon = rss_kib("RssAnon:")
time.sleep(10)
after20 = rss_kib()
print(json.dumps({"before_mib": round(before/1024,1), "peak_mib": round(peak/1024,1),
                  "at_end_mib": round(end/1024,1), "after_10s_mib": round(after/1024,1),
                  "after_20s_mib": round(after20/1024,1), "anon_before_mib": round(before_anon/1024,1), "anon_after_10s_mib": round(after_anon/1024,1),
                  "codes": codes}))
