//! The serving example of docs/guide.md: a continuous batch over a Llama port, every prefill
//! and decode bucket recorded up front, requests joining as they come. Run by
//! graft-candle-models' tests: on the CPU in CI (tests/guide.rs), on the GPU in the CUDA
//! build (tests/gpu.rs).
use graft_candle::candle_core::DType;
use graft_candle::{Buckets, CandleGraft};
use graft_candle_models::serve::{Engine, Event, Request, SampleParams, ServeConfig};
use graft_candle_models::{checkpoint, llama};

pub(crate) fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = graft_candle::device(0)?;
    // Any Llama checkpoint loads the same way (here random weights, in memory).
    let cfg: candle_transformers::models::llama::LlamaConfig = serde_json::from_str(
        r#"{"hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5}"#,
    )?;
    let cfg = cfg.into_config(false);
    let weights = checkpoint::random_weights(&llama::spec(&cfg), 1, DType::F32, &device)?;
    let vb = candle_nn::VarBuilder::from_tensors(weights, DType::F32, &device);
    let model = llama::load(vb, &cfg)?;

    let config = ServeConfig {
        decode_buckets: Buckets::new([1, 2, 4, 8])?, // sequences decoding together
        prefill_buckets: Buckets::new([16, 32, 64])?, // tokens per prefill chunk
        eos: Vec::new(),
        max_running: None,
        speculate: None, // Some(Speculate::prompt_lookup(4)): a lone sequence speculates
    };
    // 8 sequences of 256 positions (on a GPU, `serve::plan` sizes the cache from memory).
    let cache = model.new_serving_cache(8, 256)?;
    let mut engine = Engine::graphed(&model, cache, CandleGraft::new(&device)?, config)?;
    engine.capture()?; // every bucket recorded before the first request
    for id in 0..3u64 {
        let prompt = (1..=20 * (id as u32 + 1)).collect(); // 20, 40 and 60 tokens
        engine.submit(Request {
            id,
            prompt,
            max_new: 8,
            sampling: SampleParams::GREEDY,
        })?;
    }
    let mut tokens = vec![Vec::new(); 3];
    while engine.pending() > 0 {
        for event in engine.step()? {
            if let Event::Token { id, token, .. } = event {
                tokens[id as usize].push(token);
            }
        }
    }
    assert!(tokens.iter().all(|t| t.len() == 8));
    println!("{tokens:?}");
    Ok(())
}
