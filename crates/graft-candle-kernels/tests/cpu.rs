//! The fused ops on the CPU (CI): each against the unfused candle composition over random
//! shapes and dtypes (the causal attention's gradients too), decode attention's reading of
//! visible positions only, the multi-tensor optimizer updates against their elementwise
//! reference, sample_rows against argmax_last and an oracle's probabilities, and the errors.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use graft_candle_kernels::{add_rms_norm, decode_attention, swiglu};
use proptest::prelude::*;

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn decode_attention_matches_unfused(case in attention_cases()) {
        for dtype in DTYPES {
            check_attention(&Device::Cpu, &case, dtype).unwrap();
        }
    }

    #[test]
    fn prefill_attention_matches_decode_attention(case in prefill_cases()) {
        for dtype in DTYPES {
            check_prefill_attention(&Device::Cpu, &case, dtype).unwrap();
        }
    }

    #[test]
    fn paged_attention_equals_the_static_cache(
        case in attention_cases(),
        block_size in prop_oneof![Just(1usize), Just(5), Just(16), Just(64), Just(100)],
    ) {
        for dtype in DTYPES {
            check_paged_attention(&Device::Cpu, &case, dtype, block_size).unwrap();
        }
    }

    #[test]
    fn add_rms_norm_matches_unfused((lead, hidden, seed) in norm_cases()) {
        for dtype in DTYPES {
            check_add_rms_norm(&Device::Cpu, &lead, hidden, seed, dtype).unwrap();
        }
    }

    #[test]
    fn linear_matches_matmul(case in linear_cases()) {
        for dtype in DTYPES {
            check_linear(&Device::Cpu, &case, dtype).unwrap();
        }
    }

    #[test]
    fn rope_store_matches_unfused(case in rope_cases()) {
        for dtype in DTYPES {
            check_rope_store(&Device::Cpu, &case, dtype).unwrap();
        }
    }

    #[test]
    fn argmax_matches_the_first_largest(rows in 1usize..=5, n in prop_oneof![1usize..=40, Just(1025usize), Just(32000)], seed in any::<u64>()) {
        for dtype in DTYPES {
            check_argmax(&Device::Cpu, rows, n, seed, dtype).unwrap();
        }
    }

    #[test]
    fn sample_rows_greedy_matches_argmax(rows in 1usize..=5, n in prop_oneof![1usize..=40, Just(1025usize), Just(32000)], seed in any::<u64>()) {
        for dtype in DTYPES {
            check_sample_greedy(&Device::Cpu, rows, n, seed, dtype).unwrap();
        }
    }

    #[test]
    fn route_chooses_the_top_k(case in moe_cases()) {
        for dtype in DTYPES {
            check_route(&Device::Cpu, &case, dtype).unwrap();
        }
    }

    #[test]
    fn experts_match_per_token_matmuls(case in moe_cases()) {
        for dtype in DTYPES {
            check_experts(&Device::Cpu, &case, dtype).unwrap();
        }
    }

    #[test]
    fn shared_expert_matches_matmuls(case in moe_cases()) {
        for dtype in DTYPES {
            check_shared_expert(&Device::Cpu, &case, dtype).unwrap();
        }
    }

    #[test]
    fn swiglu_matches_unfused((mut shape, hidden, seed) in norm_cases()) {
        shape.push(hidden);
        for dtype in DTYPES {
            check_swiglu(&Device::Cpu, &shape, seed, dtype).unwrap();
        }
    }

    #[test]
    fn training_ops_match_unfused_autograd(case in train_cases()) {
        for dtype in DTYPES {
            check_rms_norm(&Device::Cpu, &case, dtype).unwrap();
            check_dense(&Device::Cpu, &case, dtype).unwrap();
            check_embedding(&Device::Cpu, &case, dtype).unwrap();
            check_swiglu_grads(&Device::Cpu, &case, dtype).unwrap();
            check_rotary(&Device::Cpu, &case, dtype).unwrap();
            check_cross_entropy(&Device::Cpu, &case, dtype).unwrap();
            check_backward_functions(&Device::Cpu, &case, dtype).unwrap();
        }
    }
}

