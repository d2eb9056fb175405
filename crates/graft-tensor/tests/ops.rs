//! Each tensor op against a plain Rust reference, on the simulator and (ignored without a GPU)
//! on CUDA, with the same test body; and ops recorded inside a graft body replay on the
//! memory's current values.

mod common;

use common::{assert_close, f32s, graft, i32s, read, values};
use graft_core::{BodyError, FunctionSpec, Output};
use graft_tensor::{Backend, DType, Meta, Tensor, TensorError, gelu_tanh, ops};

const TOL: f32 = 1e-5;

fn embedding<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let (vocab, dim) = (7, 5);
    let table_h = values(vocab * dim, 1);
    let table = f32s(&mut g, &[vocab, dim], &table_h);
    let ids_h = [3, 0, 6, -1, 7, 3];
    let ids = i32s(&mut g, &[6], &ids_h);
    let out = ops::embedding(&mut g, &ids, &table).unwrap();
    assert_eq!(out.shape(), &[6, dim]);
    let want: Vec<f32> = ids_h
        .iter()
        .flat_map(|&id| {
            if (0..vocab as i32).contains(&id) {
                table_h[id as usize * dim..][..dim].to_vec()
            } else {
                vec![0.0; dim]
            }
        })
        .collect();
    assert_eq!(read(&g, &out), want, "a gather is exact");
}
backend_test!(embedding);

fn add_position<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let (rows, ctx, dim) = (3, 4, 5);
    let x_h = values(rows * dim, 2);
    let t_h = values(ctx * dim, 3);
    let x = f32s(&mut g, &[rows, dim], &x_h);
    let table = f32s(&mut g, &[ctx, dim], &t_h);
    for (p, used) in [(2, 2), (0, 0), (9, ctx - 1), (-4, 0)] {
        let pos = i32s(&mut g, &[1], &[p]);
        let out = ops::add_position(&mut g, &x, &table, &pos).unwrap();
        let want: Vec<f32> = (0..rows * dim)
            .map(|i| x_h[i] + t_h[used * dim + i % dim])
            .collect();
        assert_eq!(read(&g, &out), want, "pos {p}");
    }
}
backend_test!(add_position);

fn add<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let n = 1000;
    let (a_h, b_h) = (values(n, 4), values(n, 5));
    let a = f32s(&mut g, &[10, 100], &a_h);
    let b = f32s(&mut g, &[10, 100], &b_h);
    let out = ops::add(&mut g, &a, &b).unwrap();
    let want: Vec<f32> = a_h.iter().zip(&b_h).map(|(x, y)| x + y).collect();
    assert_eq!(read(&g, &out), want);
    let wrong = f32s(&mut g, &[100, 10], &b_h);
    assert!(matches!(
        ops::add(&mut g, &a, &wrong),
        Err(TensorError::Shape { op: "add", .. })
    ));
}
backend_test!(add);

fn layer_norm<D: Backend>(dev: D) {
    let mut g = graft(dev);
    for (rows, dim) in [(3, 37), (2, 300), (1, 1)] {
        let x_h: Vec<f32> = values(rows * dim, 6)
            .iter()
            .map(|v| v * 3.0 + 0.5)
            .collect();
        let g_h = values(dim, 7);
        let b_h = values(dim, 8);
        let x = f32s(&mut g, &[rows, dim], &x_h);
        let gamma = f32s(&mut g, &[dim], &g_h);
        let beta = f32s(&mut g, &[dim], &b_h);
        let out = ops::layer_norm(&mut g, &x, &gamma, &beta, 1e-5).unwrap();
        let mut want = Vec::new();
        for r in 0..rows {
            let row: Vec<f64> = x_h[r * dim..][..dim].iter().map(|&v| v as f64).collect();
            let mean = row.iter().sum::<f64>() / dim as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (var + 1e-5).sqrt();
            for c in 0..dim {
                want.push(((row[c] - mean) * inv * g_h[c] as f64 + b_h[c] as f64) as f32);
            }
        }
        assert_close(&read(&g, &out), &want, 1e-4);
    }
}
backend_test!(layer_norm);

fn host_matmul(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    rows: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * n];
    for i in 0..rows {
        for j in 0..n {
            let mut acc = 0.0f64;
            for p in 0..k {
                acc += x[i * k + p] as f64 * w[p * n + j] as f64;
            }
            out[i * n + j] = (acc + bias.map_or(0.0, |b| b[j] as f64)) as f32;
        }
    }
    out
}

