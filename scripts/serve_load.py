#!/usr/bin/env python3
"""Load generator for graft-serve's HTTP API (Python standard library only).

Sends a Poisson trace of streamed greedy completions (prompts as token ids, so no tokenizer
is needed here), each in its own thread, and reports throughput, time to first token (TTFT)
and inter-token latency (ITL, the gaps between streamed chunks) at p50 and p99. Lengths are
drawn as graft-candle-serve's in-process trace draws them (log-uniform prompts of 16 to 768
tokens capped at half of --max-seq, outputs of 16 to 256 capped to fit), so the two measure
the same kind of load.

    python3 scripts/serve_load.py --url http://127.0.0.1:8000 --requests 300 --rate 40 \
        --json out.json

A rate of 0 sends every request at once (a saturated trace).
"""

import argparse
import http.client
import json
import math
import random
import statistics
import sys
import threading
import time
import urllib.parse


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def connect(url):
    """A connection opened now, so that the trace's clock does not count TCP setup."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    conn.connect()
    return conn


def one(conn, body, out, index):
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out[index] = {"status": resp.status, "error": resp.read().decode()}
        return
    if not body.get("stream"):
        whole = json.loads(resp.read())
        conn.close()
        out[index] = {"status": 200, "start": start, "times": [time.perf_counter()],
                      "usage": whole["usage"]}
        return
    times = []
    usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            times.append(time.perf_counter())
    conn.close()
    out[index] = {"status": 200, "start": start, "times": times, "usage": usage}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=40.0, help="requests per second; 0: all at once")
    p.add_argument("--max-seq", type=int, default=1024, help="the server's positions per sequence")
    p.add_argument("--vocab", type=int, default=250, help="prompt token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--no-stream", action="store_true",
                   help="whole responses (throughput only: no TTFT or ITL, and far less client work)")
    p.add_argument("--dump-trace", help="write the trace's requests here (for `graft-serve offline`) and exit")
    a = p.parse_args()
    rng = random.Random(a.seed)
    def log_uniform(lo, hi):
        return round(math.exp(math.log(lo) + rng.random() * (math.log(hi) - math.log(lo))))

    bodies = []
    for _ in range(a.requests):
        n = min(log_uniform(16, 768), a.max_seq // 2)
        new = min(log_uniform(16, 256), a.max_seq - n)
        prompt = [rng.randrange(1, a.vocab) for _ in range(n)]
        body = {"prompt": prompt, "max_tokens": new, "temperature": 0}
        if not a.no_stream:
            body.update({"stream": True, "stream_options": {"include_usage": True}})
        bodies.append(body)
    if a.dump_trace:
        with open(a.dump_trace, "w") as f:
            json.dump([{"prompt": b["prompt"], "max_tokens": b["max_tokens"]} for b in bodies], f)
        return 0
    out = [None] * a.requests
    threads = []
    # Every connection is open before the clock starts: the trace times serving, not setup.
    conns = [connect(a.url) for _ in bodies]
    t0 = time.perf_counter()
    at = 0.0
    for i, body in enumerate(bodies):
        if a.rate > 0:
            at += rng.expovariate(a.rate)
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        t = threading.Thread(target=one, args=(conns[i], body, out, i))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [o for o in out if o and o["status"] == 200 and o["times"]]
    failed = [o for o in out if not o or o["status"] != 200]
    ttft = [o["times"][0] - o["start"] for o in ok]
    itl = [b - a_ for o in ok for a_, b in zip(o["times"], o["times"][1:])]
    tokens = sum(o["usage"]["completion_tokens"] for o in ok if o["usage"])
    figures = {
        "requests": a.requests, "rate": a.rate, "ok": len(ok), "failed": len(failed),
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else float("nan"),
    }
    print(json.dumps(figures))
    if failed:
        print("failed:", failed[:3], file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
