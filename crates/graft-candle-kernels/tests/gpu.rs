//! The fused ops on a CUDA GPU (ignored in CI; `--include-ignored` on the GPU machine, through
//! `scripts/stage.sh --candle-cuda` and `scripts/gpu-run.sh`): the CPU tests' bodies on
//! `Device::new_cuda(0)`, each op against the unfused candle composition on the same GPU (the
//! causal attention's gradients too, and its determinism), decode attention's reading of
//! visible positions only (NaN elsewhere changes nothing), and sample_rows' tokens against the
//! CPU's.
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device};
use common::*;
use proptest::prelude::*;

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA GPU")
}

/// 64 cases per op; 6 under compute-sanitizer (`GRAFT_UNDER_SANITIZER`, set by
/// scripts/gpu-run.sh), which slows every launch by orders of magnitude.
fn cases() -> u32 {
    if std::env::var_os("GRAFT_UNDER_SANITIZER").is_some() {
        6
    } else {
        64
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_decode_attention_matches_unfused(case in attention_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_attention(&dev, &case, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_paged_attention_equals_the_static_cache(
        case in attention_cases(),
        block_size in prop_oneof![Just(1usize), Just(5), Just(16), Just(64), Just(100)],
    ) {
        let dev = gpu();
        for dtype in DTYPES {
            check_paged_attention(&dev, &case, dtype, block_size).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_paged_prefill_attention_matches_decode_attention(case in prefill_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_prefill_attention(&dev, &case, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_add_rms_norm_matches_unfused((lead, hidden, seed) in norm_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_add_rms_norm(&dev, &lead, hidden, seed, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_linear_matches_matmul(case in linear_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_linear(&dev, &case, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_rope_store_matches_unfused(case in rope_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_rope_store(&dev, &case, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_argmax_matches_the_first_largest(rows in 1usize..=5, n in prop_oneof![1usize..=40, Just(1025usize), Just(32000)], seed in any::<u64>()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_argmax(&dev, rows, n, seed, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_sample_rows_greedy_matches_argmax(rows in 1usize..=5, n in prop_oneof![1usize..=40, Just(1025usize), Just(32000)], seed in any::<u64>()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_sample_greedy(&dev, rows, n, seed, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_route_chooses_the_top_k(case in moe_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_route(&dev, &case, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_experts_match_per_token_matmuls(case in moe_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_experts(&dev, &case, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_shared_expert_matches_matmuls_beside_the_experts(case in moe_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_shared_expert(&dev, &case, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_swiglu_matches_unfused((mut shape, hidden, seed) in norm_cases()) {
        shape.push(hidden);
        let dev = gpu();
        for dtype in DTYPES {
            check_swiglu(&dev, &shape, seed, dtype).unwrap();
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_training_ops_match_unfused_autograd(case in train_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_rms_norm(&dev, &case, dtype).unwrap();
            check_dense(&dev, &case, dtype).unwrap();
            check_embedding(&dev, &case, dtype).unwrap();
            check_swiglu_grads(&dev, &case, dtype).unwrap();
            check_rotary(&dev, &case, dtype).unwrap();
            check_cross_entropy(&dev, &case, dtype).unwrap();
            check_backward_functions(&dev, &case, dtype).unwrap();
        }
    }
}

/// The training ops at the benchmark's sizes (4,096 rows of 512, a vocabulary of 8,192),
/// against the unfused autograd, and their gradients bit for bit the same on a second run.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_training_ops_at_benchmark_sizes_are_deterministic() {
    let dev = gpu();
    check_training_ops_deterministic(&dev).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_causal_attention_and_its_gradients_match_unfused(case in causal_cases()) {
        let dev = gpu();
        for dtype in DTYPES {
            check_causal_attention(&dev, &case, dtype).unwrap();
        }
    }
}

/// The forward and backward kernels twice on the same inputs: bitwise the same results (no
/// atomics, no data-dependent order), at shapes with several tiles of every kernel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_attention_is_deterministic() {
    let dev = gpu();
    for (seq, group, head_dim) in [(1, 1, 64), (70, 2, 64), (129, 4, 128)] {
        let case = CausalCase {
            batch: 2,
            seq,
            kv_heads: 2,
            group,
            head_dim,
            offset: 1,
            seed: 11,
        };
        for dtype in DTYPES {
            check_causal_attention_deterministic(&dev, &case, dtype).unwrap();
        }
    }
}

/// Batch 4 of 512 rows, 8 query heads on 4 KV heads, head dim 128 (16 key tiles a row);
/// under compute-sanitizer, 130 rows. Then batch 12 of 128 rows and batch 20 of 256 at head
/// dim 64.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_attention_of_long_sequences_matches_unfused() {
    let dev = gpu();
    let case = CausalCase {
        batch: 4,
        seq: if cases() < 64 { 130 } else { 512 },
        kv_heads: 4,
        group: 2,
        head_dim: 128,
        offset: 0,
        seed: 5,
    };
    for dtype in DTYPES {
        check_causal_attention(&dev, &case, dtype).unwrap();
    }
    // The benchmark's shape at batch 12 (head dim 64, 8 query heads on 4): every kernel's
    // many-rows configuration at head dim 64 (the small grids above take one row a warp).
    let case = CausalCase {
        batch: 12,
        seq: 128,
        kv_heads: 4,
        group: 2,
        head_dim: 64,
        offset: 0,
        seed: 6,
    };
    check_causal_attention(&dev, &case, DType::F32).unwrap();
    // A grid of 640 query blocks and 320 key blocks (at least 2 a multiprocessor up to 160
    // of them): f32 takes the tensor-core kernels too, at the f32 tolerance, and gives the
    // same bits twice.
    let case = CausalCase {
        batch: 20,
        seq: 256,
        ..case
    };
    check_causal_attention(&dev, &case, DType::F32).unwrap();
    check_causal_attention_deterministic(&dev, &case, DType::F32).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_causal_attention_refuses_bad_inputs() {
    check_causal_attention_refuses_bad_inputs(&gpu()).unwrap();
}

/// Experts wide enough that the expert-major kernels take 8 choices per read of a row (f32 at
/// the smaller sizes; every dtype at 4096, where bf16's and f16's down projection takes one),
/// with fewer and more than 8 choices per expert. Under compute-sanitizer, the smaller only.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_experts_in_groups_match_per_token_matmuls() {
    let dev = gpu();
    let sizes: &[(usize, usize, usize)] = if cases() < 64 {
        &[(20, 1032, 2056)]
    } else {
        &[(20, 1032, 2056), (6, 4096, 4096), (20, 4096, 4096)]
    };
    for &(tokens, hidden, inter) in sizes {
        let case = MoeCase {
            tokens,
            hidden,
            inter,
            experts: 3,
            top_k: 2,
            normalize: true,
            seed: 3,
        };
        for dtype in DTYPES {
            check_experts(&dev, &case, dtype).unwrap();
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_decode_attention_reads_only_visible_positions() {
    let dev = gpu();
    for dtype in DTYPES {
        check_attention_reads_only_visible(&dev, dtype).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_optimizer_updates_match_the_elementwise_reference(case in optim_cases()) {
        check_optim(&gpu(), &case).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_a_non_finite_gradient_skips_the_optimizer_step() {
    let dev = gpu();
    for case in skipping_cases() {
        check_optim(&dev, &case).unwrap();
    }
}

/// In bf16 and f16 a row's projection has the same bits at every row count from 3 to
/// TENSOR_ROWS (the tensor-core kernel) and at 1 and 2 (the matrix-vector kernel), the
/// decision recorded in docs/architecture.md.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_projections_are_batch_invariant() {
    let dev = gpu();
    for dtype in [DType::BF16, DType::F16] {
        // 1,024 columns: 4 warps a tile of outputs, a round each; 2,056: 8 warps, uneven
        // runs (and a partial last chunk).
        check_batch_invariance(&dev, dtype, &[1024, 2056]).unwrap();
    }
}

/// `decode_step`'s chain split over two ranks (threads on one GPU, summing in place or
/// through a copy) against the whole model's chain, in every dtype and shape.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_decode_step_of_two_shards_equals_the_whole_model() {
    let dev = gpu();
    for c in step_cases() {
        for dtype in step_dtypes(&c) {
            for split_vocab in [false, true] {
                check_step_shards(&dev, &c, dtype, split_vocab).unwrap();
            }
        }
    }
}

/// `decode_step`'s chain of kernels against its CPU composition, in every dtype and shape,
/// launched as programmatic dependents and plainly (the same bits either way).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_decode_step_matches_its_cpu_composition() {
    let dev = gpu();
    for c in step_cases() {
        for dtype in step_dtypes(&c) {
            check_step(&dev, &c, dtype).unwrap();
        }
    }
    let c = step_cases()[5];
    assert_eq!(c.batch, 2);
    let model = step_model(&c, DType::BF16, &dev).unwrap();
    let tokens = candle_core::Tensor::new(&[5u32, 9], &dev).unwrap();
    let positions = candle_core::Tensor::new(&[4u32, 7], &dev).unwrap();
    let logits = |programmatic: bool| {
        graft_candle_kernels::set_programmatic(programmatic);
        let caches = step_caches(2, DType::BF16, &dev).unwrap();
        graft_candle_kernels::decode_step(&model, &caches, &tokens, &positions, None)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let (plain, chained) = (logits(false), logits(true));
    assert_eq!(plain, chained, "programmatic launches changed the logits");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sample_rows_draw_the_oracles_distribution() {
    check_sample_statistics(&gpu(), 20_000).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sample_rows_is_deterministic_and_batch_invariant() {
    check_sample_determinism(&gpu()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sample_rows_handles_non_finite_values() {
    check_sample_non_finite(&gpu()).unwrap();
}

/// The GPU's tokens against the CPU's at two vocabularies (Llama 2's and Qwen2's), every path
/// of the kernel among the rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_sample_rows_match_the_cpu() {
    let dev = gpu();
    for vocab in [32_000, 151_936] {
        for dtype in [DType::F32, DType::BF16] {
            check_sample_matches_cpu(&dev, 66, vocab, dtype).unwrap();
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_paged_rope_store_writes_where_the_table_says() {
    let dev = gpu();
    for dtype in DTYPES {
        check_paged_rope_store(&dev, dtype).unwrap();
    }
}

/// The chain over pages against the chain over static caches, every shape and dtype.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_paged_decode_step_equals_the_static_cache() {
    let dev = gpu();
    for c in step_cases() {
        for dtype in step_dtypes(&c) {
            check_step_paged(&dev, &c, dtype).unwrap();
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_mixed_precision_adamw_updates_masters_and_copies() {
    check_adamw_mixed(&gpu()).unwrap();
}