fn matmul<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let (rows, k, n) = (3, 70, 45);
    let (x_h, w_h, b_h) = (values(rows * k, 9), values(k * n, 10), values(n, 11));
    let x = f32s(&mut g, &[rows, k], &x_h);
    let w = f32s(&mut g, &[k, n], &w_h);
    let b = f32s(&mut g, &[n], &b_h);
    let out = ops::matmul(&mut g, &x, &w, Some(&b)).unwrap();
    assert_eq!(out.shape(), &[rows, n]);
    assert_close(
        &read(&g, &out),
        &host_matmul(&x_h, &w_h, Some(&b_h), rows, k, n),
        1e-4,
    );
    let out = ops::matmul(&mut g, &x, &w, None).unwrap();
    assert_close(
        &read(&g, &out),
        &host_matmul(&x_h, &w_h, None, rows, k, n),
        1e-4,
    );
    // Mismatched inner dimension and bias: shape errors, no launch.
    let wt = f32s(&mut g, &[n, k], &w_h);
    assert!(matches!(
        ops::matmul(&mut g, &x, &wt, None),
        Err(TensorError::Shape { operand: "w", .. })
    ));
    assert!(matches!(
        ops::matmul(&mut g, &x, &w, Some(&x)),
        Err(TensorError::Shape {
            operand: "bias",
            ..
        })
    ));
}
backend_test!(matmul);

fn gelu<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let x_h: Vec<f32> = values(513, 12).iter().map(|v| v * 6.0).collect();
    let x = f32s(&mut g, &[513], &x_h);
    let out = ops::gelu(&mut g, &x).unwrap();
    let want: Vec<f32> = x_h
        .iter()
        .map(|&v| {
            let v = v as f64;
            (0.5 * v
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh()))
                as f32
        })
        .collect();
    assert_close(&read(&g, &out), &want, 1e-5);
    assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
}
backend_test!(gelu);

fn host_softmax(row: &[f32], valid: usize) -> Vec<f32> {
    let max = row[..valid]
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row[..valid].iter().map(|&v| (v as f64 - max).exp()).sum();
    (0..row.len())
        .map(|j| {
            if j < valid {
                ((row[j] as f64 - max).exp() / sum) as f32
            } else {
                0.0
            }
        })
        .collect()
}

fn masked_softmax<D: Backend>(dev: D) {
    let mut g = graft(dev);
    for (rows, cols) in [(4, 10), (2, 600)] {
        let x_h: Vec<f32> = values(rows * cols, 13).iter().map(|v| v * 5.0).collect();
        let x = f32s(&mut g, &[rows, cols], &x_h);
        for p in [0, 3, cols as i32 - 1, cols as i32 + 10] {
            let pos = i32s(&mut g, &[1], &[p]);
            let out = ops::masked_softmax(&mut g, &x, &pos).unwrap();
            let valid = (p as usize).min(cols - 1) + 1;
            let want: Vec<f32> = x_h
                .chunks(cols)
                .flat_map(|r| host_softmax(r, valid))
                .collect();
            assert_close(&read(&g, &out), &want, TOL);
        }
    }
}
backend_test!(masked_softmax);

fn attention<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let (batch, heads, hd, ctx) = (2, 3, 4, 5);
    let d = heads * hd;
    let q_h = values(batch * d, 14);
    let k_h = values(batch * ctx * d, 15);
    let v_h = values(batch * ctx * d, 16);
    let q = f32s(&mut g, &[batch, d], &q_h);
    let kc = f32s(&mut g, &[batch, ctx, d], &k_h);
    let vc = f32s(&mut g, &[batch, ctx, d], &v_h);
    for p in [0usize, 2, 4] {
        let pos = i32s(&mut g, &[1], &[p as i32]);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut want_scores = vec![0.0f32; batch * heads * ctx];
        let mut want_out = vec![0.0f32; batch * d];
        for b in 0..batch {
            for h in 0..heads {
                let mut s = vec![0.0f32; ctx];
                for j in 0..=p {
                    let dot: f64 = (0..hd)
                        .map(|t| {
                            q_h[b * d + h * hd + t] as f64
                                * k_h[(b * ctx + j) * d + h * hd + t] as f64
                        })
                        .sum();
                    s[j] = (dot * scale as f64) as f32;
                }
                want_scores[(b * heads + h) * ctx..][..ctx].copy_from_slice(&s);
                let probs = host_softmax(&s, p + 1);
                for t in 0..hd {
                    let acc: f64 = (0..=p)
                        .map(|j| probs[j] as f64 * v_h[(b * ctx + j) * d + h * hd + t] as f64)
                        .sum();
                    want_out[b * d + h * hd + t] = acc as f32;
                }
            }
        }
        let scores = ops::attention_scores(&mut g, &q, &kc, &pos, heads).unwrap();
        assert_eq!(scores.shape(), &[batch, heads, ctx]);
        assert_close(&read(&g, &scores), &want_scores, TOL);
        let out = ops::attention(&mut g, &q, &kc, &vc, &pos, heads).unwrap();
        assert_eq!(out.shape(), &[batch, d]);
        assert_close(&read(&g, &out), &want_out, 1e-4);
    }
    assert!(matches!(
        ops::attention(&mut g, &q, &kc, &vc, &q, heads),
        Err(TensorError::DType { operand: "pos", .. })
    ));
}
backend_test!(attention);

