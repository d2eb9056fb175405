//! `route` and `Experts`: a mixture-of-experts MLP with its routing on the device. `route`
//! turns router logits into each token's top-k experts and their weights (softmax, the k
//! largest, optionally renormalized to sum to 1) in one launch; [`Experts::forward`] runs each
//! token through its chosen SiLU-gated experts and sums them by weight (gate, up and SwiGLU of
//! every chosen expert; the down projections with the weighted sum: two launches, three with
//! more choices than experts, where the kernels go expert-major), finding each expert's
//! weights through a device table of their addresses. Nothing is read back to
//! the host and the launches depend on shapes only, so one recording serves every routing.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor, WithDType,
};

use crate::cpu::float_dispatch;
use crate::{KernelError, check};

const ROUTE: &str = "route";
const EXPERTS: &str = "experts";

/// The most experts [`route`] chooses among (eight per lane of the routing kernel's warp).
pub const MAX_EXPERTS: usize = 256;

/// Each token's chosen experts and their weights, on the device: what [`route`] returns and
/// [`Experts::forward`] reads. Held as one `[tokens, 2, k]` f32 tensor (the weights, then the
/// expert indices as exact small floats), so one launch makes both.
#[derive(Debug, Clone)]
pub struct Routing {
    packed: Tensor,
}

impl Routing {
    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.packed.dims().last().copied().unwrap_or(0)
    }

    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.packed.dims().first().copied().unwrap_or(0)
    }

    /// The weights `[tokens, k]` f32, the largest first.
    pub fn weights(&self) -> Result<Tensor> {
        self.packed.narrow(1, 0, 1)?.squeeze(1)?.contiguous()
    }

    /// The chosen experts `[tokens, k]` u32, in the order of [`Routing::weights`].
    pub fn experts(&self) -> Result<Tensor> {
        self.packed
            .narrow(1, 1, 1)?
            .squeeze(1)?
            .to_dtype(DType::U32)
    }
}

/// Each row's `top_k` experts of `logits` (`[tokens, experts]`, f32, bf16 or f16, contiguous;
/// at most [`MAX_EXPERTS`] experts): the softmax of the row in f32, its `top_k` largest
/// probabilities (the lower expert first among equals, as a stable sort), divided by their
/// sum when `normalize` (Mixtral; Qwen3-MoE's `norm_topk_prob`).
pub fn route(logits: &Tensor, top_k: usize, normalize: bool) -> Result<Routing> {
    check::float(ROUTE, "logits", logits)?;
    let &[tokens, experts] = logits.dims() else {
        return Err(check::shape(ROUTE, "logits", logits, "[tokens, experts]"));
    };
    if experts == 0 || experts > MAX_EXPERTS || top_k == 0 || top_k > experts {
        return Err(KernelError::Experts {
            experts,
            top_k,
            max: MAX_EXPERTS,
        }
        .into());
    }
    check::contiguous(ROUTE, "logits", logits)?;
    check::u32_of(ROUTE, "the token count", tokens)?;
    let packed = if tokens == 0 {
        Tensor::zeros((0, 2, top_k), DType::F32, logits.device())?
    } else {
        logits.apply_op1_no_bwd(&Route {
            experts,
            top_k,
            normalize,
        })?
    };
    Ok(Routing { packed })
}

/// The routing op: `[tokens, 2, k]` f32 from `[tokens, experts]`.
struct Route {
    experts: usize,
    top_k: usize,
    normalize: bool,
}

impl Route {
    fn out_shape(&self, tokens: usize) -> Shape {
        Shape::from_dims(&[tokens, 2, self.top_k])
    }

