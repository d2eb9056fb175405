#!/usr/bin/env python3
"""PyTorch side of graft's training-step benchmark (compared with the Rust/candle step).

The model is a Llama-style decoder in fp32 with random weights from a fixed seed: untied
token embedding [vocab, d]; per layer (pre-norm) RMSNorm (eps 1e-5, with weight) -> q, k, v
projections without bias (q: d -> heads*64, k and v: d -> kv_heads*64, head dim 64) ->
rotary embedding ("rotate_half": dims i and i+32 paired, theta 10000, positions 0..seq-1)
-> causal grouped-query attention through F.scaled_dot_product_attention(is_causal=True,
enable_gqa=True), scale 1/8 -> output projection without bias -> residual; RMSNorm ->
SwiGLU MLP down(silu(gate(x)) * up(x)) without biases -> residual; final RMSNorm, lm_head
d -> vocab without bias; loss = mean cross-entropy over all positions. Optimizer AdamW
(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01). TF32 is off everywhere.
  bench: 4 layers, d 512, 8 heads / 4 kv heads, FFN 1536, vocab 8192
  large: 8 layers, d 1024, 16 heads / 8 kv heads, FFN 2816, vocab 16384
  gpt2-124m: 12 layers, d 768, 12 heads / 12 kv heads, FFN 2048, vocab 50304, head tied to
    the embedding (llm.c's anchor; llm.c trains it at --seq 1024)
(--models picks them; bench alone by default.)
Tokens and targets are random int64 in [0, vocab), fixed per batch size; sequence 128.
With --amp bf16 the forward pass and loss run under torch.autocast(dtype=bfloat16): weights,
gradients and AdamW stay f32, matmuls and attention run in bf16.
In fp32 (torch 2.11, H100) SDPA has no fused kernel for enable_gqa=True and takes its math
path (matmul + softmax); --gqa repeat repeats the kv heads instead and gets the fused
memory-efficient kernels (fmha_cutlassF/B).

One step = zero grads (set to None) / forward / loss / backward / optimizer step.
Modes (each at every batch size):
  eager            plain PyTorch, AdamW default (foreach)
  reduce_overhead  torch.compile(mode="reduce-overhead", dynamic=False) of the whole step
                   function, AdamW(capturable=True), cudagraph_mark_step_begin() before each
                   step. Dynamo cannot trace it as one graph (torch 2.11): it breaks at
                   opt.zero_grad (runs eagerly), at loss.backward() (the backward runs
                   AOTAutograd's compiled backward) and around the optimizer's step (a
                   deliberate break in torch.optim), giving 3 graphs (fwd+loss, bwd, AdamW),
                   each replayed by CUDA Graph Trees. If that fails, variant "split":
                   model+loss and opt.step compiled apart, the backward called between them.
  max_autotune     as reduce_overhead with torch.compile(mode="max-autotune") (Inductor
                   benchmarks GEMM and kernel choices at compile time; CUDA graphs too).
  cuda_graph       a hand-written torch.cuda.CUDAGraph of the whole step (the "whole network
                   capture" recipe: 3 warm-up steps on a side stream, zero_grad(set_to_none),
                   capture forward+backward+AdamW(capturable=True).step()); each step copies
                   the tokens and targets into the static inputs and replays.

Per (model, mode, batch):
  * time: warm-up steps, then --steps steps, each as synchronize / perf_counter / step /
    synchronize / perf_counter (the Rust side's method): median, p10, p90 in ms; a
    cuda.Event pair inside the same bracket gives the event_* figures;
  * kernels: CUDA kernels of one step seen by torch.profiler (memcpy and memset counted
    apart; attention_kernels names the fused attention kernels, if any). For the graph
    modes the profiler may not see inside a replay, so a stand-in is profiled too
    (kernels_standin): cuda_graph an eager step with AdamW(capturable=True), reduce_overhead
    the same step compiled in default mode (no cudagraphs); `kernels` is the count seen in
    the replay when it shows any kernels, else the stand-in's (kernels_source says which);
  * memory: peak allocated during one step above the allocated before it (model, grads,
    optimizer state). Graph modes allocate from their pool during capture, so a replay
    adds ~0; graph_pool_reserved_mib is the cuda_graph pool. Under reduce_overhead the
    grads live in CUDA Graph Trees' pool, which memory_allocated does not count;
  * loss check (graph modes): after compilation/capture the weights and optimizer state are
    reset in place, --check-steps steps are run and their losses compared with an eager
    model from the same initial weights (max relative difference; not bitwise).

Examples:
  python3 scripts/torch_train.py --json torch_train.json
  python3 scripts/torch_train.py --models large --modes eager,cuda_graph --batches 8 --steps 100
  python3 scripts/torch_train.py --device cpu --quick      # smoke test without a GPU
"""

