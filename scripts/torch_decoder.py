#!/usr/bin/env python3
"""PyTorch reference for graft's decoder-step benchmark (the decoder step of docs/benchmarks.md).

The model is the benchmark decoder: decoder-only transformer, 4 layers, d_model 512,
8 heads (head dim 64), FFN 2048 with GELU (tanh approximation), vocab 8192, context
512, fp32, pre-LayerNorm (before attention, before the FFN, plus a final LN), learned
token and position embeddings, residual connections, untied output projection d->vocab
with bias, random weights from a fixed seed.

One decode step: tokens [B] (int64) -> next tokens [B] (greedy argmax of the logits).
The position is a 0-dim int64 tensor on the device (a module buffer). The step writes
the new K and V at `pos` into a preallocated KV cache (static buffers, one [B, heads,
ctx, head_dim] pair per layer) with index_copy_, attends over all ctx slots with a mask
(slot > pos -> -inf), softmax in fp32, scale 1/sqrt(head_dim), and increments `pos` in
place on the device. Nothing in the step synchronizes with the host.

Modes (each at every batch size):
  eager            plain module calls
  cuda_graph       hand-written torch.cuda.CUDAGraph of one step; each step copies the
                   static output tokens into the static input tokens and replays
  cudagraph_trees  torch.compile(backend="cudagraphs") (CUDAGraph Trees, no Inductor),
                   torch.compiler.cudagraph_mark_step_begin() before each step
  reduce_overhead  torch.compile(mode="reduce-overhead") (Inductor + CUDAGraph Trees),
                   mark_step_begin before each step

Timing per (mode, batch): warm-up steps (the compiled modes compile and record there),
then two timed passes of --steps autoregressive steps each (the output tokens feed the
next step):
  * events pass: a torch.cuda.Event pair around each step; median, p10 and p90 of the
    per-step times (the reported figure is the median);
  * wall pass: synchronize, perf_counter around the whole block, synchronize; mean per
    step.
The position is reset to 0 (outside the timed region) whenever the next block would run
past the context. Before timing, each non-eager mode runs --check-steps steps from the
same initial state as an eager reference and compares the tokens.

Examples:
  python3 scripts/torch_decoder.py --json torch_decoder.json
  python3 scripts/torch_decoder.py --modes eager,cuda_graph --batches 1,8 --steps 500
  python3 scripts/torch_decoder.py --device cpu --quick      # smoke test without a GPU
"""

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

ALL_MODES = ("eager", "cuda_graph", "cudagraph_trees", "reduce_overhead")
GRAPH_MODES = ("cuda_graph", "cudagraph_trees", "reduce_overhead")
COMPILED_MODES = ("cudagraph_trees", "reduce_overhead")


# --------------------------------------------------------------------------- model


class Config:
    def __init__(self, layers=4, d_model=512, heads=8, ffn=2048, vocab=8192, ctx=512,
                 ln_eps=1e-5):
        assert d_model % heads == 0
        self.layers = layers
        self.d_model = d_model
        self.heads = heads
        self.head_dim = d_model // heads
        self.ffn = ffn
        self.vocab = vocab
        self.ctx = ctx
        self.ln_eps = ln_eps

    def as_dict(self):
        return dict(layers=self.layers, d_model=self.d_model, heads=self.heads,
                    head_dim=self.head_dim, ffn=self.ffn, vocab=self.vocab, ctx=self.ctx,
                    ln_eps=self.ln_eps, dtype="float32", gelu="tanh",
                    norm="pre-LayerNorm + final LayerNorm",
                    attention_projections="separate q, k, v, o (d x d, with bias)",
                    output_projection="untied d x vocab with bias")


class Layer(nn.Module):
    def __init__(self, cfg, batch):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.head_dim = cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.ln1 = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.wq = nn.Linear(d, d)
        self.wk = nn.Linear(d, d)
        self.wv = nn.Linear(d, d)
        self.wo = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.fc1 = nn.Linear(d, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, d)
        # Static KV cache: [B, heads, ctx, head_dim] each.
        shape = (batch, cfg.heads, cfg.ctx, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, pos_idx, mask):
        # x: [B, d]; pos_idx: [1] int64 (a view of the 0-dim pos); mask: [ctx] bool,
        # True where slot > pos.
        b = x.shape[0]
        h = self.ln1(x)
        q = self.wq(h).view(b, self.heads, 1, self.head_dim)
        k = self.wk(h).view(b, self.heads, 1, self.head_dim)
        v = self.wv(h).view(b, self.heads, 1, self.head_dim)
        self.k_cache.index_copy_(2, pos_idx, k)
        self.v_cache.index_copy_(2, pos_idx, v)
        scores = torch.matmul(q, self.k_cache.transpose(-2, -1)) * self.scale  # [B,H,1,ctx]
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # fp32 throughout
        attn = torch.matmul(probs, self.v_cache).reshape(b, self.heads * self.head_dim)
        x = x + self.wo(attn)
        h = self.ln2(x)
        x = x + self.fc2(F.gelu(self.fc1(h), approximate="tanh"))
        return x