proptest! {
    // Few cases: the CPU attention of 70 rows and its reference take a moment in debug builds.
    #![proptest_config(ProptestConfig::with_cases(6))]

    #[test]
    fn causal_attention_and_its_gradients_match_unfused(case in causal_cases()) {
        for dtype in DTYPES {
            check_causal_attention(&Device::Cpu, &case, dtype).unwrap();
        }
    }
}

/// The edges the random cases may miss: one row, head dim 128 with 4 query heads per KV head,
/// rows past two key tiles, a start offset.
#[test]
fn causal_attention_matches_unfused_at_the_edges() {
    let cases = [
        (1, 1, 1, 4, 64, 0),
        (2, 33, 2, 2, 128, 1),
        (1, 65, 1, 1, 64, 1),
    ];
    for (batch, seq, kv_heads, group, head_dim, offset) in cases {
        let case = CausalCase {
            batch,
            seq,
            kv_heads,
            group,
            head_dim,
            offset,
            seed: 7,
        };
        for dtype in DTYPES {
            check_causal_attention(&Device::Cpu, &case, dtype).unwrap();
        }
        check_causal_attention_deterministic(&Device::Cpu, &case, DType::F32).unwrap();
    }
}

#[test]
fn causal_attention_refuses_bad_inputs() {
    check_causal_attention_refuses_bad_inputs(&Device::Cpu).unwrap();
}

#[test]
fn decode_attention_reads_only_visible_positions() {
    for dtype in DTYPES {
        check_attention_reads_only_visible(&Device::Cpu, dtype).unwrap();
    }
}

/// The error's message (candle wraps the `KernelError` as its Display).
fn message<T: std::fmt::Debug>(result: candle_core::Result<T>) -> String {
    result.unwrap_err().to_string()
}

#[test]
fn decode_attention_refuses_bad_inputs() {
    let dev = &Device::Cpu;
    let q = Tensor::zeros((2, 6, 1, 64), DType::F32, dev).unwrap();
    let k = Tensor::zeros((2, 4, 16, 64), DType::F32, dev).unwrap();
    let pos = Tensor::new(&[1u32, 2], dev).unwrap();
    let err = message(decode_attention(&q, &k, &k, &pos, None, 1.0, None));
    assert!(err.contains("not a multiple of 4 key/value heads"), "{err}");

    let q = Tensor::zeros((2, 8, 1, 64), DType::F32, dev).unwrap();
    let err = message(decode_attention(
        &q,
        &k,
        &k,
        &pos.to_dtype(DType::F32).unwrap(),
        None,
        1.0,
        None,
    ));
    assert!(err.contains("pass them as u32"), "{err}");

    let err = message(decode_attention(
        &q,
        &k.to_dtype(DType::BF16).unwrap(),
        &k,
        &pos,
        None,
        1.0,
        None,
    ));
    assert!(err.contains("k_cache is BF16 but q is F32"), "{err}");

    let strided = k.transpose(1, 2).unwrap().transpose(1, 2).unwrap();
    let wide = Tensor::zeros((2, 4, 64, 16), DType::F32, dev)
        .unwrap()
        .transpose(2, 3)
        .unwrap();
    let err = message(decode_attention(&q, &wide, &strided, &pos, None, 1.0, None));
    assert!(err.contains("k_cache is not contiguous"), "{err}");

    let big = Tensor::zeros((2, 4, 1, 320), DType::F32, dev).unwrap();
    let kbig = Tensor::zeros((2, 4, 16, 320), DType::F32, dev).unwrap();
    let err = message(decode_attention(&big, &kbig, &kbig, &pos, None, 1.0, None));
    assert!(err.contains("head dim 320"), "{err}");

    let past = Tensor::new(&[1u32, 16], dev).unwrap();
    let err = message(decode_attention(&q, &k, &k, &past, None, 1.0, None));
    assert!(
        err.contains("sequence 1 is at position 16, past the cache's 16"),
        "{err}"
    );

    let many = Tensor::zeros((1, 64, 1, 256), DType::F32, dev).unwrap();
    let one = Tensor::zeros((1, 1, 16, 256), DType::F32, dev).unwrap();
    let err = message(decode_attention(
        &many,
        &one,
        &one,
        &pos.narrow(0, 0, 1).unwrap(),
        None,
        1.0,
        None,
    ));
    assert!(err.contains("64 query heads per key/value head"), "{err}");

    let empty = Tensor::zeros((2, 4, 0, 64), DType::F32, dev).unwrap();
    let err = message(decode_attention(&q, &empty, &empty, &pos, None, 1.0, None));
    assert!(err.contains("the KV cache has no positions"), "{err}");

    let wide_batch = Tensor::zeros((65536, 1, 1, 1), DType::F32, dev).unwrap();
    let wide_pos = Tensor::zeros(65536, DType::U32, dev).unwrap();
    let err = message(decode_attention(
        &wide_batch,
        &wide_batch,
        &wide_batch,
        &wide_pos,
        None,
        1.0,
        None,
    ));
    assert!(err.contains("the batch is 65536"), "{err}");

    let ints = Tensor::zeros((2, 8, 1, 64), DType::U32, dev).unwrap();
    let err = message(decode_attention(&ints, &k, &k, &pos, None, 1.0, None));
    assert!(err.contains("supports f32, bf16 and f16"), "{err}");
}

