//! What a graph-ready decoder is made of, independent of where its weights come from: the
//! sizes, the per-architecture choices (biases, per-head norms, rotary convention, sliding
//! window), and the checkpoint tensor names of the Hugging Face layout that candle's models
//! load.

use candle_nn::Activation;

/// The architecture a decoder was ported from (for diagnostics and names).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Arch {
    /// candle-transformers' `models::llama` (Llama 2 and 3).
    Llama,
    /// candle-transformers' `models::mistral`.
    Mistral,
    /// candle-transformers' `models::qwen2`.
    Qwen2,
    /// candle-transformers' `models::qwen3`.
    Qwen3,
    /// candle-transformers' `models::quantized_llama` (GGUF).
    QuantizedLlama,
    /// candle-transformers' `models::mixtral`.
    Mixtral,
    /// candle-transformers' `models::qwen3_moe`.
    Qwen3Moe,
    /// candle-transformers' `models::qwen2_moe`.
    Qwen2Moe,
}

/// Where a mixture-of-experts checkpoint keeps a block's router and experts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum MoeNames {
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2`
    /// (down): Mixtral.
    Mixtral,
    /// `mlp.gate`, `mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`: Qwen MoE models.
    Qwen,
}

/// A mixture of SiLU-gated experts in place of a block's MLP.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct MoeSpec {
    /// Experts per block (`num_local_experts`, `num_experts`).
    pub experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Width of each expert's MLP (`intermediate_size` for Mixtral, `moe_intermediate_size`
    /// for Qwen).
    pub intermediate: usize,
    /// The chosen experts' weights are divided by their sum (Mixtral; Qwen's
    /// `norm_topk_prob`).
    pub normalize: bool,
    /// Block i has experts when `(i + 1)` is a multiple of this (Qwen's
    /// `decoder_sparse_step`; 1 for every block), the gated MLP of `intermediate_size`
    /// otherwise.
    pub every: usize,
    /// The checkpoint's names.
    pub names: MoeNames,
    /// The width of a shared expert every token also goes through, scaled by the sigmoid of
    /// its own gate (Qwen2-MoE's `shared_expert_intermediate_size`): `mlp.shared_expert.*`
    /// and `mlp.shared_expert_gate`.
    pub shared: Option<usize>,
}

/// How rotary embeddings pair a head's columns.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RopeStyle {
    /// Column i with column i + head_dim / 2 (Hugging Face checkpoints; candle's `rope`).
    Half,
    /// Column 2i with column 2i + 1 (GGUF Llama checkpoints; candle's `rope_i`).
    Interleaved,
}

/// Llama 3's frequency scaling of rotary embeddings (`rope_scaling` with `rope_type:
/// "llama3"` in a checkpoint's config).
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Llama3Scaling {
    /// `factor`.
    pub factor: f32,
    /// `low_freq_factor`.
    pub low_freq_factor: f32,
    /// `high_freq_factor`.
    pub high_freq_factor: f32,
    /// `original_max_position_embeddings`.
    pub original_max_positions: usize,
}

/// Rotary embeddings: the base, how its inverse frequencies are computed (each port matches
/// the arithmetic of the candle model it ports, so the tables agree bit for bit), scaling,
/// the pairing, and the positions the tables cover.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct RopeSpec {
    /// The base (`rope_theta`, `rope.freq_base`).
    pub theta: f64,
    /// Compute `theta^(i/d)` in f64 (candle's Qwen models) rather than f32.
    pub f64_powers: bool,
    /// Llama 3's frequency scaling, if any.
    pub llama3: Option<Llama3Scaling>,
    /// The pairing of columns.
    pub style: RopeStyle,
    /// Positions the tables cover (`max_position_embeddings`): a cache may not be longer.
    pub max_positions: usize,
}

/// The shape and choices of a decoder.
#[derive(Clone, PartialEq, Debug)]
pub struct DecoderSpec {
    /// The architecture ported.
    pub arch: Arch,
    /// Width of the residual stream (`hidden_size`).
    pub hidden: usize,
    /// Width of the MLP (`intermediate_size`).
    pub intermediate: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Columns per head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// The MLP's activation (its gate).
    pub act: Activation,
    /// The query, key and value projections have biases (Qwen2; Qwen3's `attention_bias`).
    pub qkv_bias: bool,
    /// The attention's output projection has a bias (Qwen3's `attention_bias`).
    pub o_bias: bool,
    /// Queries and keys are RMS-normalized per head before the rotation (Qwen3).
    pub qk_norm: bool,
    /// The output projection is the embedding matrix.
    pub tied_embeddings: bool,
    /// Rotary embeddings.
    pub rope: RopeSpec,
    /// A position attends to at most this many earlier positions (and itself), if set.
    pub sliding_window: Option<usize>,
    /// Experts in place of the MLP (in every block, or every `every`-th).
    pub moe: Option<MoeSpec>,
}