import argparse
import collections
import datetime
import json
import platform
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

ALL_MODES = ("eager", "reduce_overhead", "max_autotune", "cuda_graph")
HEAD_DIM = 64
MODELS = {
    "bench": dict(layers=4, d=512, heads=8, kv_heads=4, ffn=1536, vocab=8192),
    "large": dict(layers=8, d=1024, heads=16, kv_heads=8, ffn=2816, vocab=16384),
    # GPT-2 124M's sizes as Llama blocks (llm.c's anchor), the head tied to the embedding
    "gpt2-124m": dict(layers=12, d=768, heads=12, kv_heads=12, ffn=2048, vocab=50304, tied=True),
    "tiny": dict(layers=2, d=128, heads=4, kv_heads=2, ffn=256, vocab=512),  # --quick on cpu
}
OPT = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


# --------------------------------------------------------------------------- model


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self, c, gqa):
        super().__init__()
        d, self.heads, self.kv_heads, self.gqa = c["d"], c["heads"], c["kv_heads"], gqa
        self.attn_norm = nn.RMSNorm(d, eps=1e-5)
        self.wq = nn.Linear(d, self.heads * HEAD_DIM, bias=False)
        self.wk = nn.Linear(d, self.kv_heads * HEAD_DIM, bias=False)
        self.wv = nn.Linear(d, self.kv_heads * HEAD_DIM, bias=False)
        self.wo = nn.Linear(self.heads * HEAD_DIM, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=1e-5)
        self.gate = nn.Linear(d, c["ffn"], bias=False)
        self.up = nn.Linear(d, c["ffn"], bias=False)
        self.down = nn.Linear(c["ffn"], d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, HEAD_DIM).transpose(1, 2)  # [B, H, T, 64]
        k = self.wk(h).view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        scale = 1.0 / HEAD_DIM ** 0.5
        if self.gqa == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:  # explicit repeat of the kv heads (torch < 2.5, or --gqa repeat)
            rep = self.heads // self.kv_heads
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1),
                                               v.repeat_interleave(rep, dim=1),
                                               is_causal=True, scale=scale)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, self.heads * HEAD_DIM))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, c, seq, gqa):
        super().__init__()
        self.vocab = c["vocab"]
        self.embed = nn.Embedding(c["vocab"], c["d"])
        self.blocks = nn.ModuleList([Block(c, gqa) for _ in range(c["layers"])])
        self.norm = nn.RMSNorm(c["d"], eps=1e-5)
        self.lm_head = nn.Linear(c["d"], c["vocab"], bias=False)
        if c.get("tied"):
            self.lm_head.weight = self.embed.weight
        inv = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)  # [T, 32]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, 64]: dims i and i+32 share a frequency
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


# --amp bf16: the forward pass and loss under torch.autocast (f32 weights and optimizer, bf16
# matmuls and attention, the loss in f32 by autocast's own policy), as PyTorch users train.
AMP = None


def loss_of(model, tokens, targets):
    with torch.autocast(device_type=tokens.device.type, dtype=AMP, enabled=AMP is not None):
        logits = model(tokens)
        return F.cross_entropy(logits.view(-1, model.vocab), targets.view(-1))


def build(c, args, device, capturable):
    torch.manual_seed(args.seed)  # the same initial weights in every mode
    model = Llama(c, args.seq, args.gqa).to(device)
    opt = torch.optim.AdamW(model.parameters(), capturable=capturable, **OPT)
    return model, opt