fn kv_write<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let (batch, ctx, dim) = (2, 4, 3);
    let init = values(batch * ctx * dim, 17);
    let cache = f32s(&mut g, &[batch, ctx, dim], &init);
    let x_h = values(batch * dim, 18);
    let x = f32s(&mut g, &[batch, dim], &x_h);
    let pos = i32s(&mut g, &[1], &[1]);
    ops::kv_write(&mut g, &cache, &x, &pos).unwrap();
    let mut want = init.clone();
    for b in 0..batch {
        want[(b * ctx + 1) * dim..][..dim].copy_from_slice(&x_h[b * dim..][..dim]);
    }
    assert_eq!(read(&g, &cache), want);
    // Past the end: clamped to the last row, never out of bounds.
    let far = i32s(&mut g, &[1], &[100]);
    ops::kv_write(&mut g, &cache, &x, &far).unwrap();
    for b in 0..batch {
        want[(b * ctx + ctx - 1) * dim..][..dim].copy_from_slice(&x_h[b * dim..][..dim]);
    }
    assert_eq!(read(&g, &cache), want);
}
backend_test!(kv_write);

fn argmax<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let cols = 300;
    let mut rows: Vec<Vec<f32>> = vec![values(cols, 19), vec![0.0; cols], vec![f32::NAN; cols]];
    rows[0][257] = 5.0;
    rows[1][7] = 1.0;
    rows[1][200] = 1.0; // tie: the first index wins
    rows[2][150] = -1.0;
    rows.push(vec![f32::NEG_INFINITY; cols]);
    rows.push(vec![f32::NAN; cols]);
    let flat: Vec<f32> = rows.concat();
    let x = f32s(&mut g, &[rows.len(), cols], &flat);
    let out = ops::argmax(&mut g, &x).unwrap();
    assert_eq!(out.dtype(), DType::I32);
    assert_eq!(out.to_vec_i32(g.device()).unwrap(), vec![257, 7, 150, 0, 0]);
}
backend_test!(argmax);

fn increment<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let pos = i32s(&mut g, &[1], &[0]);
    for _ in 0..3 {
        ops::increment(&mut g, &pos, 2).unwrap();
    }
    assert_eq!(
        pos.to_vec_i32(g.device()).unwrap(),
        vec![2],
        "saturates at the limit"
    );
}
backend_test!(increment);

