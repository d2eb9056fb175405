#!/usr/bin/env python3
"""PyTorch reference for graft-candle's prefill (docs/benchmarks.md): the time from a prompt
to its first token on the ~1B Llama, transformers' own LlamaForCausalLM with random weights in
bf16 (torch_llama_decode.py's config), its attention through PyTorch's scaled_dot_product_
attention (flash attention on the GPU).

A prompt of --tokens tokens goes through the model in one forward pass into a StaticCache of
--cache positions, and the greedy next token is taken from the last position's logits: what
graft-candle-serve reports as the time to the first token of a lone request (graft prefills
in chunks of its largest bucket, 512, and samples on the device).

Timing: --warmup runs, then --runs runs, each between a synchronize and the read of the token
on the host; the median is reported. TF32 is off.

Example: python3 scripts/torch_llama_prefill.py --tokens 4032 --cache 4096
"""

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from torch_llama_decode import config, static_cache


def first_token(model, cache, tokens, start):
    position = torch.arange(start, start + tokens.shape[1], device="cuda")
    kwargs = dict(input_ids=tokens, past_key_values=cache, cache_position=position, use_cache=True)
    try:
        # Only the last position's logits (older transformers compute them all).
        out = model(**kwargs, logits_to_keep=1)
    except TypeError:
        out = model(**kwargs)
    return out.logits[:, -1].argmax(-1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4032)
    p.add_argument("--cache", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = config(args.cache)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(11)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda", generator=g)
    cache = static_cache(cfg, 1, args.cache)
    times = []
    with torch.inference_mode():
        for run in range(args.warmup + args.runs):
            cache.reset()
            torch.cuda.synchronize()
            start = time.perf_counter()
            first_token(model, cache, tokens, 0).item()
            if run >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    print(f"pytorch {torch.__version__} sdpa, {args.tokens} tokens: time to the first token {ms:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "ttft_ms": ms, "runs_ms": times}, f)


if __name__ == "__main__":
    main()