def make_data(c, batch, args, device):
    g = torch.Generator().manual_seed(args.seed + 1000 + batch)
    tokens, targets = (torch.randint(0, c["vocab"], (batch, args.seq), generator=g)
                       for _ in range(2))
    return tokens.to(device), targets.to(device)


# --------------------------------------------------------------------------- runners


def snapshot(model):
    return [p.detach().cpu().clone() for p in model.parameters()]


class Runner:
    """step() runs one training step and returns the loss (a device scalar); reset() puts
    the weights and the optimizer state back to their initial values, in place."""

    def __init__(self, model, opt, step, init=None, **info):
        self.model, self.opt, self.step, self.info = model, opt, step, info
        self.init = init if init is not None else snapshot(model)

    @torch.no_grad()
    def reset(self):
        for p, p0 in zip(self.model.parameters(), self.init):
            p.copy_(p0)
        for st in self.opt.state.values():  # AdamW: step, exp_avg, exp_avg_sq, all 0 at start
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_runner(c, data, args, device, capturable=False):
    model, opt = build(c, args, device, capturable)
    tokens, targets = data

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens, targets)
        loss.backward()
        opt.step()
        return loss.detach()

    return Runner(model, opt, step)


def compiled_runner(c, data, args, device, variant, mode="reduce-overhead"):
    """variant "whole": the whole step function compiled; "split": model+loss and opt.step
    compiled apart, backward eager between them. mode=None: default mode (no cudagraphs)."""
    model, opt = build(c, args, device, capturable=True)
    tokens, targets = data
    kw = dict(dynamic=False) if mode is None else dict(mode=mode, dynamic=False)
    mark = torch.compiler.cudagraph_mark_step_begin
    if variant == "whole":
        def train_step(tok, tgt):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, tok, tgt)
            loss.backward()
            opt.step()
            return loss.detach()

        compiled = torch.compile(train_step, **kw)

        def step():
            mark()
            return compiled(tokens, targets)
    else:
        fwd = torch.compile(lambda tok, tgt: loss_of(model, tok, tgt), **kw)
        opt_step = torch.compile(lambda: opt.step(), **kw)

        def step():
            mark()
            opt.zero_grad(set_to_none=True)
            loss = fwd(tokens, targets)
            loss.backward()
            opt_step()
            return loss.detach()

    return Runner(model, opt, step, variant=variant)


def cuda_graph_runner(c, data, args, device):
    if device.type != "cuda":
        raise RuntimeError("cuda_graph needs a CUDA device")
    model, opt = build(c, args, device, capturable=True)
    init = snapshot(model)  # the warm-up below trains: keep the initial weights
    tokens, targets = data
    static_tok, static_tgt = tokens.clone(), targets.clone()
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):  # warm-up on a side stream (this also creates the AdamW state)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_of(model, static_tok, static_tgt).backward()
            opt.step()
    torch.cuda.current_stream(device).wait_stream(s)
    sync(device)
    opt.zero_grad(set_to_none=True)  # grads are allocated from the graph's pool
    torch.cuda.empty_cache()  # torch.cuda.graph empties it too: measure the pool alone
    reserved0 = torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = loss_of(model, static_tok, static_tgt)
        static_loss.backward()
        opt.step()
    sync(device)
    pool_mib = (torch.cuda.memory_reserved(device) - reserved0) / 2**20

    def step():
        static_tok.copy_(tokens)
        static_tgt.copy_(targets)
        graph.replay()
        return static_loss.detach()

    r = Runner(model, opt, step, init=init, graph_pool_reserved_mib=pool_mib)
    r.graph = graph  # keep alive
    return r


