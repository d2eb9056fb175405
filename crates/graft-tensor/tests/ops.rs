//! Each tensor op against a plain Rust reference, on the simulator and (ignored without a GPU)
//! on CUDA, with the same test body; and ops recorded inside a graft body replay on the
//! memory's current values.

mod common;

use common::{assert_close, f32s, graft, i32s, read, values};
use graft_core::{BodyError, DeviceError, FunctionSpec, Output};
use graft_tensor::{Backend, DType, Meta, Tensor, TensorError, gelu_tanh, ops};

const TOL: f32 = 1e-5;

fn add<D: Backend>(dev: D) {
    let kernels = dev.load_ops().unwrap();
    let mut g = graft(dev);
    let n = 1000;
    let (a_h, b_h) = (values(n, 4), values(n, 5));
    let a = f32s(&mut g, &[10, 100], &a_h);
    let b = f32s(&mut g, &[10, 100], &b_h);
    let out = ops::add(&kernels, &mut g, &a, &b).unwrap();
    let want: Vec<f32> = a_h.iter().zip(&b_h).map(|(x, y)| x + y).collect();
    assert_eq!(read(&g, &out), want);
    let wrong = f32s(&mut g, &[100, 10], &b_h);
    assert!(matches!(
        ops::add(&kernels, &mut g, &a, &wrong),
        Err(TensorError::Shape { op: "add", .. })
    ));
}
backend_test!(add);

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

/// The first index of each row's maximum.
fn host_argmax(v: &[f32], cols: usize) -> Vec<i32> {
    v.chunks(cols)
        .map(|row| {
            let mut best = 0;
            for (j, x) in row.iter().enumerate() {
                if *x > row[best] {
                    best = j;
                }
            }
            best as i32
        })
        .collect()
}

/// A body of several ops, registered with graft: the warmup, the recording and every replay
/// compute on the inputs and position of their own call (kernels read memory when they run).
fn ops_replay_on_current_memory<D: Backend>(dev: D) {
    let kernels = dev.load_ops().unwrap();
    let mut g = graft(dev);
    let fid = g.register("block", FunctionSpec::inference([1, 2]));
    let (rows, k_dim, n) = (2, 8, 6);
    let w_h = values(k_dim * n, 20);
    let w = f32s(&mut g, &[k_dim, n], &w_h);
    w.buffer().mark_static();
    let pos = i32s(&mut g, &[1], &[0]);
    pos.buffer().mark_static();
    for step in 0..5u32 {
        let x_h = values(rows * k_dim, 100 + step);
        let x = f32s(&mut g, &[rows, k_dim], &x_h);
        let outs = g
            .call(
                fid,
                &[x.buffer(), w.buffer(), pos.buffer()],
                &[],
                |ctx| -> Result<Vec<Output<Meta>>, BodyError> {
                    let ins = ctx.inputs();
                    let x = Tensor::from_buffer(ins[0].clone(), &[rows, k_dim], DType::F32)?;
                    let w = Tensor::from_buffer(ins[1].clone(), &[k_dim, n], DType::F32)?;
                    let pos = Tensor::from_buffer(ins[2].clone(), &[1], DType::I32)?;
                    let y = ops::linear(&kernels, ctx, &x, &w, None, None, true)?;
                    let top = ops::argmax_step(&kernels, ctx, &y, None, &pos, 100)?;
                    Ok(vec![y.into_output(), top.into_output()])
                },
            )
            .unwrap();
        let mut outs = outs.into_iter().map(|o| Tensor::from_output(o).unwrap());
        let (y, top) = (outs.next().unwrap(), outs.next().unwrap());
        let want: Vec<f32> = host_matmul(&x_h, &w_h, None, rows, k_dim, n)
            .into_iter()
            .map(gelu_tanh)
            .collect();
        let got = read(&g, &y);
        assert_close(&got, &want, 1e-4);
        assert_eq!(top.to_vec_i32(g.device()).unwrap(), host_argmax(&got, n));
        assert_eq!(pos.to_vec_i32(g.device()).unwrap(), vec![step as i32 + 1]);
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
    let kernels = dev.load_ops().unwrap();
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
            let out = ops::linear(
                &kernels,
                &mut g,
                &x,
                &w,
                bias.then_some(&b),
                res.then_some(&r),
                act,
            )
            .unwrap();
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
        ops::linear(&kernels, &mut g, &x, &w, None, Some(&x), false),
        Err(TensorError::Shape {
            operand: "residual",
            ..
        })
    ));
}
backend_test!(linear);

