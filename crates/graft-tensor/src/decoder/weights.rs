//! The decoder's parameters: where each sits in the weight arena ([`Layout`]), how each is
//! made and split over tensor-parallel ranks ([`layout_of`], [`shard_host`]), and the views
//! of one arena ([`Weights`]).

use super::config::DecoderConfig;
use crate::error::{Result, TensorError};
use crate::tensor::Tensor;

/// Where each parameter sits in the weight arena (element offsets, 64-element aligned).
#[derive(Clone, Debug, Default)]
pub(super) struct Layout {
    pub(super) entries: Vec<(usize, Vec<usize>)>,
    pub(super) names: Vec<String>,
    pub(super) total: usize,
}

impl Layout {
    pub(super) fn push(&mut self, name: String, shape: &[usize]) {
        let at = self.total.next_multiple_of(64);
        self.total = at + shape.iter().product::<usize>();
        self.entries.push((at, shape.to_vec()));
        self.names.push(name);
    }
}

/// One block's parameters (views into the arena). Matrices are `[in, out]`.
#[derive(Clone, Debug)]
pub(super) struct LayerWeights {
    pub(super) ln1_g: Tensor,
    pub(super) ln1_b: Tensor,
    /// `[d, 3d]`: the q, k and v projections side by side.
    pub(super) wqkv: Tensor,
    pub(super) bqkv: Tensor,
    pub(super) wo: Tensor,
    pub(super) bo: Tensor,
    pub(super) ln2_g: Tensor,
    pub(super) ln2_b: Tensor,
    pub(super) w1: Tensor,
    pub(super) b1: Tensor,
    pub(super) w2: Tensor,
    pub(super) b2: Tensor,
}

/// Every parameter, as views into one arena.
#[derive(Clone, Debug)]
pub(super) struct Weights {
    pub(super) tok_emb: Tensor,
    pub(super) pos_emb: Tensor,
    pub(super) layers: Vec<LayerWeights>,
    pub(super) lnf_g: Tensor,
    pub(super) lnf_b: Tensor,
    pub(super) lm_w: Tensor,
    pub(super) lm_b: Tensor,
}

/// How each parameter is initialised.
#[derive(Clone, Copy)]
pub(super) enum Init {
    Ones,
    Zeros,
    Uniform(f32),
}

/// How a tensor-parallel rank holds a parameter (Megatron's split): whole, its share of the
/// columns of each of `n` side-by-side groups (q, k and v; the MLP's first layer), or its
/// share of the rows (the products whose partial sums the all-reduce adds up).
#[derive(Clone, Copy)]
pub(super) enum Split {
    Whole,
    Columns(usize),
    Rows,
}

/// The parameters of the whole model, in arena order, with how each is made and split.
pub(super) fn layout_of(c: &DecoderConfig) -> (Layout, Vec<(Init, Split)>) {
    let mut l = Layout::default();
    let mut init = Vec::new();
    let (d, f) = (c.d_model, c.ffn);
    let mut add = |l: &mut Layout, name: String, shape: &[usize], i: Init, split: Split| {
        l.push(name, shape);
        init.push((i, split));
    };
    let lin = |fan_in: usize| Init::Uniform(1.0 / (fan_in as f32).sqrt());
    let bias = Init::Uniform(0.02);
    let (whole, qkv, cols, rows) = (
        Split::Whole,
        Split::Columns(3),
        Split::Columns(1),
        Split::Rows,
    );
    add(
        &mut l,
        "tok_emb".into(),
        &[c.vocab, d],
        Init::Uniform(0.5),
        whole,
    );
    add(
        &mut l,
        "pos_emb".into(),
        &[c.ctx, d],
        Init::Uniform(0.5),
        whole,
    );
    for i in 0..c.layers {
        let p = |n: &str| format!("layers.{i}.{n}");
        add(&mut l, p("ln1.gamma"), &[d], Init::Ones, whole);
        add(&mut l, p("ln1.beta"), &[d], Init::Zeros, whole);
        add(&mut l, p("wqkv"), &[d, 3 * d], lin(d), qkv);
        add(&mut l, p("bqkv"), &[3 * d], bias, qkv);
        add(&mut l, p("wo"), &[d, d], lin(d), rows);
        add(&mut l, p("bo"), &[d], bias, whole);
        add(&mut l, p("ln2.gamma"), &[d], Init::Ones, whole);
        add(&mut l, p("ln2.beta"), &[d], Init::Zeros, whole);
        add(&mut l, p("w1"), &[d, f], lin(d), cols);
        add(&mut l, p("b1"), &[f], bias, cols);
        add(&mut l, p("w2"), &[f, d], lin(f), rows);
        add(&mut l, p("b2"), &[d], bias, whole);
    }
    add(&mut l, "lnf.gamma".into(), &[d], Init::Ones, whole);
    add(&mut l, "lnf.beta".into(), &[d], Init::Zeros, whole);
    add(&mut l, "lm_head.w".into(), &[d, c.vocab], lin(d), whole);
    add(&mut l, "lm_head.b".into(), &[c.vocab], bias, whole);
    (l, init)
}