def reset_compiler():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def dynamo_stats():
    try:  # private API, absent in some versions
        from torch._dynamo.utils import counters
        return {"dynamo_graphs": int(counters["stats"]["unique_graphs"]),
                "graph_breaks": {k.splitlines()[0][:120]: v
                                 for k, v in counters["graph_break"].items()},
                "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}
    except Exception:
        return {}


def reduce_overhead_runner(c, data, args, device, res, mode="reduce-overhead"):
    errors = []
    for variant in {"auto": ["whole", "split"]}.get(args.ro_variant, [args.ro_variant]):
        reset_compiler()
        try:
            runner = compiled_runner(c, data, args, device, variant, mode=mode)
            run_losses(runner, 3)  # compile, cudagraph warm-up, record, first replay
            sync(device)
            res["variant_fallback_reason"] = errors
            return runner
        except Exception as e:
            errors.append(f"{variant}: {type(e).__name__}: {e}"[:2000])
            if args.verbose:
                traceback.print_exc()
    raise RuntimeError("every reduce_overhead variant failed: " + " | ".join(errors))


# --------------------------------------------------------------------------- measuring


def run_losses(runner, n):
    return [float(runner.step().item()) for _ in range(n)]


def stats_ms(xs, prefix):
    q = statistics.quantiles(xs, n=10) if len(xs) >= 2 else [xs[0]] * 9
    return {f"{prefix}median_ms": statistics.median(xs), f"{prefix}p10_ms": q[0],
            f"{prefix}p90_ms": q[-1]}


def time_steps(step, n, device):
    cuda = device.type == "cuda"
    wall, ev = [], []
    for _ in range(n):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        t0 = time.perf_counter()
        if cuda:
            e0.record()
        step()
        if cuda:
            e1.record()
        sync(device)
        wall.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            ev.append(e0.elapsed_time(e1))
    return dict(stats_ms(wall, ""), **(stats_ms(ev, "event_") if ev else {}))


def count_kernels(step, device):
    """Device activities of one step seen by torch.profiler: kernels, memcpy, memset."""
    from torch.profiler import ProfilerActivity, profile
    warnings.filterwarnings("ignore", message=".*Profiler clears events")
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    names = collections.Counter()
    memcpy = memset = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        low = e.name.lower()
        if "memcpy" in low:
            memcpy += 1
        elif "memset" in low:
            memset += 1
        else:
            names[e.name[:100]] += 1
    attn = [n for n in names if any(w in n.lower() for w in ("fmha", "flash", "attention"))]
    return {"kernels": sum(names.values()), "memcpy": memcpy, "memset": memset,
            "kernel_names": dict(names.most_common(20)),
            "attention_kernels": attn or "none (SDPA's math path: matmul + softmax)"}


def step_memory(step, device):
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"mem_before_step_mib": before / 2**20, "step_peak_above_mib": (peak - before) / 2**20,
            "mem_reserved_mib": torch.cuda.memory_reserved(device) / 2**20}


def kernel_report(mode, c, data, args, device, res, seen):
    """Kernel counts of a graph mode: what the profiler saw in the replay if it saw any
    kernels (CUPTI reports graph nodes), else a stand-in without graphs, which is always
    counted too (kernels_standin)."""
    if mode == "cuda_graph":
        other = eager_runner(c, data, args, device, capturable=True)
        src = "an eager step with AdamW(capturable=True)"
    else:
        reset_compiler()
        other = compiled_runner(c, data, args, device, res["variant"], mode=None)
        src = "the same step compiled in default mode (no cudagraphs)"
    for _ in range(3):
        other.step()
    standin = count_kernels(other.step, device)
    out = {"kernels_in_mode": seen["kernels"], "kernels_standin": standin["kernels"],
           "kernels_standin_source": src}
    if seen["kernels"] > 0:
        return dict(seen, kernels_source="profiled in the graph replay", **out)
    return dict(standin, kernels_source=f"stand-in: {src} (the replay showed none)", **out)


