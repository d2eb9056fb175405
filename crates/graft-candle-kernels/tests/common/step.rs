//! `decode_step` on a device against its CPU composition (the unfused ops), over several
//! steps of a small seeded model: the logits and both caches; paged against static caches;
//! and a model split over two ranks against the whole.

use std::sync::{Arc, Barrier, Mutex};

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use graft_candle_kernels::{
    RopeStyle, StepLayer, StepModel, StepShard, decode_step, decode_step_paged,
};

use super::{assert_close, bits, random, tables};

/// One model shape: with query/key/value biases, with per-head norms (Qwen3), the rotary
/// style, a sliding window.
#[derive(Debug, Clone, Copy)]
pub struct StepCase {
    pub batch: usize,
    pub biases: bool,
    pub qk_norm: bool,
    pub style: RopeStyle,
    pub window: Option<usize>,
    pub seed: u64,
}

/// Every shape the decoders use, at one and two rows (every dtype) and at 8 and 16 (bf16 and
/// f16 only: see [`step_dtypes`]).
pub fn step_cases() -> Vec<StepCase> {
    let mut cases = Vec::new();
    for (i, (biases, qk_norm, style, window)) in [
        (false, false, RopeStyle::Half, None),
        (true, false, RopeStyle::Half, Some(5)),
        (false, true, RopeStyle::Interleaved, None),
    ]
    .into_iter()
    .enumerate()
    {
        for batch in [1, 2, 8, 16] {
            cases.push(StepCase {
                batch,
                biases,
                qk_norm,
                style,
                window,
                seed: 7 + i as u64,
            });
        }
    }
    cases
}

/// The dtypes `decode_step` takes `c`'s rows in (f32 up to `MATVEC_ROWS`).
pub fn step_dtypes(c: &StepCase) -> Vec<DType> {
    let all = [DType::F32, DType::BF16, DType::F16];
    all.into_iter()
        .filter(|&d| d != DType::F32 || c.batch <= graft_candle_kernels::MATVEC_ROWS)
        .collect()
}

const HIDDEN: usize = 256;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const FFN: usize = 512;
const VOCAB: usize = 300;
const LAYERS: usize = 2;
const MAX_SEQ: usize = 40;

/// A seeded model of `c`'s shape in `dtype` on `device`.
pub fn step_model(c: &StepCase, dtype: DType, device: &Device) -> Result<StepModel> {
    let mut seed = c.seed * 1000;
    let mut t = |shape: &[usize], scale: f32| {
        seed += 1;
        random(seed, shape, scale, dtype, device)
    };
    let mut layers = Vec::new();
    for _ in 0..LAYERS {
        let mut proj = |out: usize, inp: usize, bias: bool| -> Result<(Tensor, Option<Tensor>)> {
            let w = t(&[out, inp], 0.08)?;
            let b = if bias { Some(t(&[out], 0.1)?) } else { None };
            Ok((w, b))
        };
        let q = proj(HEADS * HEAD_DIM, HIDDEN, c.biases)?;
        let k = proj(KV_HEADS * HEAD_DIM, HIDDEN, c.biases)?;
        let v = proj(KV_HEADS * HEAD_DIM, HIDDEN, c.biases)?;
        let o = proj(HIDDEN, HEADS * HEAD_DIM, false)?;
        let gate = proj(FFN, HIDDEN, false)?.0;
        let up = proj(FFN, HIDDEN, false)?.0;
        let down = proj(HIDDEN, FFN, false)?.0;
        let ones = |n: usize| -> Result<Tensor> {
            Tensor::ones(n, dtype, device)? + random(c.seed + n as u64, &[n], 0.2, dtype, device)?
        };
        layers.push(StepLayer {
            attn_norm: ones(HIDDEN)?,
            q,
            k,
            v,
            qk_norm: if c.qk_norm {
                Some((ones(HEAD_DIM)?, ones(HEAD_DIM)?))
            } else {
                None
            },
            o,
            mlp_norm: ones(HIDDEN)?,
            gate,
            up,
            down,
        });
    }
    let half = HEAD_DIM / 2;
    let angles: Vec<f32> = (0..MAX_SEQ * half)
        .map(|i| (i / half) as f32 * 0.5f32.powi((i % half) as i32 / 4))
        .collect();
    let angles = Tensor::from_vec(angles, (MAX_SEQ, half), &Device::Cpu)?;
    Ok(StepModel {
        embed: t(&[VOCAB, HIDDEN], 1.0)?,
        layers,
        norm: (Tensor::ones(HIDDEN, dtype, device)? * 1.1)?,
        head: t(&[VOCAB, HIDDEN], 0.08)?,
        cos: angles.cos()?.to_dtype(dtype)?.to_device(device)?,
        sin: angles.sin()?.to_dtype(dtype)?.to_device(device)?,
        style: c.style,
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        eps: 1e-5,
        window: c.window,
        shard: None,
    })
}

