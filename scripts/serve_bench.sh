#!/usr/bin/env bash
# The server over HTTP on the GPU machine (after scripts/stage.sh --candle-cuda with
# graft-serve among --candle-bins, and scripts/gpu-run.sh having unpacked stage/): writes a
# random ~1B Llama directory, then for graft and for --eager starts `graft-serve serve` on it,
# times start to ready and to the first served token, streams one chat completion with the
# plain Python client, drives each trace with scripts/serve_load.py RUNS times, snapshots
# /metrics before and after, and stops the server with SIGINT (it drains). Figures go to
# $OUT/serve/ as JSON, one file per run.
#
# usage: scripts/serve_bench.sh [RUNS]   (default 3; traces below)
# GRAFT_SERVE_BIN, GRAFT_SERVE_PRESET (1b), GRAFT_SERVE_DTYPE (bf16), GRAFT_SERVE_MAX_SEQ (1024), GRAFT_SERVE_VOCAB (32000) and GRAFT_SERVE_TRACES ("n:rate ...") override the
# binary, the model and the traces (e.g. a CPU build, the tiny model and short traces, to try
# the script here).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
out=${OUT:-/tmp}/serve
mkdir -p "$out"
bin=${GRAFT_SERVE_BIN:-stage/bin/graft-serve_cuda}
preset=${GRAFT_SERVE_PRESET:-1b}
model=/tmp/graft-serve-$preset
port=8011
url=http://127.0.0.1:$port
# requests:rate (0: all at once, saturated)
read -ra traces <<<"${GRAFT_SERVE_TRACES:-100:8 150:100 200:0}"

# A server left running (this script stopped midway) would hold the port for the next run.
trap 'kill -INT $(jobs -p) 2>/dev/null || true' EXIT

[[ -d $model ]] || "$bin" random-model --out "$model" --preset "$preset" --dtype "${GRAFT_SERVE_DTYPE:-bf16}"

wait_ready() {
    python3 - "$url" <<'PY'
import sys, time, urllib.request
for _ in range(3000):
    try:
        urllib.request.urlopen(sys.argv[1] + "/health", timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.05)
sys.exit(1)
PY
}

for mode in graft eager; do
    flags=()
    [[ $mode == eager ]] && flags=(--eager)
    start=$(date +%s.%N)
    "$bin" serve --model "$model" --port "$port" --max-seq "${GRAFT_SERVE_MAX_SEQ:-1024}" --max-batch 32 --max-queue 1024 "${flags[@]}" \
        >"$out/server-$mode.log" 2>&1 &
    pid=$!
    wait_ready || { echo "serve_bench: the $mode server did not start:" >&2; cat "$out/server-$mode.log" >&2; exit 1; }
    ready=$(date +%s.%N)
    python3 scripts/serve_chat.py --url "$url" --max-tokens 16 >"$out/chat-$mode.json"
    first=$(date +%s.%N)
    python3 - "$start" "$ready" "$first" "$mode" >"$out/start-$mode.json" <<'PY'