    /// One row: the softmax, the k largest by a stable sort (lower index first among equals),
    /// renormalized; written as the k weights then the k indices.
    fn cpu<T: WithDType>(&self, logits: &[T], l: &Layout) -> Result<Vec<f32>> {
        let x = check::cpu_slice(ROUTE, "logits", logits, l)?;
        let k = self.top_k;
        let mut out = Vec::with_capacity(x.len() / self.experts * 2 * k);
        for row in x.chunks_exact(self.experts) {
            let row: Vec<f32> = row.iter().map(|&v| check::f32_of(v)).collect();
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = row.iter().map(|&v| (v - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            let p: Vec<f32> = exp.iter().map(|&e| e / sum).collect();
            let mut order: Vec<usize> = (0..p.len()).collect();
            order.sort_by(|&i, &j| p[j].total_cmp(&p[i]));
            let top = &order[..k];
            let total: f32 = top.iter().map(|&i| p[i]).sum();
            let scale = if self.normalize { total } else { 1.0 };
            out.extend(top.iter().map(|&i| p[i] / scale));
            out.extend(top.iter().map(|&i| i as f32));
        }
        Ok(out)
    }
}

impl CustomOp1 for Route {
    fn name(&self) -> &'static str {
        ROUTE
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_dispatch!(ROUTE, "logits", (s), |x| self.cpu(x, l))?;
        let tokens = out.len() / (2 * self.top_k);
        Ok((CpuStorage::F32(out), self.out_shape(tokens)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::route(self, s, l)
    }
}

fn unsupported(op: &'static str, input: &'static str, got: DType) -> candle_core::Error {
    KernelError::UnsupportedDType { op, input, got }.into()
}

/// The experts of one mixture-of-experts MLP: expert e is `down[e] · (silu(gate[e] · x) *
/// (up[e] · x))`. The weights are held (clones: the same storage), never copied or stacked;
/// on CUDA a device table of their addresses, made once here, lets the kernels find the
/// experts a routing chose.
#[derive(Debug, Clone)]
pub struct Experts {
    gate: Vec<Tensor>,
    up: Vec<Tensor>,
    down: Vec<Tensor>,
    hidden: usize,
    intermediate: usize,
    /// Where the CUDA kernels find the weights (for experts on a CUDA device).
    #[cfg(feature = "cuda")]
    table: Option<cuda::Table>,
}

impl Experts {
    /// Experts from their weights: `gate[e]` and `up[e]` `[intermediate, hidden]`, `down[e]`
    /// `[hidden, intermediate]`, all contiguous, of one float dtype and device; 1 to
    /// [`MAX_EXPERTS`] experts.
    pub fn new(gate: Vec<Tensor>, up: Vec<Tensor>, down: Vec<Tensor>) -> Result<Experts> {
        let n = gate.len();
        if n == 0 || n > MAX_EXPERTS || up.len() != n || down.len() != n {
            return Err(KernelError::ExpertWeights {
                gate: n,
                up: up.len(),
                down: down.len(),
                max: MAX_EXPERTS,
            }
            .into());
        }
        let first = &gate[0];
        check::float(EXPERTS, "gate", first)?;
        let &[intermediate, hidden] = first.dims() else {
            return Err(check::shape(
                EXPERTS,
                "gate",
                first,
                "[intermediate, hidden]",
            ));
        };
        for (input, all, dims) in [
            ("gate", &gate, [intermediate, hidden]),
            ("up", &up, [intermediate, hidden]),
            ("down", &down, [hidden, intermediate]),
        ] {
            for w in all {
                check::like(EXPERTS, input, w, "gate", first)?;
                if w.dims() != dims {
                    return Err(check::shape(
                        EXPERTS,
                        input,
                        w,
                        "gate and up [intermediate, hidden], down [hidden, intermediate], alike for every expert",
                    ));
                }
                check::contiguous(EXPERTS, input, w)?;
            }
        }
        check::u32_of(EXPERTS, "the hidden size", hidden)?;
        check::u32_of(EXPERTS, "the intermediate size", intermediate)?;
        #[cfg(feature = "cuda")]
        let table = match first.device() {
            candle_core::Device::Cuda(device) => Some(cuda::table([&gate, &up, &down], device)?),
            _ => None,
        };
        Ok(Experts {
            gate,
            up,
            down,
            hidden,
            intermediate,
            #[cfg(feature = "cuda")]
            table,
        })
    }

    /// How many experts.
    pub fn len(&self) -> usize {
        self.gate.len()
    }

    /// Never: an `Experts` has at least one expert.
    pub fn is_empty(&self) -> bool {
        self.gate.is_empty()
    }

    /// The width of a token (each expert's input and output).
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The width of an expert's gate and up projections.
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }

    /// Every tensor the experts read in place (the weights and, on CUDA, the address table):
    /// the statics of a step that runs them.
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        let weights = self.gate.iter().chain(&self.up).chain(&self.down);
        #[cfg(feature = "cuda")]
        let weights = weights.chain(self.table.as_ref().map(|t| &t.addresses));
        weights
    }

    /// Each token of `x` (`[..., hidden]`, contiguous, the experts' dtype and device) through
    /// the experts `routing` chose for it, summed by the routing's weights: `x`'s shape. Every
    /// sum is f32; an expert's SwiGLU output is rounded to the dtype before its down
    /// projection, as the unfused expert rounds it.
    pub fn forward(&self, x: &Tensor, routing: &Routing) -> Result<Tensor> {
        check::like(EXPERTS, "x", x, "the experts' weights", &self.gate[0])?;
        if x.dims().last() != Some(&self.hidden) {
            return Err(check::shape(EXPERTS, "x", x, "[..., hidden]"));
        }
        check::contiguous(EXPERTS, "x", x)?;
        let tokens = x.elem_count() / self.hidden;
        if routing.tokens() != tokens {
            return Err(check::shape(
                EXPERTS,
                "routing",
                &routing.packed,
                "one routed row per token of x",
            ));
        }
        if !routing.packed.device().same_device(x.device()) {
            return Err(KernelError::Device {
                op: EXPERTS,
                input: "routing",
            }
            .into());
        }
        if tokens == 0 {
            return x.zeros_like();
        }
        let op = ExpertsOp {
            experts: self,
            top_k: routing.top_k(),
        };
        x.reshape((tokens, self.hidden))?
            .apply_op2_no_bwd(&routing.packed, &op)?
            .reshape(x.shape())
    }
}

/// The experts op over `x` `[tokens, hidden]` and the packed routing: `[tokens, hidden]`.
struct ExpertsOp<'a> {
    experts: &'a Experts,
    top_k: usize,
}