#[test]
fn decode_attention_of_an_empty_batch_is_empty() {
    let dev = &Device::Cpu;
    let q = Tensor::zeros((0, 8, 1, 64), DType::F32, dev).unwrap();
    let k = Tensor::zeros((0, 4, 16, 64), DType::F32, dev).unwrap();
    let pos = Tensor::zeros(0, DType::U32, dev).unwrap();
    let out = decode_attention(&q, &k, &k, &pos, None, 1.0, None).unwrap();
    assert_eq!(out.dims(), [0, 1, 512]);
}

#[test]
fn add_rms_norm_and_swiglu_refuse_bad_inputs() {
    let dev = &Device::Cpu;
    let x = Tensor::zeros((3, 8), DType::F32, dev).unwrap();
    let w = Tensor::zeros(7, DType::F32, dev).unwrap();
    let err = message(add_rms_norm(&x, &x, &w, 1e-5));
    assert!(
        err.contains("weight has shape [7], expected [x's last dimension]"),
        "{err}"
    );
    let t = Tensor::zeros((8, 3), DType::F32, dev).unwrap().t().unwrap();
    let err = message(add_rms_norm(
        &t,
        &x,
        &w.pad_with_zeros(0, 0, 1).unwrap(),
        1e-5,
    ));
    assert!(err.contains("x is not contiguous"), "{err}");
    let err = message(swiglu(&x, &x.narrow(1, 0, 4).unwrap()));
    assert!(
        err.contains("up has shape [3, 4], expected gate's shape"),
        "{err}"
    );
    let err = message(swiglu(&x, &x.to_dtype(DType::F16).unwrap()));
    assert!(err.contains("up is F16 but gate is F32"), "{err}");
}