import json, sys
s, r, f = map(float, sys.argv[1:4])
print(json.dumps({"mode": sys.argv[4], "start_to_ready_s": r - s, "start_to_first_reply_s": f - s}))
PY
    curl -s "$url/metrics" >"$out/metrics-$mode-before.txt"
    for run in $(seq 1 "$runs"); do
        for trace in "${traces[@]}"; do
            n=${trace%%:*}
            rate=${trace##*:}
            python3 scripts/serve_load.py --url "$url" --requests "$n" --rate "$rate" \
                --max-seq "${GRAFT_SERVE_MAX_SEQ:-1024}" --vocab "${GRAFT_SERVE_VOCAB:-32000}" --seed "$run" \
                --json "$out/load-$mode-$n-$rate-$run.json" || echo "serve_bench: a trace failed" >&2
        done
    done
    curl -s "$url/metrics" >"$out/metrics-$mode-after.txt"
    kill -INT "$pid"
    wait "$pid" || true
done
# The saturated traces through the engine alone (no HTTP, no text: `graft-serve offline`, a
# warm-up run first), against the same traces over HTTP answered whole (the streamed runs above
# also measure the Python client, which parses every chunk).
for run in $(seq 1 "$runs"); do
    for trace in "${traces[@]}"; do
        n=${trace%%:*}
        rate=${trace##*:}
        [[ $rate == 0 ]] || continue
        python3 scripts/serve_load.py --requests "$n" --rate 0 --max-seq "${GRAFT_SERVE_MAX_SEQ:-1024}" \
            --vocab "${GRAFT_SERVE_VOCAB:-32000}" --seed "$run" --dump-trace "$out/trace-$n-$run.json"
        "$bin" offline --model "$model" --trace "$out/trace-$n-$run.json" \
            --max-seq "${GRAFT_SERVE_MAX_SEQ:-1024}" --max-batch 32 2>/dev/null \
            >"$out/offline-$n-$run.json"
    done
done
"$bin" serve --model "$model" --port "$port" --max-seq "${GRAFT_SERVE_MAX_SEQ:-1024}" --max-batch 32 --max-queue 1024 \
    >"$out/server-whole.log" 2>&1 &
pid=$!
wait_ready || { echo "serve_bench: the server did not start:" >&2; cat "$out/server-whole.log" >&2; exit 1; }
for run in 0 $(seq 1 "$runs"); do
    for trace in "${traces[@]}"; do
        n=${trace%%:*}
        rate=${trace##*:}
        [[ $rate == 0 ]] || continue
        # Run 0 warms the server up, as the offline runs are.
        python3 scripts/serve_load.py --url "$url" --requests "$n" --rate 0 --no-stream \
            --max-seq "${GRAFT_SERVE_MAX_SEQ:-1024}" --vocab "${GRAFT_SERVE_VOCAB:-32000}" \
            --seed "$((run > 0 ? run : 1))" --json "$out/whole-$n-$run.json" >/dev/null
    done
done
kill -INT "$pid"
wait "$pid" || true
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "load-*.json"))):
    _, mode, n, rate, run = os.path.basename(path)[:-5].split("-")
    rows.setdefault((n, rate, mode), []).append(json.load(open(path)))
for (n, rate, mode), rs in sorted(rows.items()):
    med = lambda k: statistics.median(r[k] for r in rs)
    print(f"{n} requests at {rate}/s, {mode:5}: {med('tokens_per_s'):8.0f} tok/s  "
          f"TTFT p50 {med('ttft_p50_ms'):8.2f} p99 {med('ttft_p99_ms'):8.2f} ms  "
          f"ITL p50 {med('itl_p50_ms'):6.3f} p99 {med('itl_p99_ms'):7.3f} ms  "
          f"({len(rs)} runs, failed {sum(r['failed'] for r in rs)})")
offline = {}
for path in sorted(glob.glob(os.path.join(out, "offline-*.json"))):
    _, n, run = os.path.basename(path)[:-5].split("-")
    offline.setdefault(n, []).append(json.load(open(path))["tokens_per_s"])
for n, tps in sorted(offline.items()):
    whole = [json.load(open(p))["tokens_per_s"]
             for p in glob.glob(os.path.join(out, f"whole-{n}-*.json")) if not p.endswith("-0.json")]
    http = statistics.median(whole)
    print(f"{n} requests at once, engine alone (offline): {statistics.median(tps):8.0f} tok/s; "
          f"over HTTP (whole responses) {http:8.0f} tok/s: {http / statistics.median(tps):.3f}x "
          f"({len(tps)} and {len(whole)} runs)")
for f in sorted(glob.glob(os.path.join(out, "start-*.json"))) + sorted(glob.glob(os.path.join(out, "chat-*.json"))):
    print(os.path.basename(f), open(f).read().strip()[:300])
PY
