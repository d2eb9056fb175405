//! The decoder against an independent host implementation in f64, written from the model's
//! definition and its named parameters: the tokens must agree step by step.

mod common;

use std::collections::HashMap;

use common::graft;
use graft_tensor::{Backend, Decoder, DecoderConfig, gelu_tanh};

struct Host {
    c: DecoderConfig,
    p: HashMap<String, Vec<f64>>,
    /// Per layer, per row: cached keys and values, `[pos][d]`.
    k: Vec<Vec<Vec<Vec<f64>>>>,
    v: Vec<Vec<Vec<Vec<f64>>>>,
}

fn layer_norm(x: &[f64], g: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    x.iter()
        .zip(g.iter().zip(b))
        .map(|(v, (g, b))| (v - mean) * inv * g + b)
        .collect()
}

fn linear(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let n = b.len();
    let mut out = b.to_vec();
    for (p, xv) in x.iter().enumerate() {
        for j in 0..n {
            out[j] += xv * w[p * n + j];
        }
    }
    out
}

impl Host {
    fn get(&self, name: &str) -> &[f64] {
        &self.p[name]
    }

    fn step(&mut self, row: usize, token: i32, pos: usize) -> i32 {
        let c = self.c;
        let d = c.d_model;
        let hd = c.head_dim();
        let mut x: Vec<f64> = (0..d)
            .map(|i| self.get("tok_emb")[token as usize * d + i] + self.get("pos_emb")[pos * d + i])
            .collect();
        for l in 0..c.layers {
            let n = |s: &str| format!("layers.{l}.{s}");
            let h = layer_norm(
                &x,
                self.get(&n("ln1.gamma")),
                self.get(&n("ln1.beta")),
                c.eps as f64,
            );
            // `wqkv` is `[d, 3d]`: q, k and v side by side.
            let qkv = linear(&h, self.get(&n("wqkv")), self.get(&n("bqkv")));
            let q = qkv[..d].to_vec();
            let k = qkv[d..2 * d].to_vec();
            let v = qkv[2 * d..].to_vec();
            self.k[l][row].push(k);
            self.v[l][row].push(v);
            let mut att = vec![0.0; d];
            for head in 0..c.heads {
                let r = head * hd..(head + 1) * hd;
                let scores: Vec<f64> = self.k[l][row]
                    .iter()
                    .map(|kj| {
                        q[r.clone()]
                            .iter()
                            .zip(&kj[r.clone()])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, vj) in self.v[l][row].iter().enumerate() {
                    for t in r.clone() {
                        att[t] += e[j] / sum * vj[t];
                    }
                }
            }
            let o = linear(&att, self.get(&n("wo")), self.get(&n("bo")));
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h2 = layer_norm(
                &x,
                self.get(&n("ln2.gamma")),
                self.get(&n("ln2.beta")),
                c.eps as f64,
            );
            let f: Vec<f64> = linear(&h2, self.get(&n("w1")), self.get(&n("b1")))
                .into_iter()
                .map(|v| gelu_tanh(v as f32) as f64)
                .collect();
            let f2 = linear(&f, self.get(&n("w2")), self.get(&n("b2")));
            x.iter_mut().zip(&f2).for_each(|(a, b)| *a += b);
        }
        let h = layer_norm(
            &x,
            self.get("lnf.gamma"),
            self.get("lnf.beta"),
            c.eps as f64,
        );
        let logits = linear(&h, self.get("lm_head.w"), self.get("lm_head.b"));
        let mut best = 0;
        for (j, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = j;
            }
        }
        best as i32
    }
}

fn decoder_matches_host_reference<D: Backend>(dev: D) {
    let mut g = graft(dev);
    let c = DecoderConfig::tiny();
    let dec = Decoder::new(&mut g, c, 7).unwrap();
    let p = dec
        .parameters()
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            let v = t.to_vec_f32(g.device()).unwrap();
            (name, v.into_iter().map(f64::from).collect())
        })
        .collect();
    let batch = 2;
    let mut host = Host {
        c,
        p,
        k: vec![vec![Vec::new(); batch]; c.layers],
        v: vec![vec![Vec::new(); batch]; c.layers],
    };
    let first = [1, 300];
    let mut state = dec.new_state(&mut g, batch).unwrap();
    let mut t = dec.tokens(&mut g, &first).unwrap();
    let mut host_tokens = first.to_vec();
    let mut all = Vec::new();
    for pos in 0..12 {
        t = dec.step_eager(&mut g, &mut state, &t).unwrap();
        let got = t.to_vec_i32(g.device()).unwrap();
        for (row, tok) in host_tokens.iter_mut().enumerate() {
            *tok = host.step(row, *tok, pos);
        }
        assert_eq!(got, host_tokens, "step {pos}");
        all.push(got);
    }
    eprintln!("tokens: {all:?}");
}
backend_test!(decoder_matches_host_reference);