#[test]
fn linear_and_rope_store_refuse_bad_inputs() {
    let dev = &Device::Cpu;
    let x = Tensor::zeros((2, 8), DType::F32, dev).unwrap();
    let w = Tensor::zeros((4, 7), DType::F32, dev).unwrap();
    let err = message(graft_candle_kernels::linear(&x, &w, None));
    assert!(
        err.contains("x has shape [2, 8], expected [..., k]"),
        "{err}"
    );
    let (gate, up) = (
        Tensor::zeros((3, 8), DType::F32, dev).unwrap(),
        Tensor::zeros((4, 8), DType::F32, dev).unwrap(),
    );
    let err = message(graft_candle_kernels::linear_swiglu(&x, &gate, &up));
    assert!(
        err.contains("up has shape [4, 8], expected gate's shape"),
        "{err}"
    );
    let err = message(graft_candle_kernels::linear_cat(&x, &[(&gate, None); 4]));
    assert!(err.contains("4 weights, but it takes 1 to 3"), "{err}");
    let bias = Tensor::zeros(4, DType::F32, dev).unwrap();
    let err = message(graft_candle_kernels::linear(&x, &gate, Some(&bias)));
    assert!(err.contains("bias has shape [4], expected [n]"), "{err}");

    let qkv = Tensor::zeros((2, (4 + 2 * 2) * 8), DType::F32, dev).unwrap();
    let table = Tensor::zeros((16, 4), DType::F32, dev).unwrap();
    let cache = Tensor::zeros((2, 2, 16, 8), DType::F32, dev).unwrap();
    let style = graft_candle_kernels::RopeStyle::Half;
    let rope = |qkv: &Tensor, pos: &Tensor, heads| {
        graft_candle_kernels::rope_store(
            qkv,
            &table,
            &table,
            pos,
            None,
            (&cache, &cache),
            heads,
            style,
            None,
        )
    };
    let pos = Tensor::new(&[1u32, 16], dev).unwrap();
    let err = message(rope(&qkv, &pos, 4));
    assert!(err.contains("sequence 1 is at position 16"), "{err}");
    let pos = Tensor::new(&[1u32, 2], dev).unwrap();
    let err = message(rope(&qkv, &pos, 3));
    assert!(err.contains("qkv has shape [2, 64]"), "{err}");
    let err = message(rope(&qkv, &pos.to_dtype(DType::F32).unwrap(), 4));
    assert!(err.contains("positions are F32; pass them as u32"), "{err}");
    assert_eq!(rope(&qkv, &pos, 4).unwrap().dims(), [2, 4, 1, 8]);
    let rows = Tensor::new(&[0u32, 2], dev).unwrap();
    let err = message(graft_candle_kernels::rope_store(
        &qkv,
        &table,
        &table,
        &pos,
        Some(&rows),
        (&cache, &cache),
        4,
        style,
        None,
    ));
    assert!(
        err.contains("query 1 reads cache row 2, but the cache has 2 rows"),
        "{err}"
    );
    let q = Tensor::zeros((2, 4, 1, 8), DType::F32, dev).unwrap();
    let err = message(decode_attention(
        &q,
        &cache,
        &cache,
        &pos,
        Some(&rows),
        1.0,
        None,
    ));
    assert!(
        err.contains("query 1 reads cache row 2, but the cache has 2 rows"),
        "{err}"
    );
}

#[test]
fn route_and_experts_refuse_bad_inputs() {
    use graft_candle_kernels::{Experts, MAX_EXPERTS, route};
    let dev = &Device::Cpu;
    let logits = Tensor::zeros((2, 4), DType::F32, dev).unwrap();
    let err = message(route(&logits, 5, true));
    assert!(err.contains("top 5 of 4 experts"), "{err}");
    let err = message(route(&logits, 0, true));
    assert!(err.contains("top 0 of 4 experts"), "{err}");
    let wide = Tensor::zeros((1, MAX_EXPERTS + 1), DType::F32, dev).unwrap();
    let err = message(route(&wide, 2, true));
    assert!(err.contains("top 2 of 257 experts"), "{err}");
    let err = message(route(&logits.to_dtype(DType::U32).unwrap(), 2, true));
    assert!(err.contains("logits is U32"), "{err}");
    let err = message(route(&logits.t().unwrap(), 2, true));
    assert!(err.contains("logits is not contiguous"), "{err}");
    assert_eq!(
        route(&logits, 4, false).unwrap().weights().unwrap().dims(),
        [2, 4]
    );

    let w = |r: usize, c: usize| Tensor::zeros((r, c), DType::F32, dev).unwrap();
    let err = message(Experts::new(vec![w(6, 4)], vec![w(6, 4)], vec![]));
    assert!(err.contains("1 gate, 1 up and 0 down weights"), "{err}");
    let err = message(Experts::new(vec![w(6, 4)], vec![w(6, 4)], vec![w(6, 4)]));
    assert!(err.contains("down has shape [6, 4]"), "{err}");
    let err = message(Experts::new(
        vec![w(6, 4)],
        vec![w(6, 4).to_dtype(DType::BF16).unwrap()],
        vec![w(4, 6)],
    ));
    assert!(err.contains("up is BF16 but gate is F32"), "{err}");
    let experts = Experts::new(vec![w(6, 4); 4], vec![w(6, 4); 4], vec![w(4, 6); 4]).unwrap();
    let routing = route(&logits, 2, true).unwrap();
    let err = message(experts.forward(&w(2, 5), &routing));
    assert!(
        err.contains("x has shape [2, 5], expected [..., hidden]"),
        "{err}"
    );
    let err = message(experts.forward(&w(3, 4), &routing));
    assert!(err.contains("one routed row per token of x"), "{err}");
    assert_eq!(experts.forward(&w(2, 4), &routing).unwrap().dims(), [2, 4]);
}

