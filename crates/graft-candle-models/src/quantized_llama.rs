//! The port of candle-transformers' `models::quantized_llama` (GGUF, e.g. Q4_K and Q8_0): the
//! same GGUF files, read by the same metadata keys and tensor names, a graph-ready
//! [`Decoder`] whose projections stay quantized (candle's `QMatMul`).

use std::io::{Read, Seek};

use candle_core::quantized::{QMatMul, QTensor, gguf_file};
use candle_core::{DType, Device, Result};
use candle_nn::Activation;

use super::decoder::{Block, Decoder};
use super::moe::Mlp;
use super::proj::Proj;
use super::spec::{Arch, DecoderSpec, RopeSpec, RopeStyle};

/// The positions candle's model computes rotary tables for (its `MAX_SEQ_LEN`).
pub use candle_transformers::models::quantized_llama::MAX_SEQ_LEN;

/// Architectures whose GGUF files pair rotary columns i and i + d/2 (llama.cpp's NEOX
/// convention), as candle's model lists them; every other one pairs 2i and 2i + 1.
const NEOX: [&str; 20] = [
    "qwen",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
    "falcon",
    "grok",
    "dbrx",
    "phi2",
    "phi3",
    "phimoe",
    "stablelm",
    "starcoder2",
    "bert",
    "nomic-bert",
    "jina-bert-v2",
    "olmo2",
    "olmoe",
    "codeshell",
    "plamo",
];

/// The decoder a GGUF file's metadata and tensor shapes describe.
pub fn spec(ct: &gguf_file::Content) -> Result<DecoderSpec> {
    let get = |key: &str| match ct.metadata.get(key) {
        Some(v) => Ok(v),
        None => candle_core::bail!("the gguf file has no {key} in its metadata"),
    };
    let u32_of = |key: &str| -> Result<usize> { Ok(get(key)?.to_u32()? as usize) };
    if ct
        .metadata
        .get("llama.expert_count")
        .and_then(|v| v.to_u32().ok())
        .unwrap_or(0)
        > 1
    {
        candle_core::bail!(
            "a mixture-of-experts gguf (llama.expert_count > 1) is not ported: the device-routed expert kernels read f32, bf16 or f16 weights, not block-quantized ones; load the safetensors checkpoint with graft_candle_models::mixtral instead"
        );
    }
    let shape = |name: &str| match ct.tensor_infos.get(name) {
        Some(info) => Ok(info.shape.dims().to_vec()),
        None => candle_core::bail!("the gguf file has no tensor {name}"),
    };
    let heads = u32_of("llama.attention.head_count")?;
    let hidden = u32_of("llama.embedding_length")?;
    let head_dim = hidden / heads.max(1);
    let rope_dim = u32_of("llama.rope.dimension_count")?;
    if rope_dim != head_dim {
        candle_core::bail!(
            "the gguf file rotates {rope_dim} of {head_dim} head columns; partial rotary embeddings are not ported"
        );
    }
    let arch = ct
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    let style = if NEOX.contains(&arch.as_str()) {
        RopeStyle::Half
    } else {
        RopeStyle::Interleaved
    };
    Ok(DecoderSpec {
        arch: Arch::QuantizedLlama,
        hidden,
        intermediate: shape("blk.0.ffn_up.weight")?[0],
        vocab: shape("token_embd.weight")?[0],
        layers: u32_of("llama.block_count")?,
        heads,
        kv_heads: u32_of("llama.attention.head_count_kv")?,
        head_dim,
        eps: f64::from(get("llama.attention.layer_norm_rms_epsilon")?.to_f32()?),
        act: Activation::Silu,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        tied_embeddings: !ct.tensor_infos.contains_key("output.weight"),
        rope: RopeSpec {
            theta: f64::from(
                ct.metadata
                    .get("llama.rope.freq_base")
                    .and_then(|v| v.to_f32().ok())
                    .unwrap_or(10_000.0),
            ),
            f64_powers: false,
            llama3: None,
            style,
            max_positions: MAX_SEQ_LEN,
        },
        sliding_window: None,
        moe: None,
    })
}

/// Loads a GGUF Llama the way candle-transformers' `ModelWeights::from_gguf` does: the
/// embedding and norms dequantized to f32, every projection quantized. Activations and the
/// cache are f32.
pub fn load<R: Seek + Read>(
    ct: &gguf_file::Content,
    reader: &mut R,
    device: &Device,
) -> Result<Decoder> {
    let spec = spec(ct)?;
    spec.validate()?;
    let mut tensor = |name: &str| ct.tensor(reader, name, device);
    let quant = |t: QTensor| Ok::<_, candle_core::Error>(Proj::Quant(QMatMul::from_qtensor(t)?));
    let embed_q = tensor("token_embd.weight")?;
    let embed = embed_q.dequantize(device)?.to_dtype(DType::F32)?;
    let norm = tensor("output_norm.weight")?.dequantize(device)?;
    let lm_head = if spec.tied_embeddings {
        quant(embed_q)?
    } else {
        quant(tensor("output.weight")?)?
    };
    let mut blocks = Vec::with_capacity(spec.layers);
    for i in 0..spec.layers {
        let mut t = |name: &str| tensor(&format!("blk.{i}.{name}.weight"));
        blocks.push(Block {
            attn_norm: t("attn_norm")?.dequantize(device)?,
            q: quant(t("attn_q")?)?,
            k: quant(t("attn_k")?)?,
            v: quant(t("attn_v")?)?,
            o: quant(t("attn_output")?)?,
            qk_norm: None,
            mlp_norm: t("ffn_norm")?.dequantize(device)?,
            mlp: Mlp::Gated {
                gate: quant(t("ffn_gate")?)?,
                up: quant(t("ffn_up")?)?,
                down: quant(t("ffn_down")?)?,
            },
        });
    }
    Decoder::from_parts(spec, embed, blocks, norm, lm_head, device)
}

/// The GGUF name of each tensor of [`DecoderSpec::checkpoint_tensors`] (a Llama without
/// biases or per-head norms), for writing GGUF files.
pub fn gguf_name(hf: &str) -> Option<String> {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return Some((*g).to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, name) = rest.split_once('.')?;
    let g = match name {
        "input_layernorm.weight" => "attn_norm",
        "post_attention_layernorm.weight" => "ffn_norm",
        "self_attn.q_proj.weight" => "attn_q",
        "self_attn.k_proj.weight" => "attn_k",
        "self_attn.v_proj.weight" => "attn_v",
        "self_attn.o_proj.weight" => "attn_output",
        "mlp.gate_proj.weight" => "ffn_gate",
        "mlp.up_proj.weight" => "ffn_up",
        "mlp.down_proj.weight" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.weight"))
}