/// The tokens (`[batch]`) and positions (each sequence at its own) of step `step` of `c`.
fn step_inputs(c: &StepCase, step: u32) -> (Vec<u32>, Vec<u32>) {
    let tokens = (0..c.batch as u32)
        .map(|b| (step * 37 + b * 101) % VOCAB as u32)
        .collect();
    let positions = (0..c.batch as u32).map(|b| step + 3 * b % 28).collect();
    (tokens, positions)
}

/// Zeroed caches of `batch` rows for every layer.
pub fn step_caches(batch: usize, dtype: DType, device: &Device) -> Result<Vec<(Tensor, Tensor)>> {
    let shape = (batch, KV_HEADS, MAX_SEQ, HEAD_DIM);
    (0..LAYERS)
        .map(|_| {
            Ok((
                Tensor::zeros(shape, dtype, device)?,
                Tensor::zeros(shape, dtype, device)?,
            ))
        })
        .collect()
}

/// 12 steps of `c` on `device` and on the CPU from the same tokens, each sequence at its own
/// position: the logits of every step and the caches after the last agree within `dtype`'s
/// tolerance (scaled for the whole step's rounding).
pub fn check_step(device: &Device, c: &StepCase, dtype: DType) -> Result<()> {
    let cpu = Device::Cpu;
    let (theirs, ours) = (step_model(c, dtype, &cpu)?, step_model(c, dtype, device)?);
    let (cpu_caches, caches) = (
        step_caches(c.batch, dtype, &cpu)?,
        step_caches(c.batch, dtype, device)?,
    );
    let (atol, rtol) = match dtype {
        DType::F32 => (2e-4, 2e-4),
        _ => (8e-2, 8e-2),
    };
    for step in 0..12u32 {
        let (tokens, positions) = step_inputs(c, step);
        let run = |m: &StepModel, caches: &[(Tensor, Tensor)], dev: &Device| -> Result<Tensor> {
            let tokens = Tensor::new(tokens.as_slice(), dev)?;
            let positions = Tensor::new(positions.as_slice(), dev)?;
            decode_step(m, caches, &tokens, &positions, None)
        };
        let want = run(&theirs, &cpu_caches, &cpu)?;
        let got = run(&ours, &caches, device)?;
        assert_close(
            &format!("{c:?} {dtype:?} step {step} logits"),
            &got,
            &want,
            (atol, rtol),
        )?;
    }
    for (i, ((k, v), (ck, cv))) in caches.iter().zip(&cpu_caches).enumerate() {
        assert_close(
            &format!("{c:?} {dtype:?} layer {i} keys"),
            k,
            ck,
            (atol, rtol),
        )?;
        assert_close(
            &format!("{c:?} {dtype:?} layer {i} values"),
            v,
            cv,
            (atol, rtol),
        )?;
    }
    Ok(())
}