proptest! {
    // Fewer cases: each runs up to 170 tensors for several steps against the reference.
    #![proptest_config(ProptestConfig::with_cases(10))]

    #[test]
    fn optimizer_updates_match_the_elementwise_reference(case in optim_cases()) {
        check_optim(&Device::Cpu, &case).unwrap();
    }
}

#[test]
fn a_non_finite_gradient_skips_the_optimizer_step() {
    for case in skipping_cases() {
        check_optim(&Device::Cpu, &case).unwrap();
    }
}

#[test]
fn optimizer_updates_refuse_bad_inputs() {
    use graft_candle_kernels::{AdamWHyper, SgdHyper, adamw_update, optim_scalars, sgd_update};
    let dev = &Device::Cpu;
    let z = |n: usize| Tensor::zeros(n, DType::F32, dev).unwrap();
    let hyper = AdamWHyper {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let s = optim_scalars(0.1, dev).unwrap();
    let (p, g, m, v) = (z(4), z(4), z(4), z(4));
    let adamw = |p: &[&Tensor], g: &[&Tensor], m: &[&Tensor], v: &[&Tensor], s: &Tensor| {
        message(adamw_update(p, g, m, v, s, &hyper))
    };
    let err = adamw(&[&p], &[], &[&m], &[&v], &s);
    assert!(err.contains("1 parameters but 0 grads"), "{err}");
    let err = adamw(&[&p], &[&z(5)], &[&m], &[&v], &s);
    assert!(
        err.contains("grads[0] has shape [5] but its parameter has [4]"),
        "{err}"
    );
    let g16 = g.to_dtype(DType::F16).unwrap();
    let err = adamw(&[&p], &[&g16], &[&m], &[&v], &s);
    assert!(
        err.contains("grads is F16 but its parameter is F32"),
        "{err}"
    );
    let err = adamw(&[&p], &[&g], &[&p], &[&v], &s);
    assert!(err.contains("shares memory with params[0]"), "{err}");
    let err = adamw(&[&s], &[&g], &[&m], &[&v], &s);
    assert!(err.contains("shares memory with"), "{err}");
    let wide = z(8);
    let (a, b) = (wide.narrow(0, 0, 4).unwrap(), wide.narrow(0, 3, 4).unwrap());
    let err = adamw(&[&a, &b], &[&g, &g], &[&m, &z(4)], &[&v, &z(4)], &s);
    assert!(err.contains("shares memory with params[0]"), "{err}");
    // Disjoint views of one storage are fine, and so is one gradient read twice.
    let b = wide.narrow(0, 4, 4).unwrap();
    adamw_update(&[&a, &b], &[&g, &g], &[&m, &z(4)], &[&v, &z(4)], &s, &hyper).unwrap();
    let t = Tensor::zeros((2, 2), DType::F32, dev).unwrap().t().unwrap();
    let err = adamw(&[&t], &[&g], &[&m], &[&v], &s);
    assert!(err.contains("params is not contiguous"), "{err}");
    let err = adamw(&[&p.to_dtype(DType::U32).unwrap()], &[&g], &[&m], &[&v], &s);
    assert!(err.contains("params is U32"), "{err}");
    let err = adamw(&[&p], &[&g], &[&m], &[&v], &z(3));
    assert!(err.contains("scalars has shape [3]"), "{err}");
    let err = adamw(&[&p], &[&g], &[&m], &[&v], &s.to_dtype(DType::F16).unwrap());
    assert!(err.contains("scalars is F16; pass it as F32"), "{err}");
    let bad = AdamWHyper {
        beta1: 1.0,
        ..hyper
    };
    let err = message(adamw_update(&[&p], &[&g], &[&m], &[&v], &s, &bad));
    assert!(err.contains("beta1 is 1, expected in [0, 1)"), "{err}");
    let err = message(optim_scalars(f64::NAN, dev));
    assert!(err.contains("lr is NaN"), "{err}");

    let sgd = SgdHyper {
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let err = message(sgd_update(&[&p], &[&g], None, &s, &sgd));
    assert!(err.contains("momentum 0.9 with no buffers"), "{err}");
    let plain = SgdHyper {
        momentum: 0.0,
        ..sgd
    };
    let err = message(sgd_update(&[&p], &[&g], Some(&[&m]), &s, &plain));
    assert!(err.contains("momentum 0 with buffers"), "{err}");
    // Empty tensors and empty lists are steps too: counted, nothing to update.
    sgd_update(&[&z(0)], &[&z(0)], None, &s, &plain).unwrap();
    sgd_update(&[], &[], None, &s, &plain).unwrap();
    assert_eq!(s.to_vec1::<f32>().unwrap(), [0.1, 3.0, 0.0, 0.0]);
}

/// A few rows of `linear` keep their gradients when an operand is a `Var` (the one-kernel
/// paths have no backward, so such calls take `dense`).
#[test]
fn linear_of_a_var_keeps_its_gradients() {
    let dev = Device::Cpu;
    for rows in [1, 8] {
        let x = random(1, &[rows, 16], 1.0, DType::F32, &dev).unwrap();
        let w = candle_core::Var::from_tensor(&random(2, &[4, 16], 1.0, DType::F32, &dev).unwrap())
            .unwrap();
        let grads = graft_candle_kernels::linear(&x, &w, None)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let got = grads.get(&w).expect("w's gradient");
        // d(sum(x · wᵀ)) / dw: every row of w gets the sum of x's rows.
        let want = x.sum_keepdim(0).unwrap().broadcast_as((4, 16)).unwrap();
        assert_close("dw", got, &want, (1e-5, 1e-5)).unwrap();
    }
}

/// In every dtype on the CPU (f32 took candle's matmul from 3 rows, whose sums for a row
/// changed with the row count at 64 columns).
#[test]
fn projections_are_batch_invariant() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        check_batch_invariance(&Device::Cpu, dtype, &[64, 1024, 2056]).unwrap();
    }
}