class Decoder(nn.Module):
    """The decoder with its decode state (KV caches, pos) for one batch size."""

    def __init__(self, cfg, batch):
        super().__init__()
        self.cfg = cfg
        self.batch = batch
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.ctx, cfg.d_model)
        self.layers = nn.ModuleList([Layer(cfg, batch) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("slots", torch.arange(cfg.ctx, dtype=torch.long),
                             persistent=False)

    @torch.no_grad()
    def init_weights(self, seed):
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        # Weights ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), biases small, embeddings ~ N(0, 1),
        # LayerNorm gamma ~ 1 +- 0.1 and beta small: keeps activations O(1) and the logits
        # well spread, so the argmax is not decided by rounding.
        for name, p in self.named_parameters():
            if name.endswith("tok_emb.weight") or name.endswith("pos_emb.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif ".ln" in name or name.startswith("ln"):
                if name.endswith("weight"):
                    p.copy_(1.0 + 0.1 * (2 * torch.rand(p.shape, generator=g) - 1))
                else:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif name.endswith("weight"):
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_(bound * (2 * torch.rand(p.shape, generator=g) - 1))
            else:  # linear bias
                p.copy_(0.02 * torch.randn(p.shape, generator=g))

    @torch.no_grad()
    def reset_state(self):
        self.pos.zero_()
        for layer in self.layers:
            layer.k_cache.zero_()
            layer.v_cache.zero_()

    def forward(self, tokens):
        """One decode step: tokens [B] int64 -> next tokens [B] int64; pos += 1."""
        pos_idx = self.pos.view(1)
        x = self.tok_emb(tokens) + F.embedding(pos_idx, self.pos_emb.weight)  # [B, d]
        mask = self.slots > self.pos  # [ctx] bool
        for layer in self.layers:
            x = layer(x, pos_idx, mask)
        logits = self.head(self.ln_f(x))  # [B, vocab]
        nxt = torch.argmax(logits, dim=-1)
        self.pos.add_(1)
        return nxt


def build_model(cfg, batch, seed, device):
    model = Decoder(cfg, batch)
    model.init_weights(seed)
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def initial_tokens(cfg, batch, seed, device):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed + 1)
    return torch.randint(0, cfg.vocab, (batch,), generator=g, dtype=torch.long).to(device)


# --------------------------------------------------------------------------- runners


class Runner:
    """A step function `tok -> tok` plus the state it owns."""

    def __init__(self, model, step, reset, cloned_outputs=None, notes=None):
        self.model = model
        self.step = step  # tok -> tok (may return a static buffer)
        self.reset = reset  # puts pos/caches back to the initial state
        self.cloned_outputs = cloned_outputs
        self.notes = notes or []


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_eager(model, device, args):
    return Runner(model, model, model.reset_state)


def make_cuda_graph(model, device, args):
    if device.type != "cuda":
        raise RuntimeError("cuda_graph needs a CUDA device")
    static_tok = initial_tokens(model.cfg, model.batch, args.seed, device).clone()
    # Warm up on a side stream (as the torch.cuda.graphs docs show).
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static_tok)
    torch.cuda.current_stream(device).wait_stream(s)
    sync(device)
    model.reset_state()
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_tok)
    sync(device)
    model.reset_state()  # capture does not execute, but keep the state clean anyway

    def step(tok):
        if tok.data_ptr() != static_tok.data_ptr():
            static_tok.copy_(tok)  # feeds the static output back (or new tokens in)
        graph.replay()
        return static_out

    r = Runner(model, step, model.reset_state)
    r.graph = graph  # keep alive
    return r