/// 12 steps of `c` through `decode_step_paged`, its caches cut into shuffled blocks of 8
/// positions, give the logits `decode_step` gives over static caches on the same device, bit
/// for bit, and every key and value lands where the block table says.
pub fn check_step_paged(device: &Device, c: &StepCase, dtype: DType) -> Result<()> {
    let model = step_model(c, dtype, device)?;
    let caches = step_caches(c.batch, dtype, device)?;
    let block = 8;
    let per = MAX_SEQ.div_ceil(block);
    let blocks = c.batch * per + 3;
    let table = tables(c.seed, c.batch, per, blocks);
    let table_t = Tensor::from_vec(table.concat(), (c.batch, per), device)?;
    let pages = (0..LAYERS)
        .map(|_| {
            let shape = (blocks, KV_HEADS, block, HEAD_DIM);
            Ok((
                Tensor::zeros(shape, dtype, device)?,
                Tensor::zeros(shape, dtype, device)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut written = Vec::new();
    for step in 0..12u32 {
        let (tokens, positions) = step_inputs(c, step);
        written.extend(positions.iter().enumerate().map(|(b, &p)| (b, p as usize)));
        let tokens = Tensor::new(tokens.as_slice(), device)?;
        let positions = Tensor::new(positions.as_slice(), device)?;
        let want = decode_step(&model, &caches, &tokens, &positions, None)?;
        let got = decode_step_paged(&model, &pages, &tokens, &positions, &table_t)?;
        assert!(
            bits(&got)? == bits(&want)?,
            "{c:?} {dtype:?} step {step}: the paged logits differ"
        );
    }
    for ((k, v), (kp, vp)) in caches.iter().zip(&pages) {
        for &(b, p) in &written {
            let block_of = table[b][p / block] as usize;
            for (stat, paged) in [(k, kp), (v, vp)] {
                let want = stat.i((b, .., p))?;
                let got = paged.i((block_of, .., p % block))?;
                assert!(
                    bits(&got)? == bits(&want)?,
                    "{c:?} {dtype:?}: sequence {b}'s position {p} is not where its table says"
                );
            }
        }
    }
    Ok(())
}

/// Rank `rank` of `world`'s part of `whole`, Megatron style: its query, key and value heads
/// and its output projection's columns, its rows of gate and up and columns of down; the
/// rest shared. Sums over the ranks through `shard`.
fn step_part(whole: &StepModel, rank: usize, world: usize, shard: StepShard) -> Result<StepModel> {
    let part = |t: &Tensor, dim: usize| -> Result<Tensor> {
        let n = t.dim(dim)? / world;
        t.narrow(dim, rank * n, n)?.contiguous()
    };
    let rows = |(w, b): &(Tensor, Option<Tensor>)| -> Result<(Tensor, Option<Tensor>)> {
        Ok((part(w, 0)?, b.as_ref().map(|b| part(b, 0)).transpose()?))
    };
    // The embedding and the head: this rank's vocabulary rows where the shard splits them.
    let vocab = |t: &Tensor| match shard.vocab_first {
        Some(_) => part(t, 0),
        None => Ok(t.clone()),
    };
    let (embed, head) = (vocab(&whole.embed)?, vocab(&whole.head)?);
    let layers = whole
        .layers
        .iter()
        .map(|l| {
            Ok(StepLayer {
                q: rows(&l.q)?,
                k: rows(&l.k)?,
                v: rows(&l.v)?,
                o: (part(&l.o.0, 1)?, l.o.1.clone()),
                gate: part(&l.gate, 0)?,
                up: part(&l.up, 0)?,
                down: part(&l.down, 1)?,
                ..l.clone()
            })
        })
        .collect::<Result<_>>()?;
    Ok(StepModel {
        embed,
        head,
        layers,
        heads: whole.heads / world,
        kv_heads: whole.kv_heads / world,
        shard: Some(shard),
        ..whole.clone()
    })
}

/// An in-process sum over threads, one per rank: each puts its part in its slot, then every
/// rank adds all slots in rank order.
struct Slots {
    barrier: Barrier,
    parts: Mutex<Vec<Option<Tensor>>>,
}

impl Slots {
    fn sum(&self, rank: usize, part: Tensor) -> Result<Tensor> {
        self.parts.lock().unwrap()[rank] = Some(part);
        self.barrier.wait();
        let sum = {
            let parts = self.parts.lock().unwrap();
            let mut all = parts.iter().flatten();
            let first = all.next().unwrap().clone();
            all.try_fold(first, |sum, p| sum + p)
        };
        self.barrier.wait();
        sum
    }
}

/// A rank's logits of every step, and its caches after the last.
type RankRun = (Vec<Tensor>, Vec<(Tensor, Tensor)>);

/// 12 steps of `c` split over two ranks (a thread each, on `device`), against the whole
/// model on the same device: both ranks' logits (with `split_vocab`, the embedding and the
/// head split by vocabulary rows too: each rank's columns), and each rank's key and value
/// heads of the caches, within `dtype`'s tolerance (the sums are taken in another order).
/// Rank 0 adds the residual stream; rank 1's reduce returns a new tensor, which the step
/// copies back.
pub fn check_step_shards(
    device: &Device,
    c: &StepCase,
    dtype: DType,
    split_vocab: bool,
) -> Result<()> {
    const WORLD: usize = 2;
    let whole = step_model(c, dtype, device)?;
    let whole_caches = step_caches(c.batch, dtype, device)?;
    let (atol, rtol) = match dtype {
        DType::F32 => (2e-4, 2e-4),
        _ => (8e-2, 8e-2),
    };
    let inputs = |step| -> Result<(Tensor, Tensor)> {
        let (tokens, positions) = step_inputs(c, step);
        Ok((
            Tensor::new(tokens.as_slice(), device)?,
            Tensor::new(positions.as_slice(), device)?,
        ))
    };
    let mut want = Vec::new();
    for step in 0..12u32 {
        let (tokens, positions) = inputs(step)?;
        want.push(decode_step(
            &whole,
            &whole_caches,
            &tokens,
            &positions,
            None,
        )?);
    }
    let slots = Arc::new(Slots {
        barrier: Barrier::new(WORLD),
        parts: Mutex::new(vec![None; WORLD]),
    });
    let ranks = std::thread::scope(|s| {
        let handles: Vec<_> = (0..WORLD)
            .map(|rank| {
                let (slots, whole, inputs) = (slots.clone(), &whole, &inputs);
                s.spawn(move || -> Result<RankRun> {
                    let shard = StepShard {
                        adds_residual: rank == 0,
                        reduce: Arc::new(move |part| slots.sum(rank, part)),
                        vocab_first: split_vocab.then_some(rank * VOCAB / WORLD),
                    };
                    let model = step_part(whole, rank, WORLD, shard)?;
                    let mut caches = step_caches(c.batch, dtype, device)?;
                    for (k, v) in &mut caches {
                        *k = k.narrow(1, 0, KV_HEADS / WORLD)?.contiguous()?;
                        *v = v.narrow(1, 0, KV_HEADS / WORLD)?.contiguous()?;
                    }
                    let mut logits = Vec::new();
                    for step in 0..12u32 {
                        let (tokens, positions) = inputs(step)?;
                        logits.push(decode_step(&model, &caches, &tokens, &positions, None)?);
                    }
                    Ok((logits, caches))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Result<Vec<_>>>()
    })?;
    for (rank, (logits, caches)) in ranks.iter().enumerate() {
        for (step, (got, want)) in logits.iter().zip(&want).enumerate() {
            let what = format!(
                "{c:?} {dtype:?} rank {rank} step {step} logits (split vocabulary: {split_vocab})"
            );
            let want = match split_vocab {
                true => want.narrow(1, rank * VOCAB / WORLD, VOCAB / WORLD)?,
                false => want.clone(),
            };
            assert_close(&what, got, &want, (atol, rtol))?;
        }
        let heads = KV_HEADS / WORLD;
        for (i, ((k, v), (wk, wv))) in caches.iter().zip(&whole_caches).enumerate() {
            let what = format!("{c:?} {dtype:?} rank {rank} layer {i} keys");
            assert_close(&what, k, &wk.narrow(1, rank * heads, heads)?, (atol, rtol))?;
            let what = format!("{c:?} {dtype:?} rank {rank} layer {i} values");
            assert_close(&what, v, &wv.narrow(1, rank * heads, heads)?, (atol, rtol))?;
        }
    }
    Ok(())
}