/// A body of several ops, registered with graft: the warmup, the recording and every replay
/// compute on the inputs and position of their own call (kernels read memory when they run).
fn ops_replay_on_current_memory<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let fid = g.register("block", FunctionSpec::inference([1, 2]));
    let (rows, k, n) = (2, 8, 6);
    let w_h = values(k * n, 20);
    let w = f32s(&mut g, &[k, n], &w_h);
    w.buffer().mark_static();
    let pos = i32s(&mut g, &[1], &[0]);
    pos.buffer().mark_static();
    for step in 0..5u32 {
        let x_h = values(rows * k, 100 + step);
        let x = f32s(&mut g, &[rows, k], &x_h);
        let outs = g
            .call(
                fid,
                &[x.buffer(), w.buffer(), pos.buffer()],
                &[],
                |ctx| -> Result<Vec<Output<Meta>>, BodyError> {
                    let ins = ctx.inputs();
                    let x = Tensor::from_buffer(ins[0].clone(), &[rows, k], DType::F32)?;
                    let w = Tensor::from_buffer(ins[1].clone(), &[k, n], DType::F32)?;
                    let pos = Tensor::from_buffer(ins[2].clone(), &[1], DType::I32)?;
                    let y = ops::matmul(ctx, &x, &w, None)?;
                    let y = ops::gelu(ctx, &y)?;
                    let p = ops::masked_softmax(ctx, &y, &pos)?;
                    ops::increment(ctx, &pos, 100)?;
                    Ok(vec![p.into_output()])
                },
            )
            .unwrap();
        let out = Tensor::from_output(outs.into_iter().next().unwrap()).unwrap();
        let y: Vec<f32> = host_matmul(&x_h, &w_h, None, rows, k, n)
            .into_iter()
            .map(gelu_tanh)
            .collect();
        let valid = (step as usize).min(n - 1) + 1;
        let want: Vec<f32> = y.chunks(n).flat_map(|r| host_softmax(r, valid)).collect();
        assert_close(&read(&g, &out), &want, 1e-4);
    }
    assert_eq!(pos.to_vec_i32(g.device()).unwrap(), vec![5]);
    let stats = g.stats();
    assert_eq!((stats.warmups, stats.recordings, stats.replays), (1, 1, 3));
}
backend_test!(ops_replay_on_current_memory);

fn host_layer_norm(x: &[f32], g: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    x.iter()
        .zip(g.iter().zip(b))
        .map(|(&v, (&g, &b))| ((v as f64 - mean) * inv * g as f64 + b as f64) as f32)
        .collect()
}

/// The fused product: every epilogue combination, row counts on both sides of the few-rows
/// kernel's tiles, column counts it takes (multiples of 4) and leaves to cuBLAS, and a k
/// longer than its shared-memory chunk.
fn linear<D: Backend>(dev: D) {
    let mut g = graft(dev);
    for (rows, k, n) in [
        (1, 70, 96),
        (3, 70, 45),
        (8, 64, 512),
        (13, 2100, 40),
        (32, 96, 2048),
        (2, 9000, 8),
    ] {
        let (x_h, w_h, b_h) = (values(rows * k, 30), values(k * n, 31), values(n, 32));
        let r_h = values(rows * n, 33);
        let x = f32s(&mut g, &[rows, k], &x_h);
        let w = f32s(&mut g, &[k, n], &w_h);
        let b = f32s(&mut g, &[n], &b_h);
        let r = f32s(&mut g, &[rows, n], &r_h);
        for (bias, res, act) in [
            (false, false, false),
            (true, false, false),
            (true, false, true),
            (true, true, false),
            (false, true, true),
        ] {
            let out =
                ops::linear(&mut g, &x, &w, bias.then_some(&b), res.then_some(&r), act).unwrap();
            assert_eq!(out.shape(), &[rows, n]);
            let mut want = host_matmul(&x_h, &w_h, bias.then_some(&b_h[..]), rows, k, n);
            if act {
                want.iter_mut().for_each(|v| *v = gelu_tanh(*v));
            }
            if res {
                want.iter_mut().zip(&r_h).for_each(|(v, r)| *v += r);
            }
            let tol = 1e-4 * (k as f32 / 64.0).sqrt().max(1.0);
            assert_close(&read(&g, &out), &want, tol);
        }
    }
    let (x, w) = (
        f32s(&mut g, &[2, 4], &[0.0; 8]),
        f32s(&mut g, &[4, 8], &[0.0; 32]),
    );
    assert!(matches!(
        ops::linear(&mut g, &x, &w, None, Some(&x), false),
        Err(TensorError::Shape {
            operand: "residual",
            ..
        })
    ));
}
backend_test!(linear);