impl ExpertsOp<'_> {
    /// Every token through its experts, in f32, the SwiGLU output rounded to `T` first.
    fn cpu<T: WithDType>(&self, x: &[T], xl: &Layout, r: &[f32], rl: &Layout) -> Result<Vec<T>> {
        let x = check::cpu_slice(EXPERTS, "x", x, xl)?;
        let r = check::cpu_slice(EXPERTS, "routing", r, rl)?;
        let e = self.experts;
        let (d, f, k) = (e.hidden, e.intermediate, self.top_k);
        let guards: Vec<_> = (e.gate.iter().chain(&e.up).chain(&e.down))
            .map(Tensor::storage_and_layout)
            .collect();
        let weights = guards
            .iter()
            .map(|(s, l)| in_place::<T>(s, l))
            .collect::<Result<Vec<_>>>()?;
        let n = e.len();
        let (gate, rest) = weights.split_at(n);
        let (up, down) = rest.split_at(n);
        let dot = |w: &[T], v: &[f32]| -> f32 {
            w.iter().zip(v).map(|(&a, &b)| check::f32_of(a) * b).sum()
        };
        let mut out = Vec::with_capacity(x.len());
        let mut h = vec![0f32; f];
        for (t, xt) in x.chunks_exact(d).enumerate() {
            let xt: Vec<f32> = xt.iter().map(|&v| check::f32_of(v)).collect();
            let mut y = vec![0f32; d];
            for j in 0..k {
                let w = r[t * 2 * k + j];
                // The index is an exact small float (made by `route`); clamped like the kernel.
                let ex = (r[t * 2 * k + k + j] as usize).min(n - 1);
                for (i, hi) in h.iter_mut().enumerate() {
                    let g = dot(&gate[ex][i * d..][..d], &xt);
                    let u = dot(&up[ex][i * d..][..d], &xt);
                    *hi = check::f32_of(T::from_f64(f64::from(g / (1.0 + (-g).exp()) * u)));
                }
                for (o, yo) in y.iter_mut().enumerate() {
                    *yo += w * dot(&down[ex][o * f..][..f], &h);
                }
            }
            out.extend(y.iter().map(|&v| T::from_f64(f64::from(v))));
        }
        Ok(out)
    }
}

impl CustomOp2 for ExpertsOp<'_> {
    fn name(&self) -> &'static str {
        EXPERTS
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        r: &CpuStorage,
        rl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(r) = r else {
            return Err(unsupported(EXPERTS, "routing", r.dtype()));
        };
        let out = float_dispatch!(EXPERTS, "x", (x), |x| {
            self.cpu(x, xl, r, rl).map(WithDType::to_cpu_storage_owned)
        })?;
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        r: &candle_core::CudaStorage,
        rl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::experts(self, x, xl, r, rl)
    }
}

/// A CPU weight's elements in place, as `T`.
fn in_place<'a, T: WithDType>(storage: &'a Storage, layout: &Layout) -> Result<&'a [T]> {
    match storage {
        Storage::Cpu(c) => {
            check::cpu_slice(EXPERTS, "weights", T::cpu_storage_as_slice(c)?, layout)
        }
        _ => Err(KernelError::Device {
            op: EXPERTS,
            input: "weights",
        }
        .into()),
    }
}