def run_one(name, c, mode, batch, args, device, ref):
    """Measures one (model, mode, batch); returns a result dict (never raises)."""
    res = {"model": name, "mode": mode, "batch": batch, "ok": False, "error": None,
           "notes": []}
    t_start = time.perf_counter()
    runner = None
    cuda = device.type == "cuda"
    try:
        data = make_data(c, batch, args, device)
        if mode == "eager":
            runner = eager_runner(c, data, args, device)
        elif mode == "cuda_graph":
            runner = cuda_graph_runner(c, data, args, device)
        else:
            if not cuda:
                res["notes"].append("cpu: no cudagraphs; a smoke test of the compiled code")
            compile_mode = "max-autotune" if mode == "max_autotune" else "reduce-overhead"
            runner = reduce_overhead_runner(c, data, args, device, res, compile_mode)
        res.update(runner.info)
        res["setup_s"] = time.perf_counter() - t_start

        runner.reset()  # graph modes: undo the warm-up/capture steps' updates
        res["losses"] = run_losses(runner, args.check_steps)
        if mode != "eager" and ref:
            res["loss_max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12)
                                           for a, b in zip(res["losses"], ref))
        for _ in range(args.warmup):
            runner.step()
        sync(device)
        if cuda:
            res.update(step_memory(runner.step, device))
        res.update(time_steps(runner.step, args.steps, device))
        if cuda and args.profile_steps and (args.profile_mode in (None, mode)):
            # Only these steps' kernels are seen by `ncu --profile-from-start off`.
            torch.cuda.profiler.start()
            for _ in range(args.profile_steps):
                runner.step()
            sync(device)
            torch.cuda.profiler.stop()
        if mode in ("reduce_overhead", "max_autotune"):
            res.update(dynamo_stats())
            if cuda and res.get("cudagraph_skips"):
                res["notes"].append("cudagraphs were skipped for some graph: not a replay")
        if cuda and not args.profile_steps:  # torch.profiler and ncu would both attach
            seen = count_kernels(runner.step, device)
            if mode == "eager":
                res.update(seen, kernels_source="profiled")
            else:
                del runner
                runner = None
                res.update(kernel_report(mode, c, data, args, device, res, seen))
        res["ok"] = True
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:4000]
        if args.verbose:
            traceback.print_exc()
    finally:
        res["total_wall_s"] = time.perf_counter() - t_start
        del runner
        if mode in ("reduce_overhead", "max_autotune"):
            reset_compiler()
        try:
            sync(device)
            if cuda:
                torch.cuda.empty_cache()
        except Exception as e:  # a sticky CUDA error: later runs will fail too
            res["ok"] = False
            res["error"] = (res["error"] or "") + f" | after: {type(e).__name__}: {e}"
    return res


def reference_losses(c, batch, args, device):
    runner = eager_runner(c, make_data(c, batch, args, device), args, device)
    return run_losses(runner, args.check_steps)