fn embed_norm<D: Backend>(dev: D) {
    let mut g = graft(dev);
    // Both the register path (dim <= 1024) and the looping one.
    for dim in [300, 1100] {
        let (vocab, ctx) = (7, 4);
        let t_h = values(vocab * dim, 40);
        let p_h = values(ctx * dim, 41);
        let gam_h: Vec<f32> = values(dim, 42).iter().map(|v| 1.0 + v).collect();
        let bet_h = values(dim, 43);
        let table = f32s(&mut g, &[vocab, dim], &t_h);
        let ptab = f32s(&mut g, &[ctx, dim], &p_h);
        let gam = f32s(&mut g, &[dim], &gam_h);
        let bet = f32s(&mut g, &[dim], &bet_h);
        let ids_h = [3, 0, 6, -1, 7];
        let ids = i32s(&mut g, &[5], &ids_h);
        for (p, used) in [(2, 2), (9, ctx - 1), (-3, 0)] {
            let pos = i32s(&mut g, &[1], &[p]);
            let (x, h) =
                ops::embed_norm(&mut g, &ids, &table, &ptab, &pos, &gam, &bet, 1e-5).unwrap();
            let (t_h, p_h) = (&t_h, &p_h);
            let want_x: Vec<f32> = ids_h
                .iter()
                .flat_map(|&id| {
                    (0..dim).map(move |c| {
                        let e = if (0..vocab as i32).contains(&id) {
                            t_h[id as usize * dim + c]
                        } else {
                            0.0
                        };
                        e + p_h[used * dim + c]
                    })
                })
                .collect();
            assert_eq!(
                read(&g, &x),
                want_x,
                "pos {p}: a gather and one add are exact"
            );
            let want_h: Vec<f32> = want_x
                .chunks(dim)
                .flat_map(|r| host_layer_norm(r, &gam_h, &bet_h, 1e-5))
                .collect();
            assert_close(&read(&g, &h), &want_h, TOL * 10.0);
        }
    }
}
backend_test!(embed_norm);

