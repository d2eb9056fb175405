#!/usr/bin/env python3
"""PyTorch's usual sampler on the shapes graft-candle-sample times: `[batch, vocab]` f32
logits at batch 1, 8 and 32 and vocabularies 32000, 128256 and 151936; argmax, temperature
only, top-k 50, top-p 0.9, and both, each as transformers' logits warpers do it (top-k:
`torch.topk` and a mask; top-p: a sort, a softmax, a cumulative sum, a mask scattered back),
then `softmax` and `torch.multinomial`. Each variant: N launches after a warm-up, timed with
CUDA events around all of them, the mean per launch; variants alternate in rounds, medians.

    python3 scripts/torch_sample.py --json out.json
"""

import argparse
import json
import statistics

import torch


def top_k(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[..., -1, None]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits, p):
    sorted_logits, idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - p)
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))


def sampler(temperature=None, k=None, p=None):
    def run(logits):
        if temperature is None:
            return logits.argmax(dim=-1)
        x = logits / temperature
        if k is not None:
            x = top_k(x, k)
        if p is not None:
            x = top_p(x, p)
        return torch.multinomial(x.softmax(dim=-1), 1).squeeze(-1)
    return run


VARIANTS = [
    ("argmax", sampler()),
    ("temperature", sampler(0.8)),
    ("top_k 50", sampler(0.8, k=50)),
    ("top_p 0.9", sampler(0.8, p=0.9)),
    ("top_k 50 + top_p 0.9", sampler(0.8, k=50, p=0.9)),
]


def time_us(f, logits, launches):
    f(logits)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        f(logits)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / launches


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--launches", type=int, default=300)
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--json")
    o = a.parse_args()
    torch.manual_seed(0)
    rows = []
    print("| batch | vocab | variant | µs per launch |\n| --- | --- | --- | --- |")
    for batch in (1, 8, 32):
        for vocab in (32000, 128256, 151936):
            logits = torch.randn(batch, vocab, device="cuda") * 3.0
            samples = {name: [] for name, _ in VARIANTS}
            for _ in range(o.rounds):
                for name, f in VARIANTS:
                    samples[name].append(time_us(f, logits, o.launches // o.rounds))
            for name, s in samples.items():
                us = statistics.median(s)
                print(f"| {batch} | {vocab} | {name} | {us:.2f} |")
                rows.append({"batch": batch, "vocab": vocab, "variant": name, "us": us})
    if o.json:
        with open(o.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