def result_line(r):
    head = f"{r['model']:5s} {r['mode']:15s} B={r['batch']:<3d}"
    if r.get("skipped"):
        return f"{head} skipped: {r['skipped']}"
    if not r["ok"]:
        return f"{head} FAILED ({r['total_wall_s']:.1f} s): {r['error'].splitlines()[0][:200]}"
    s = f"{head} median {r['median_ms']:.3f} ms (p10 {r['p10_ms']:.3f}, p90 {r['p90_ms']:.3f})"
    if "event_median_ms" in r:
        s += f", events {r['event_median_ms']:.3f} ms"
    if "kernels" in r:
        s += f", kernels {r['kernels']} (+{r['memcpy']} memcpy, {r['memset']} memset)"
        if r["mode"] != "eager":
            s += f" [stand-in {r['kernels_standin']}]"
        elif isinstance(r["attention_kernels"], str):
            s += ", attention: math path"
    if "step_peak_above_mib" in r:
        s += f", peak +{r['step_peak_above_mib']:.1f} MiB"
    s += f", loss[0] {r['losses'][0]:.4f}"
    if "loss_max_rel_diff" in r:
        s += f", loss rel diff {r['loss_max_rel_diff']:.1e}"
    if r.get("variant"):
        s += f", variant {r['variant']} ({r.get('dynamo_graphs', '?')} graphs)"
    if r.get("cudagraph_skips"):
        s += f", CUDAGRAPH SKIPS {r['cudagraph_skips']}"
    s += f" [{r['total_wall_s']:.1f} s]"
    return "".join([s] + [f"\n    note: {n}" for n in r["notes"]])


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--modes", default=",".join(ALL_MODES),
                   help=f"comma-separated subset of {','.join(ALL_MODES)} (default: all)")
    p.add_argument("--models", default="bench",
                   help="comma-separated subset of bench,large,gpt2-124m (default: bench)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated (default 1,8,32)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (128)")
    p.add_argument("--steps", type=int, default=50, help="timed steps (50)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps before timing (10)")
    p.add_argument("--check-steps", type=int, default=5,
                   help="steps whose losses are compared with eager (5)")
    p.add_argument("--gqa", choices=("sdpa", "repeat"), default="sdpa",
                   help="sdpa: enable_gqa=True (default); repeat: repeat_interleave kv heads")
    p.add_argument("--ro-variant", choices=("auto", "whole", "split"), default="auto",
                   help="reduce_overhead variant; auto: whole, else split (default auto)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="smoke test: batches 1,2, 3 steps, "
                   "2 warm-up, 3 checked; on cpu the tiny model (2 layers, d 128), seq 32")
    p.add_argument("--amp", choices=("bf16",),
                   help="mixed precision: the forward pass and loss under torch.autocast in bf16")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after timing, run this many steps between cudaProfilerStart and Stop "
                        "(for ncu --profile-from-start off; scripts/ncu_step.py sums them); "
                        "kernels are not counted then")
    p.add_argument("--profile-mode", choices=ALL_MODES,
                   help="profile this mode's steps only (default: every mode's)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ALL_MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(ALL_MODES)}")
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.quick:
        args.batches, args.steps, args.warmup, args.check_steps = [1, 2], 3, 2, 3
    if args.steps < 1 or args.warmup < 0 or args.check_steps < 1:
        p.error("--steps and --check-steps must be >= 1, --warmup >= 0")
    if args.gqa == "sdpa" and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5):
        args.gqa = "repeat"  # enable_gqa arrived in torch 2.5
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("CUDA is not available; use --device cpu (with --quick) for a smoke test")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)

    # Plain fp32: no TF32 anywhere.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    global AMP
    AMP = torch.bfloat16 if args.amp == "bf16" else None
    precision = {"autocast": args.amp or "off",
                 "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                 "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                 "float32_matmul_precision": torch.get_float32_matmul_precision()}

    tiny = args.quick and device.type == "cpu"
    if tiny:
        args.seq = 32
    names = ["tiny"] if tiny else args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"error: unknown model(s) {','.join(unknown)}: pick from bench,large,gpt2-124m")
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or platform.machine())
    meta = {
        "script": "scripts/torch_train.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "device": str(device), "device_name": device_name, "precision": precision,
        "models": {n: dict(MODELS[n], head_dim=HEAD_DIM, seq=args.seq) for n in names},
        "optimizer": dict(OPT, name="AdamW"),
        "timing": ("median/p10/p90_ms: synchronize + perf_counter around each step; "
                   "event_*_ms: cuda.Event pair around each step inside the same bracket"),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
    }
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {device_name}; "
          f"precision {precision}; models {','.join(names)}; modes {','.join(args.modes)}; "
          f"batches {args.batches}; seq {args.seq}; {args.steps} steps, {args.warmup} "
          f"warm-up; gqa {args.gqa}", flush=True)

    results = []
    t_all = time.perf_counter()
    for name in names:
        c = MODELS[name]
        for batch in args.batches:
            ref = None
            if any(m != "eager" for m in args.modes):
                try:
                    ref = reference_losses(c, batch, args, device)
                except Exception as e:
                    print(f"eager reference failed for {name} B={batch}: {e}", flush=True)
            for mode in args.modes:
                if mode == "cuda_graph" and device.type != "cuda":
                    res = {"model": name, "mode": mode, "batch": batch, "ok": False,
                           "skipped": "needs a CUDA device"}
                else:
                    res = run_one(name, c, mode, batch, args, device, ref)
                results.append(res)
                print(result_line(res), flush=True)

    total = time.perf_counter() - t_all
    print(f"{len(results)} results in {total:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, results=results, total_wall_s=total), f, indent=2)
        print(f"wrote {args.json}")
    return 0 if all(r["ok"] or r.get("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