fn embed_norm<D: Backend>(dev: D) {
    let kernels = dev.load_ops().unwrap();
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
            let (x, h) = ops::embed_norm(
                &kernels, &mut g, &ids, &table, &ptab, &pos, &gam, &bet, 1e-5,
            )
            .unwrap();
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
    let kernels = dev.load_ops().unwrap();
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
                &kernels,
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
    let kernels = dev.load_ops().unwrap();
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
        let out = ops::argmax_step(&kernels, &mut g, &x, None, &pos, 5).unwrap();
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
    let out = ops::argmax_step(&kernels, &mut g, &x, Some(&bias), &pos, 5).unwrap();
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
    let kernels = dev.load_ops().unwrap();
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
            let (xo, h) = ops::add_norm(
                &kernels,
                &mut g,
                &x,
                &a,
                with_bias.then_some(&b),
                &gam,
                &bet,
                1e-5,
            )
            .unwrap();
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
        ops::add_norm(&kernels, &mut g, &x, &a, None, &v, &v, 1e-5),
        Err(TensorError::Shape { operand: "a", .. })
    ));
}
backend_test!(add_norm);

/// The kernels belong to the value that loaded them: once it, the runtime and the tensors are
/// dropped, nothing holds the device any more (a process-wide module cache would).
#[test]
#[ignore = "needs a CUDA GPU"]
fn dropping_the_kernels_releases_the_device() {
    let dev = graft_cuda::CudaDevice::new(0).expect("a CUDA GPU is required for the ignored tests");
    {
        let kernels = dev.load_ops().unwrap();
        let mut g = graft(dev.clone());
        let (a_h, b_h) = (values(256, 1), values(256, 2));
        let a = f32s(&mut g, &[256], &a_h);
        let b = f32s(&mut g, &[256], &b_h);
        let out = ops::add(&kernels, &mut g, &a, &b).unwrap();
        let want: Vec<f32> = a_h.iter().zip(&b_h).map(|(x, y)| x + y).collect();
        assert_eq!(read(&g, &out), want);
        assert!(
            dev.handle_count() > 1,
            "the kernels and the runtime hold the device"
        );
    }
    assert_eq!(
        dev.handle_count(),
        2,
        "after dropping the kernels and the runtime, only this device (its two queues) holds it"
    );
}

/// Operands are checked before any kernel sees them: one whose memory graft freed is refused
/// with the buffer's error.
fn freed_operands_are_refused<D: Backend>(dev: D) {
    let kernels = dev.load_ops().unwrap();
    let mut g = graft(dev.clone());
    let a = f32s(&mut g, &[4], &[1.0; 4]);
    let mut closed = graft(dev);
    let b = f32s(&mut closed, &[4], &[2.0; 4]);
    closed.close().unwrap();
    assert!(matches!(
        ops::add(&kernels, &mut g, &a, &b),
        Err(TensorError::Device(DeviceError::InvalidBuffer { .. }))
    ));
}
backend_test!(freed_operands_are_refused);

/// A tensor of another device is refused before any kernel sees it.
#[test]
fn operands_of_another_device_are_refused() {
    let dev = graft_sim::SimDevice::new();
    let kernels = dev.load_ops().unwrap();
    let mut g = graft(dev);
    let mut elsewhere = graft(graft_sim::SimDevice::new());
    let a = f32s(&mut g, &[4], &[1.0; 4]);
    let b = f32s(&mut elsewhere, &[4], &[2.0; 4]);
    assert!(matches!(
        ops::add(&kernels, &mut g, &a, &b),
        Err(TensorError::Device(DeviceError::InvalidArgument { .. }))
    ));
}
