#!/usr/bin/env python3
"""A plain Python client (standard library only) streaming one chat completion from
graft-serve, checking OpenAI's chunk format on the way; exits non-zero on anything wrong.

    python3 scripts/serve_chat.py --url http://127.0.0.1:8000 --message "Hello"
"""

import argparse
import http.client
import json
import sys
import urllib.parse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--message", default="Say hello.")
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    parts = urllib.parse.urlsplit(a.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    body = {"messages": [{"role": "user", "content": a.message}], "max_tokens": a.max_tokens,
            "temperature": 0.7, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        print(f"status {resp.status}: {resp.read().decode()}", file=sys.stderr)
        return 1
    text, chunks, reason, usage, done = "", 0, None, None, False
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        assert chunk["object"] == "chat.completion.chunk", chunk
        chunks += 1
        if chunk.get("usage"):
            usage = chunk["usage"]
            continue
        choice = chunk["choices"][0]
        if chunks == 1:
            assert choice["delta"].get("role") == "assistant", chunk
        text += choice["delta"].get("content") or ""
        reason = choice["finish_reason"] or reason
    ok = done and reason in ("stop", "length") and usage and usage["completion_tokens"] > 0
    print(json.dumps({"chunks": chunks, "finish_reason": reason, "usage": usage,
                      "text": text, "ok": bool(ok)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