/// The fused attention step: cache writes at the (clamped) position and attention over
/// rows `0..=pos`, for head sizes on the float4 and scalar paths and a context longer than
/// the kernel's score chunk (online softmax across chunks).
fn attention_step<D: Backend>(dev: D) {
    let mut g = graft(dev);
    for (batch, heads, hd, ctx, positions) in [
        (2, 3, 4, 5, vec![0i32, 2, 4, 9]),
        (2, 2, 5, 6, vec![3, -2]),
        (1, 2, 64, 1300, vec![1299, 1030, 700]),
    ] {
        let d = heads * hd;
        let k_h = values(batch * ctx * d, 50);
        let v_h = values(batch * ctx * d, 51);
        let kc = f32s(&mut g, &[batch, ctx, d], &k_h);
        let vc = f32s(&mut g, &[batch, ctx, d], &v_h);
        let (mut k_want, mut v_want) = (k_h.clone(), v_h.clone());
        for (i, &p) in positions.iter().enumerate() {
            let pu = (p.max(0) as usize).min(ctx - 1);
            let raw_h: Vec<f32> = values(batch * 3 * d, 60 + i as u32)
                .iter()
                .map(|v| v * 3.0)
                .collect();
            let qkv = f32s(&mut g, &[batch, 3 * d], &raw_h);
            // Odd steps add a bias inside the op.
            let bias_h = values(3 * d, 80 + i as u32);
            let with_bias = i % 2 == 1;
            let bias = f32s(&mut g, &[3 * d], &bias_h);
            let qkv_h: Vec<f32> = raw_h
                .iter()
                .enumerate()
                .map(|(j, v)| {
                    if with_bias {
                        v + bias_h[j % (3 * d)]
                    } else {
                        *v
                    }
                })
                .collect();
            let pos = i32s(&mut g, &[1], &[p]);
            let out = ops::attention_step(
                &mut g,
                &qkv,
                with_bias.then_some(&bias),
                &kc,
                &vc,
                &pos,
                heads,
            )
            .unwrap();
            assert_eq!(out.shape(), &[batch, d]);
            let scale = 1.0 / (hd as f64).sqrt();
            let mut want = vec![0.0f32; batch * d];
            for b in 0..batch {
                let row = &qkv_h[b * 3 * d..][..3 * d];
                k_want[(b * ctx + pu) * d..][..d].copy_from_slice(&row[d..2 * d]);
                v_want[(b * ctx + pu) * d..][..d].copy_from_slice(&row[2 * d..]);
                for h in 0..heads {
                    let s: Vec<f64> = (0..=pu)
                        .map(|j| {
                            (0..hd)
                                .map(|t| {
                                    row[h * hd + t] as f64
                                        * k_want[(b * ctx + j) * d + h * hd + t] as f64
                                })
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for t in 0..hd {
                        let acc: f64 = (0..=pu)
                            .map(|j| e[j] * v_want[(b * ctx + j) * d + h * hd + t] as f64)
                            .sum();
                        want[b * d + h * hd + t] = (acc / sum) as f32;
                    }
                }
            }
            assert_close(&read(&g, &out), &want, 1e-4);
            assert_eq!(read(&g, &kc), k_want, "pos {p}: keys written");
            assert_eq!(read(&g, &vc), v_want, "pos {p}: values written");
        }
    }
}
backend_test!(attention_step);

fn argmax_step<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let cols = 9000;
    let mut rows: Vec<Vec<f32>> = vec![values(cols, 70), vec![0.0; cols], vec![f32::NAN; cols]];
    rows[0][8999] = 5.0;
    rows[1][7] = 1.0;
    rows[1][200] = 1.0;
    rows[2][150] = -1.0;
    rows.push(vec![f32::NEG_INFINITY; cols]);
    rows.push(vec![f32::NAN; cols]);
    let flat: Vec<f32> = rows.concat();
    let x = f32s(&mut g, &[rows.len(), cols], &flat);
    let pos = i32s(&mut g, &[1], &[3]);
    for want_pos in [4, 5, 5] {
        let out = ops::argmax_step(&mut g, &x, None, &pos, 5).unwrap();
        assert_eq!(
            out.to_vec_i32(g.device()).unwrap(),
            vec![8999, 7, 150, 0, 0]
        );
        assert_eq!(pos.to_vec_i32(g.device()).unwrap(), vec![want_pos]);
    }
    // A bias moves the winners: it is added before the comparison.
    let mut bias_h = vec![0.0f32; cols];
    bias_h[3] = 10.0;
    bias_h[4000] = -1.0;
    let bias = f32s(&mut g, &[cols], &bias_h);
    let out = ops::argmax_step(&mut g, &x, Some(&bias), &pos, 5).unwrap();
    let want: Vec<i32> = rows
        .iter()
        .map(|r| {
            let mut best: Option<(usize, f32)> = None;
            for (j, v) in r.iter().zip(&bias_h).map(|(a, b)| a + b).enumerate() {
                if !v.is_nan() && best.is_none_or(|(_, bv)| v > bv) {
                    best = Some((j, v));
                }
            }
            best.map_or(0, |(j, _)| j as i32)
        })
        .collect();
    assert_eq!(want, vec![3, 3, 150, 0, 0]);
    assert_eq!(out.to_vec_i32(g.device()).unwrap(), want);
}
backend_test!(argmax_step);

fn add_norm<D: Backend>(dev: D) {
    let mut g = graft(dev);
    for (rows, dim) in [(3, 300), (2, 512), (1, 7), (2, 1500)] {
        let (x_h, a_h, b_h) = (
            values(rows * dim, 90),
            values(rows * dim, 91),
            values(dim, 92),
        );
        let gam_h: Vec<f32> = values(dim, 93).iter().map(|v| 1.0 + v).collect();
        let bet_h = values(dim, 94);
        let x = f32s(&mut g, &[rows, dim], &x_h);
        let a = f32s(&mut g, &[rows, dim], &a_h);
        let b = f32s(&mut g, &[dim], &b_h);
        let gam = f32s(&mut g, &[dim], &gam_h);
        let bet = f32s(&mut g, &[dim], &bet_h);
        for with_bias in [false, true] {
            let (xo, h) =
                ops::add_norm(&mut g, &x, &a, with_bias.then_some(&b), &gam, &bet, 1e-5).unwrap();
            let want_x: Vec<f32> = (0..rows * dim)
                .map(|i| x_h[i] + (a_h[i] + if with_bias { b_h[i % dim] } else { 0.0 }))
                .collect();
            assert_eq!(read(&g, &xo), want_x, "one rounding per add: exact");
            let want_h: Vec<f32> = want_x
                .chunks(dim)
                .flat_map(|r| host_layer_norm(r, &gam_h, &bet_h, 1e-5))
                .collect();
            assert_close(&read(&g, &h), &want_h, TOL * 10.0);
        }
    }
    let x = f32s(&mut g, &[2, 4], &[0.0; 8]);
    let a = f32s(&mut g, &[4, 2], &[0.0; 8]);
    let v = f32s(&mut g, &[4], &[0.0; 4]);
    assert!(matches!(
        ops::add_norm(&mut g, &x, &a, None, &v, &v, 1e-5),
        Err(TensorError::Shape { operand: "a", .. })
    ));
}
backend_test!(add_norm);