def make_compiled(mode, model, device, args, clone):
    if device.type != "cuda":
        raise RuntimeError(f"{mode} needs a CUDA device")
    # Static addresses for the mutated state (they are module buffers too).
    for layer in model.layers:
        torch._dynamo.mark_static_address(layer.k_cache)
        torch._dynamo.mark_static_address(layer.v_cache)
    torch._dynamo.mark_static_address(model.pos)
    torch._dynamo.mark_static_address(model.slots)
    if mode == "cudagraph_trees":
        compiled = torch.compile(model, backend="cudagraphs", fullgraph=True, dynamic=False)
    else:
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True,
                                 dynamic=False)
    mark = torch.compiler.cudagraph_mark_step_begin

    if clone:
        def step(tok):
            mark()
            return compiled(tok).clone()
    else:
        def step(tok):
            mark()
            return compiled(tok)

    return Runner(model, step, model.reset_state, cloned_outputs=clone)


# --------------------------------------------------------------------------- measuring


def run_steps(runner, tok, n, keep=False):
    """Autoregressive loop of n steps; returns (last tok, [host copies if keep])."""
    outs = []
    for _ in range(n):
        tok = runner.step(tok)
        if keep:
            outs.append(tok.clone())  # outside any graph; only in the check phase
    return tok, outs


def reference_tokens(cfg, batch, args, device):
    model = build_model(cfg, batch, args.seed, device)
    tok = initial_tokens(cfg, batch, args.seed, device)
    with torch.no_grad():
        _, outs = run_steps(Runner(model, model, model.reset_state), tok,
                            args.check_steps, keep=True)
    ref = torch.stack(outs).cpu()
    del model
    return ref


def check_tokens(runner, cfg, batch, args, device, ref):
    runner.reset()
    sync(device)
    tok = initial_tokens(cfg, batch, args.seed, device)
    _, outs = run_steps(runner, tok, args.check_steps, keep=True)
    got = torch.stack(outs).cpu()
    sync(device)
    runner.reset()
    eq = got == ref
    per_step = eq.all(dim=1)
    match_steps = int(per_step.int().cumprod(0).sum().item())
    return {
        "tokens_match_eager": bool(eq.all().item()),
        "match_steps": match_steps,
        "check_steps": args.check_steps,
        "mismatched_tokens": int((~eq).sum().item()),
    }


def timed_blocks(runner, tok, total, ctx, fn):
    """Runs `total` steps in blocks that never run past the context; the position reset
    between blocks is outside the timing done by fn(runner, tok, n) -> tok."""
    done = 0
    while done < total:
        pos = int(runner.model.pos.item())  # host sync, outside the timed region
        room = ctx - pos
        if room <= 0:
            runner.reset()  # pos = 0, caches zeroed
            room = ctx
        n = min(room, total - done)
        tok = fn(runner, tok, n)
        done += n
    return tok


def measure(runner, cfg, batch, args, device):
    tok = initial_tokens(cfg, batch, args.seed, device)
    runner.reset()
    # Warm-up (compilation / recording for compiled modes happens in the first calls).
    tok, _ = run_steps(runner, tok, args.warmup)
    sync(device)

    per_step_us = []

    if device.type == "cuda":
        def events_block(r, t, n):
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            sync(device)
            for i in range(n):
                starts[i].record()
                t = r.step(t)
                ends[i].record()
            sync(device)
            per_step_us.extend(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))
            return t
    else:
        def events_block(r, t, n):
            for _ in range(n):
                t0 = time.perf_counter()
                t = r.step(t)
                per_step_us.append((time.perf_counter() - t0) * 1e6)
            return t

    wall = [0.0]

    def wall_block(r, t, n):
        sync(device)
        t0 = time.perf_counter()
        t, _ = run_steps(r, t, n)
        sync(device)
        wall[0] += time.perf_counter() - t0
        return t

    tok = timed_blocks(runner, tok, args.steps, cfg.ctx, events_block)
    tok = timed_blocks(runner, tok, args.steps, cfg.ctx, wall_block)
    sync(device)

    q = statistics.quantiles(per_step_us, n=10) if len(per_step_us) >= 2 else None
    return {
        "median_us": statistics.median(per_step_us),
        "p10_us": q[0] if q else per_step_us[0],
        "p90_us": q[-1] if q else per_step_us[0],
        "min_us": min(per_step_us),
        "wall_mean_us": wall[0] / args.steps * 1e6,
    }


def cudagraph_skips():
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # private API; absent in some versions
        return None


def reset_compiler():
    try:
        torch._dynamo.reset()
    except Exception:
        pass
    try:
        from torch._dynamo.utils import counters
        counters.clear()
    except Exception:
        pass