#[test]
fn decode_step_refuses_what_it_does_not_run() {
    let dev = Device::Cpu;
    let c = step_cases()[0];
    // 17 rows are one past the tensor-core projections, and on the CPU one past the rows
    // whose bits no row count changes, in every dtype.
    for dtype in [DType::F32, DType::BF16] {
        let model = step_model(&c, dtype, &dev).unwrap();
        let caches = step_caches(17, dtype, &dev).unwrap();
        let tokens = candle_core::Tensor::new(&[1u32; 17], &dev).unwrap();
        let positions = candle_core::Tensor::new(&[0u32; 17], &dev).unwrap();
        let err = graft_candle_kernels::decode_step(&model, &caches, &tokens, &positions, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("17 rows, but it takes at most 16 in {dtype:?}")),
            "{err}"
        );
    }
    let caches = step_caches(17, DType::BF16, &dev).unwrap();
    let model = step_model(&c, DType::F32, &dev).unwrap();
    let tokens = candle_core::Tensor::new(&[1u32], &dev).unwrap();
    let positions = candle_core::Tensor::new(&[0u32], &dev).unwrap();
    let err = graft_candle_kernels::decode_step(&model, &caches[..1], &tokens, &positions, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("1 key/value cache pairs"), "{err}");
}

/// A model split over two ranks steps as the whole model does (the CPU composition's sums),
/// with the vocabulary whole or split too.
#[test]
fn decode_step_of_two_shards_equals_the_whole_model() {
    for c in step_cases().into_iter().filter(|c| c.batch <= 2) {
        for split_vocab in [false, true] {
            check_step_shards(&Device::Cpu, &c, DType::F32, split_vocab).unwrap();
        }
    }
}

