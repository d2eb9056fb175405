#!/usr/bin/env python3
"""PyTorch reference for graft-candle's Llama ~1B decode benchmark (docs/benchmarks.md).

The model is transformers' own LlamaForCausalLM with random weights in bf16, shaped as
graft-candle-models' `Sizes::ONE_B`: 16 layers, hidden 2048, 32 query and 8 KV heads (head
dim 64), MLP 8192 (SiLU), vocab 32000, RMSNorm eps 1e-5, rope theta 500000, untied head.
The KV cache is transformers' StaticCache of --cache positions per sequence.

One decode step: tokens [B, 1] and the cache position (a [1] int64 tensor on the device)
in, the greedy next tokens [B, 1] out; the step writes K and V at the position into the
static cache. Positions start at 0 and wrap to 0 before --wrap (default 200: every timed
position stays below 256, whatever the cache length) outside the timed region.

Modes: eager (plain calls) and reduce_overhead (torch.compile(mode="reduce-overhead"):
Inductor and CUDAGraph Trees, cudagraph_mark_step_begin before each step).

The bandwidth floor: a device-to-device copy of as many bytes as the model's parameters,
timed with CUDA events (median of 20): a decode step at batch 1 must read every weight once,
so half the copy's time (it reads and writes) is the floor of one step.

Timing per (mode, cache, batch): --warmup steps (compilation and recording happen there),
then --steps steps, each between a pair of CUDA events; the median is reported. TF32 is
off. Prints one line per measurement and writes --json if given.

Example: python3 scripts/torch_llama_decode.py --batches 1,8,32 --cache 256,4096
"""

import argparse
import json
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import StaticCache


def config(max_positions):
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
    )


def static_cache(cfg, batch, length):
    """transformers' StaticCache across its constructor's versions."""
    try:
        return StaticCache(
            config=cfg,
            max_batch_size=batch,
            max_cache_len=length,
            device="cuda",
            dtype=torch.bfloat16,
        )
    except TypeError:
        return StaticCache(config=cfg, max_cache_len=length)


def measure(model, cfg, mode, batch, length, args):
    cache = static_cache(cfg, batch, length)

    def decode(tokens, position):
        out = model(
            input_ids=tokens,
            past_key_values=cache,
            cache_position=position,
            use_cache=True,
        )
        return out.logits[:, -1:].argmax(-1)

    tokens = torch.arange(batch, device="cuda").reshape(batch, 1) * 37 % cfg.vocab_size
    position = torch.zeros(1, dtype=torch.long, device="cuda")
    # One eager step first: the cache allocates its tensors on its first update (recent
    # transformers). Then every tensor it holds is marked a static address, so that CUDAGraph
    # Trees record the step with the cache's in-place updates (its counters included) instead
    # of skipping the graph for mutated inputs.
    with torch.no_grad():
        decode(tokens, position)
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if torch.is_tensor(value):
                torch._dynamo.mark_static_address(value)
    step = decode
    if mode == "reduce_overhead":
        step = torch.compile(decode, mode="reduce-overhead", fullgraph=True)
    at = 0
    times = []
    for i in range(args.warmup + args.steps):
        if at >= args.wrap:
            at = 0
        position.fill_(at)
        if mode == "reduce_overhead":
            torch.compiler.cudagraph_mark_step_begin()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.no_grad():
            tokens = step(tokens, position).clone()
        end.record()
        end.synchronize()
        if i >= args.warmup:
            times.append(start.elapsed_time(end) * 1000.0)
        at += 1
    return statistics.median(times)


def floor_us(nbytes):
    """Half the median time of a device-to-device copy of `nbytes` (the read of one step)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times[5:]) / 2


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--cache", default="256", help="static cache lengths, comma-separated")
    p.add_argument("--modes", default="eager,reduce_overhead")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--wrap", type=int, default=200)
    p.add_argument("--json")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    lengths = [int(c) for c in args.cache.split(",")]
    cfg = config(max(lengths))
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor = floor_us(nbytes)
    print(f"floor: {nbytes / 1e9:.3f} GB of parameters, read in {floor:.1f} us (half a device copy)", flush=True)
    rows = [{"mode": "floor", "bytes": nbytes, "us": floor}]
    if "reduce_overhead" in args.modes.split(","):
        # A throwaway compile first: in torch 2.11 the process's first compiled step skipped
        # CUDA graphs ("mutated inputs", the cache's counters) although every cache tensor was
        # marked static; later compiles record them. stderr shows any skip that remains.
        measure(model, cfg, "reduce_overhead", 2, lengths[0], argparse.Namespace(**{**vars(args), "steps": 2, "warmup": 1}))
        torch._dynamo.reset()
    for mode in args.modes.split(","):
        for length in lengths:
            for batch in [int(b) for b in args.batches.split(",")]:
                us = measure(model, cfg, mode, batch, length, args)
                torch._dynamo.reset()
                rows.append({"mode": mode, "cache": length, "batch": batch, "us": us})
                print(f"torch {torch.__version__} {mode:16} cache {length:5} B={batch:<3} {us:9.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