def run_one(mode, cfg, batch, args, device, ref):
    """Measures one (mode, batch); returns a result dict (never raises)."""
    res = {"mode": mode, "batch": batch, "ok": False, "error": None}
    t_start = time.perf_counter()
    model = None
    runner = None
    try:
        torch.manual_seed(args.seed)
        with torch.no_grad():
            model = build_model(cfg, batch, args.seed, device)
            if mode == "eager":
                runner = make_eager(model, device, args)
            elif mode == "cuda_graph":
                runner = make_cuda_graph(model, device, args)
            else:
                reset_compiler()
                attempts = {"auto": [False, True], "never": [False],
                            "always": [True]}[args.clone]
                last_err = None
                for clone in attempts:
                    runner = make_compiled(mode, model, device, args, clone)
                    t0 = time.perf_counter()
                    try:
                        # The first steps compile and record; they also serve as the
                        # token check against eager.
                        chk = check_tokens(runner, cfg, batch, args, device, ref)
                        # A few more steps, so that a failure that only shows once the
                        # trees replay (third call on) happens here, inside the retry.
                        run_steps(runner, initial_tokens(cfg, batch, args.seed, device), 4)
                        sync(device)
                        res["first_check_s"] = time.perf_counter() - t0
                        res.update(chk)
                        last_err = None
                        break
                    except Exception as e:  # e.g. "overwritten by a subsequent run"
                        last_err = e
                        res.setdefault("clone_fallback_reason", []).append(
                            f"{type(e).__name__}: {e}"[:2000])
                        reset_compiler()
                        del runner
                        runner = None
                        model = build_model(cfg, batch, args.seed, device)
                if last_err is not None:
                    raise last_err
                res["cloned_outputs"] = runner.cloned_outputs
            setup_s = time.perf_counter() - t_start
            res["setup_s"] = setup_s

            if mode == "eager":
                res["tokens_match_eager"] = True  # the reference itself
            elif mode == "cuda_graph":
                res.update(check_tokens(runner, cfg, batch, args, device, ref))

            res.update(measure(runner, cfg, batch, args, device))
            if mode in COMPILED_MODES:
                skips = cudagraph_skips()
                res["cudagraph_skips"] = skips
                if skips:
                    res["warning"] = ("cudagraphs were skipped for some graph: the timing "
                                      "is not a graph replay (see the log)")
            res["ok"] = True
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:4000]
        if args.verbose:
            traceback.print_exc()
    finally:
        res["total_wall_s"] = time.perf_counter() - t_start
        del runner, model
        if mode in COMPILED_MODES:
            reset_compiler()
        try:
            sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # a sticky CUDA error: later modes will fail too
            res["ok"] = False
            res["error"] = (res["error"] or "") + f" | after: {type(e).__name__}: {e}"

    return res


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--modes", default=",".join(ALL_MODES),
                   help=f"comma-separated subset of {','.join(ALL_MODES)} (default: all)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated (default 1,8,32)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per pass (200)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps (20)")
    p.add_argument("--check-steps", type=int, default=8,
                   help="steps compared with eager (8)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clone", choices=("auto", "never", "always"), default="auto",
                   help="clone compiled outputs before feeding them back: auto = only "
                        "if running without fails (default auto)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: batches 1,2, 5 steps, 2 warm-up, 3 checked, and a "
                        "2-layer model with ctx 64 on cpu")
    p.add_argument("--verbose", action="store_true", help="print tracebacks")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ALL_MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(ALL_MODES)}")
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.quick:
        args.batches = [1, 2]
        args.steps = 5
        args.warmup = 2
        args.check_steps = 3
    if args.steps < 1 or args.warmup < 0 or args.check_steps < 1:
        p.error("--steps and --check-steps must be >= 1, --warmup >= 0")
    return args


