//! The candle example of docs/guide.md: the Llama port's decode step under graft, batches
//! padded to buckets, tokens fed back step to step, outputs held and checked. Run by
//! graft-candle-models' tests: on the CPU in CI (tests/guide.rs), on the GPU in the CUDA build
//! (tests/gpu.rs).
use graft_candle::candle_core::{DType, Tensor};
use graft_candle::{Buckets, CandleGraft, StepOutcome};
use graft_candle_models::llama::{self, Sizes};

pub(crate) fn main() -> Result<(), Box<dyn std::error::Error>> {
    // GPU 0 on its own stream with candle's event tracking off (the CPU in a build without
    // graft-candle's `cuda` feature, where steps run eagerly).
    let device = graft_candle::device(0)?;
    // A small Llama with random weights (a checkpoint loads with `llama::load`).
    let model = llama::random(&Sizes::TINY, 42, DType::F32, &device)?;
    let mut graft = CandleGraft::new(&device)?;
    // Recorded at batch 1, 8 and 32: one graph per bucket, not per batch size.
    let buckets = Buckets::new([1, 8, 32])?;
    let decode = graft.register_bucketed("decode", buckets.clone());

    // Three requests padded to their bucket (8), which is the first key of every call. The
    // KV cache (keys, values and positions, on the device) belongs to the bucket.
    let (bucket, padded) = graft_candle::pad(&buckets, &[11u32, 22, 33], 0);
    let cache = model.new_cache(bucket, 64)?;
    // What the step uses in place (weights, cache): its addresses are part of the signature.
    let statics = model.statics(&cache);

    let first = Tensor::new(padded.as_slice(), &device)?;
    let mut tokens = first.clone();
    let mut history = Vec::new();
    for step in 0..16 {
        let out = graft.call(decode, &[&tokens], &statics, &[bucket as u64], |inputs| {
            // Ordinary candle code; `inputs[0]` is `tokens` itself, used in place.
            Ok(vec![model.greedy(&cache, &inputs[0])?])
        })?;
        if graft.is_graphed() {
            match (step, &out.outcome) {
                (0, StepOutcome::Warmup) | (1, StepOutcome::Recorded(_)) => {}
                (2.., StepOutcome::Replayed(_)) => {}
                (_, other) => return Err(format!("step {step}: unexpected {other:?}").into()),
            }
        }
        // The output is the caller's own tensor: feed it back and keep it, no clone needed.
        tokens = out
            .outputs
            .into_iter()
            .next()
            .ok_or("the step returned nothing")?;
        history.push(tokens.clone());
    }

    // Every held output still holds its own step's tokens: check against the plain model.
    let plain_cache = model.new_cache(bucket, 64)?;
    let mut plain = first;
    for (step, held) in history.iter().enumerate() {
        plain = model.greedy(&plain_cache, &plain)?;
        if held.to_vec1::<u32>()? != plain.to_vec1::<u32>()? {
            return Err(format!("step {step}: the held output differs from candle's").into());
        }
    }
    println!(
        "16 steps at bucket {bucket}, graphed: {}",
        graft.is_graphed()
    );
    Ok(())
}