impl DecoderSpec {
    /// Checks the sizes fit together; the error names the config field to fix.
    pub(crate) fn validate(&self) -> candle_core::Result<()> {
        let sizes = [
            ("hidden_size", self.hidden),
            ("intermediate_size", self.intermediate),
            ("vocab_size", self.vocab),
            ("num_hidden_layers", self.layers),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.rope.max_positions),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            candle_core::bail!("{:?} config: {name} must be at least 1", self.arch);
        }
        if !self.heads.is_multiple_of(self.kv_heads) || !self.head_dim.is_multiple_of(2) {
            candle_core::bail!(
                "{:?} config: num_attention_heads ({}) must be a multiple of num_key_value_heads ({}) and head_dim ({}) even",
                self.arch,
                self.heads,
                self.kv_heads,
                self.head_dim
            );
        }
        if let Some(m) = &self.moe
            && (m.experts == 0
                || m.experts > graft_candle_kernels::MAX_EXPERTS
                || m.top_k == 0
                || m.top_k > m.experts
                || m.intermediate == 0
                || m.shared == Some(0)
                || m.every == 0)
        {
            candle_core::bail!(
                "{:?} config: {} experts, {} per token, expert width {}, every {} blocks: pass 1 to {} experts, 1 to that many per token, and sizes of at least 1",
                self.arch,
                m.experts,
                m.top_k,
                m.intermediate,
                m.every,
                graft_candle_kernels::MAX_EXPERTS
            );
        }
        if u32::try_from(self.vocab).is_err() || u32::try_from(self.rope.max_positions).is_err() {
            candle_core::bail!(
                "{:?} config: vocab_size and max_position_embeddings must fit in a u32",
                self.arch
            );
        }
        Ok(())
    }

    /// The names and shapes of the tensors a checkpoint of this decoder holds, in the Hugging
    /// Face layout candle's `VarBuilder` models load (`model.layers.{i}.self_attn.q_proj.weight`
    /// and so on).
    pub fn checkpoint_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (d, f, hd) = (self.hidden, self.intermediate, self.head_dim);
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let mut all = vec![
            ("model.embed_tokens.weight".to_string(), vec![self.vocab, d]),
            ("model.norm.weight".to_string(), vec![d]),
        ];
        if !self.tied_embeddings {
            all.push(("lm_head.weight".to_string(), vec![self.vocab, d]));
        }
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            let mut push = |name: &str, shape: Vec<usize>| all.push((format!("{p}.{name}"), shape));
            push("input_layernorm.weight", vec![d]);
            push("post_attention_layernorm.weight", vec![d]);
            push("self_attn.q_proj.weight", vec![q, d]);
            push("self_attn.k_proj.weight", vec![kv, d]);
            push("self_attn.v_proj.weight", vec![kv, d]);
            push("self_attn.o_proj.weight", vec![d, q]);
            if self.qkv_bias {
                push("self_attn.q_proj.bias", vec![q]);
                push("self_attn.k_proj.bias", vec![kv]);
                push("self_attn.v_proj.bias", vec![kv]);
            }
            if self.o_bias {
                push("self_attn.o_proj.bias", vec![d]);
            }
            if self.qk_norm {
                push("self_attn.q_norm.weight", vec![hd]);
                push("self_attn.k_norm.weight", vec![hd]);
            }
            match self.moe.filter(|m| m.at(i)) {
                Some(m) => {
                    let block = m.names.block();
                    let [gate, up, down] = m.names.projections();
                    let fe = m.intermediate;
                    push(&format!("{block}.gate.weight"), vec![m.experts, d]);
                    for e in 0..m.experts {
                        push(&format!("{block}.experts.{e}.{gate}.weight"), vec![fe, d]);
                        push(&format!("{block}.experts.{e}.{up}.weight"), vec![fe, d]);
                        push(&format!("{block}.experts.{e}.{down}.weight"), vec![d, fe]);
                    }
                    if let Some(fs) = m.shared {
                        let p = format!("{block}.shared_expert");
                        push(&format!("{p}.gate_proj.weight"), vec![fs, d]);
                        push(&format!("{p}.up_proj.weight"), vec![fs, d]);
                        push(&format!("{p}.down_proj.weight"), vec![d, fs]);
                        push(&format!("{block}.shared_expert_gate.weight"), vec![1, d]);
                    }
                }
                None => {
                    push("mlp.gate_proj.weight", vec![f, d]);
                    push("mlp.up_proj.weight", vec![f, d]);
                    push("mlp.down_proj.weight", vec![d, f]);
                }
            }
        }
        all
    }

    /// The number of parameters.
    pub fn parameters(&self) -> usize {
        self.checkpoint_tensors()
            .iter()
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum()
    }

    /// The parameters one token reads in a decode step: all but the experts it is not routed
    /// to (all of them for a dense decoder).
    pub fn active_parameters(&self) -> usize {
        let Some(m) = self.moe else {
            return self.parameters();
        };
        // A routed expert's weights; a shared expert's are read by every token, so active.
        let expert = 3 * m.intermediate * self.hidden;
        let blocks = (0..self.layers).filter(|&i| m.at(i)).count();
        self.parameters() - blocks * (m.experts - m.top_k) * expert
    }
}