#[test]
fn sample_rows_draw_the_oracles_distribution() {
    check_sample_statistics(&Device::Cpu, 20_000).unwrap();
}

#[test]
fn sample_rows_is_deterministic_and_batch_invariant() {
    check_sample_determinism(&Device::Cpu).unwrap();
}

#[test]
fn sample_rows_handles_non_finite_values() {
    check_sample_non_finite(&Device::Cpu).unwrap();
}

#[test]
fn sample_rows_refuses_bad_inputs() {
    use graft_candle_kernels::{SampleParams, sample_rows};
    let dev = &Device::Cpu;
    let logits = Tensor::zeros((3, 10), DType::F32, dev).unwrap();
    let params = params_tensor(&[SampleParams::GREEDY; 3], dev).unwrap();
    let err = message(sample_rows(&logits.to_dtype(DType::U32).unwrap(), &params));
    assert!(err.contains("supports f32, bf16 and f16"), "{err}");
    let err = message(sample_rows(&logits, &params.to_dtype(DType::F32).unwrap()));
    assert!(err.contains("params are F32; pass them as u32"), "{err}");
    let err = message(sample_rows(&logits.reshape((3, 2, 5)).unwrap(), &params));
    assert!(err.contains("expected [rows, vocab]"), "{err}");
    let err = message(sample_rows(&logits.narrow(1, 0, 0).unwrap(), &params));
    assert!(err.contains("with vocab > 0"), "{err}");
    let err = message(sample_rows(&logits, &params.narrow(1, 0, 5).unwrap()));
    assert!(
        err.contains("params has shape [3, 5], expected [rows, 6]"),
        "{err}"
    );
    let err = message(sample_rows(&logits, &params.narrow(0, 0, 2).unwrap()));
    assert!(err.contains("params has shape [2, 6]"), "{err}");
    let strided = Tensor::zeros((10, 3), DType::F32, dev)
        .unwrap()
        .t()
        .unwrap();
    let err = message(sample_rows(&strided, &params));
    assert!(err.contains("logits is not contiguous"), "{err}");
    let err = message(sample_rows(
        &logits,
        &params.t().unwrap().contiguous().unwrap().t().unwrap(),
    ));
    assert!(err.contains("params is not contiguous"), "{err}");
    let huge = Tensor::zeros((0, 1 << 24), DType::F32, dev).unwrap();
    let none = params_tensor(&[], dev).unwrap();
    let err = message(sample_rows(&huge, &none));
    assert!(err.contains("the vocabulary is 16777216"), "{err}");
    // No rows: no tokens.
    let empty = sample_rows(&logits.narrow(0, 0, 0).unwrap(), &none).unwrap();
    assert_eq!(empty.dims(), [0]);
    // A start offset is fine.
    let offset = sample_rows(
        &logits.narrow(0, 1, 2).unwrap(),
        &params.narrow(0, 1, 2).unwrap(),
    );
    assert_eq!(offset.unwrap().to_vec1::<u32>().unwrap(), [0, 0]);
}

#[test]
fn paged_rope_store_writes_where_the_table_says() {
    for dtype in DTYPES {
        check_paged_rope_store(&Device::Cpu, dtype).unwrap();
    }
}

#[test]
fn paged_ops_refuse_tables_past_the_cache() {
    check_paged_refusals(&Device::Cpu).unwrap();
}

#[test]
fn paged_decode_step_equals_the_static_cache() {
    for c in step_cases().into_iter().filter(|c| c.batch <= 2) {
        check_step_paged(&Device::Cpu, &c, DType::F32).unwrap();
    }
}

#[test]
fn mixed_precision_adamw_updates_masters_and_copies() {
    check_adamw_mixed(&Device::Cpu).unwrap();
}