/// Rank `rank`'s share (of `world`) of the whole model's parameters `host` laid out by
/// `layout`: its own layout and values.
pub(super) fn shard_host(
    layout: &Layout,
    splits: &[(Init, Split)],
    host: &[f32],
    rank: usize,
    world: usize,
) -> (Layout, Vec<f32>) {
    let mut local = Layout::default();
    let mut parts: Vec<Vec<f32>> = Vec::with_capacity(splits.len());
    for ((name, (at, shape)), (_, split)) in layout.names.iter().zip(&layout.entries).zip(splits) {
        let whole = &host[*at..at + shape.iter().product::<usize>()];
        let n = *shape.last().unwrap_or(&1);
        let (values, shape) = match *split {
            Split::Whole => (whole.to_vec(), shape.clone()),
            Split::Columns(groups) => {
                let share = n / groups / world;
                let mut v = Vec::with_capacity(whole.len() / world);
                for row in whole.chunks(n) {
                    for group in row.chunks(n / groups) {
                        v.extend_from_slice(&group[rank * share..(rank + 1) * share]);
                    }
                }
                let mut shape = shape.clone();
                *shape.last_mut().unwrap_or(&mut 0) = groups * share;
                (v, shape)
            }
            Split::Rows => {
                let rows = shape[0] / world;
                let v = whole[rank * rows * n..(rank + 1) * rows * n].to_vec();
                (v, vec![rows, n])
            }
        };
        local.push(name.clone(), &shape);
        parts.push(values);
    }
    let mut values = vec![0.0f32; local.total];
    for ((at, _), part) in local.entries.iter().zip(parts) {
        values[*at..at + part.len()].copy_from_slice(&part);
    }
    (local, values)
}

impl Weights {
    /// Views of `layout` into `arena`, in the order `layout_of` pushed them.
    pub(super) fn views(arena: &Tensor, layout: &Layout, layers: usize) -> Result<Weights> {
        let mut it = layout.entries.iter();
        let mut next = || -> Result<Tensor> {
            let (at, shape) = it.next().ok_or(TensorError::Config {
                what: "the weight layout has fewer entries than the model",
            })?;
            arena.view(*at, shape)
        };
        let tok_emb = next()?;
        let pos_emb = next()?;
        let mut ls = Vec::with_capacity(layers);
        for _ in 0..layers {
            ls.push(LayerWeights {
                ln1_g: next()?,
                ln1_b: next()?,
                wqkv: next()?,
                bqkv: next()?,
                wo: next()?,
                bo: next()?,
                ln2_g: next()?,
                ln2_b: next()?,
                w1: next()?,
                b1: next()?,
                w2: next()?,
                b2: next()?,
            });
        }
        Ok(Weights {
            tok_emb,
            pos_emb,
            layers: ls,
            lnf_g: next()?,
            lnf_b: next()?,
            lm_w: next()?,
            lm_b: next()?,
        })
    }
}