def print_table(results, modes, batches, key, title):
    cell = {(r["mode"], r["batch"]): r for r in results}
    w = 18
    print(f"\n{title}")
    print("mode".ljust(w) + "".join(f"B={b}".rjust(14) for b in batches) + "   match")
    for m in modes:
        row = m.ljust(w)
        matches = []
        for b in batches:
            r = cell.get((m, b))
            if r is None:
                row += "-".rjust(14)
            elif not r["ok"]:
                row += "FAILED".rjust(14)
            else:
                row += f"{r[key]:.1f}".rjust(14)
            if r is not None and "tokens_match_eager" in r:
                matches.append("y" if r["tokens_match_eager"] else "N")
            else:
                matches.append("?")
        print(row + "   " + "".join(matches))


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("CUDA is not available; use --device cpu (with --quick) for a smoke test")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)

    # No TF32 anywhere: the graft decoder is plain fp32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    cfg = Config() if not (args.quick and device.type == "cpu") else Config(layers=2, ctx=64)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine()

    meta = {
        "script": "scripts/torch_decoder.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "triton_version": _triton_version(),
        "python_version": platform.python_version(),
        "device": str(device),
        "device_name": device_name,
        "model": cfg.as_dict(),
        "tf32": False,
        "timing": ("median_us/p10_us/p90_us/min_us: cuda.Event pair around each step; "
                   "wall_mean_us: perf_counter around a synchronized block / steps"),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "notes": [
            "cudagraph_trees and reduce_overhead: feeding a step's output straight into "
            "the next step raises 'accessing tensor output of CUDAGraphs that has been "
            "overwritten by a subsequent run' (seen on torch 2.11); with --clone auto the "
            "script then retries with the output cloned (an extra eager copy per step), "
            "and each result says so in cloned_outputs / clone_fallback_reason.",
            "cudagraph_trees: with nn modules inlined by Dynamo, backend='cudagraphs' "
            "passes no static input indices to CUDAGraph Trees, so every replay copies "
            "each parameter and buffer into the graph's input slots (a profile on torch "
            "2.11 showed about 91 device-to-device copies per step) and the KV-cache "
            "writes are functionalized and copied back after the graph. That is "
            "PyTorch's own behaviour for this backend, not something the script adds.",
        ],
    }
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {device_name}; "
          f"modes {','.join(args.modes)}; batches {args.batches}; "
          f"{args.steps} steps, {args.warmup} warm-up", flush=True)

    results = []
    mode_wall = {m: 0.0 for m in args.modes}
    t_all = time.perf_counter()
    for batch in args.batches:
        ref = None
        if any(m != "eager" for m in args.modes):
            try:
                ref = reference_tokens(cfg, batch, args, device)
            except Exception as e:
                print(f"eager reference failed at B={batch}: {e}", flush=True)
        for mode in args.modes:
            if ref is None and mode != "eager":
                res = {"mode": mode, "batch": batch, "ok": False,
                       "error": "no eager reference tokens", "total_wall_s": 0.0}
            else:
                print(f"  {mode:16s} B={batch:<3d} ...", end="", flush=True)
                res = run_one(mode, cfg, batch, args, device, ref)
            mode_wall[mode] += res["total_wall_s"]
            results.append(res)
            if res["ok"]:
                extra = ""
                if "tokens_match_eager" in res and mode != "eager":
                    extra += f" match={res['tokens_match_eager']}"
                if res.get("cloned_outputs"):
                    extra += " (cloned outputs)"
                if res.get("cudagraph_skips"):
                    extra += f" CUDAGRAPH SKIPS={res['cudagraph_skips']}"
                print(f" median {res['median_us']:.1f} us, wall {res['wall_mean_us']:.1f} "
                      f"us/step, {res['total_wall_s']:.1f} s{extra}", flush=True)
            else:
                print(f" FAILED ({res['total_wall_s']:.1f} s): "
                      f"{res['error'].splitlines()[0][:200]}", flush=True)

    total = time.perf_counter() - t_all
    print_table(results, args.modes, args.batches, "median_us",
                "median per-step time, us (cuda.Event around each step)")
    print_table(results, args.modes, args.batches, "wall_mean_us",
                "mean per-step wall time, us (synchronized block / steps)")
    print("\ntotal wall per mode (s): " +
          ", ".join(f"{m} {s:.1f}" for m, s in mode_wall.items()) + f"; all {total:.1f}")
    for r in results:
        if r.get("cloned_outputs"):
            print(f"note: {r['mode']} B={r['batch']}: outputs cloned before feeding back"
                  + (f" ({r['clone_fallback_reason'][0][:160]})"
                     if r.get("clone_fallback_reason") else ""))
        if r.get("cudagraph_skips"):
            print(f"warning: {r['mode']} B={r['batch']}: cudagraphs skipped "
                  f"{r['cudagraph_skips']} time(s)")
        if not r["ok"]:
            print(f"error: {r['mode']} B={r['batch']}: {r['error'].splitlines()[0][:300]}")

    if args.json:
        out = dict(meta, results=results, mode_total_wall_s=mode_wall, total_wall_s=total)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in results) else 1


def _triton_version():
    try:
        import triton
        return triton.__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
