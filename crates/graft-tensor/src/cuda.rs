//! [`Ops`] on CUDA: the kernels of `kernels.cu`, compiled with NVRTC once per device and
//! launched through graft-cuda's checked launch API (no `unsafe` here), and matrix products
//! through graft-cuda's cuBLAS `sgemm` (plus an epilogue kernel when the product itself must
//! add a bias, a GELU or a residual; the decoder passes its biases to the kernel after the
//! product instead). cuBLAS beat a hand-written few-rows kernel with the epilogue fused at
//! every batch size of the benchmark decoder inside a CUDA graph (H200, 2026-11-21), so there
//! is none.
//!
//! Modules are kept in a process-wide registry keyed by device, with a per-thread cache of
//! the last one looked up, so a launch costs a comparison, not a lock. A device's module stays
//! loaded (and keeps the device alive) until the process exits.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};

use graft_core::{DeviceError, DeviceId, DevicePtr};
use graft_cuda::{CudaModule, CudaQueue, KernelArg, Sgemm};

use crate::backend::{
    AddNormArgs, AttnDims, CacheDims, EmbedDims, EmbedNormArgs, GatherDims, LinearArgs, MatmulDims,
    NormDims, Ops, PositionDims, SoftmaxDims,
};

/// CUDA C++ source of the kernels.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// The kernels, in the order of their indices in the loaded module.
pub const KERNEL_NAMES: [&str; 16] = [
    "gt_embedding",
    "gt_add_position",
    "gt_add",
    "gt_layer_norm",
    "gt_gelu",
    "gt_masked_softmax",
    "gt_attention_scores",
    "gt_attention_values",
    "gt_kv_write",
    "gt_argmax",
    "gt_increment",
    "gt_embed_norm",
    "gt_epilogue",
    "gt_attention_step",
    "gt_argmax_step",
    "gt_add_norm",
];

const EMBEDDING: usize = 0;
const ADD_POSITION: usize = 1;
const ADD: usize = 2;
const LAYER_NORM: usize = 3;
const GELU: usize = 4;
const MASKED_SOFTMAX: usize = 5;
const ATTENTION_SCORES: usize = 6;
const ATTENTION_VALUES: usize = 7;
const KV_WRITE: usize = 8;
const ARGMAX: usize = 9;
const INCREMENT: usize = 10;
const EMBED_NORM: usize = 11;
const EPILOGUE: usize = 12;
const ATTENTION_STEP: usize = 13;
const ARGMAX_STEP: usize = 14;
const ADD_NORM: usize = 15;

/// Threads per block of `gt_argmax_step`.
const ARGMAX_BLOCK: u32 = 1024;

/// Threads per block (the reductions in `kernels.cu` assume exactly this).
const BLOCK: u32 = 256;
/// Most blocks of a grid-stride launch.
const MAX_BLOCKS: usize = 4096;

type Registry = Mutex<Vec<(DeviceId, Arc<CudaModule>)>>;
static MODULES: Registry = Mutex::new(Vec::new());

thread_local! {
    static LAST: RefCell<Option<(DeviceId, Arc<CudaModule>)>> = const { RefCell::new(None) };
}

/// This device's kernel module, compiling and loading it on first use (and creating the
/// cuBLAS handle then too, outside any capture).
fn module(dev: &CudaQueue) -> Result<Arc<CudaModule>, DeviceError> {
    let id = dev.device_id();
    let hit = LAST.with(|l| match &*l.borrow() {
        Some((last, m)) if *last == id => Some(Arc::clone(m)),
        _ => None,
    });
    if let Some(m) = hit {
        return Ok(m);
    }
    let mut reg = MODULES.lock().unwrap_or_else(PoisonError::into_inner);
    let m = match reg.iter().find(|(d, _)| *d == id) {
        Some((_, m)) => Arc::clone(m),
        None => {
            dev.init_cublas()?;
            let m = Arc::new(dev.load_module(KERNELS_CU, &KERNEL_NAMES)?);
            reg.push((id, Arc::clone(&m)));
            m
        }
    };
    drop(reg);
    LAST.with(|l| *l.borrow_mut() = Some((id, Arc::clone(&m))));
    Ok(m)
}

fn u32_of(x: usize) -> Result<u32, DeviceError> {
    u32::try_from(x).map_err(|_| invalid("a tensor dimension exceeds u32::MAX"))
}

fn ptr(p: DevicePtr) -> KernelArg {
    KernelArg::Ptr(p)
}

/// Launches `kernel` with one block per row (`rows` blocks of [`BLOCK`] threads).
fn per_row(
    dev: &CudaQueue,
    kernel: usize,
    rows: usize,
    args: &[KernelArg],
) -> Result<(), DeviceError> {
    if rows == 0 {
        return Ok(());
    }
    let m = module(dev)?;
    dev.launch_function(&m, kernel, (u32_of(rows)?, 1, 1), (BLOCK, 1, 1), 0, args)
}

/// Launches a grid-stride `kernel` over `n` elements.
fn strided(
    dev: &CudaQueue,
    kernel: usize,
    n: usize,
    args: &[KernelArg],
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    let m = module(dev)?;
    let blocks = n.div_ceil(BLOCK as usize).min(MAX_BLOCKS) as u32;
    dev.launch_function(&m, kernel, (blocks, 1, 1), (BLOCK, 1, 1), 0, args)
}

fn invalid(what: &'static str) -> DeviceError {
    DeviceError::InvalidArgument {
        op: graft_core::DeviceOp::KernelLaunch,
        what,
    }
}

fn opt(p: Option<DevicePtr>) -> KernelArg {
    KernelArg::Ptr(p.unwrap_or(DevicePtr(0)))
}

impl Ops for CudaQueue {
    fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        CudaQueue::write(self, dst, src)
    }

    fn prepare(&self) -> Result<(), DeviceError> {
        module(self).map(|_| ())
    }

    fn embedding(
        &self,
        out: DevicePtr,
        ids: DevicePtr,
        table: DevicePtr,
        d: GatherDims,
    ) -> Result<(), DeviceError> {
        per_row(
            self,
            EMBEDDING,
            d.rows,
            &[
                ptr(out),
                ptr(ids),
                ptr(table),
                KernelArg::U32(u32_of(d.vocab)?),
                KernelArg::U32(u32_of(d.dim)?),
            ],
        )
    }

    fn add_position(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        table: DevicePtr,
        pos: DevicePtr,
        d: PositionDims,
    ) -> Result<(), DeviceError> {
        if d.ctx == 0 {
            return Ok(());
        }
        per_row(
            self,
            ADD_POSITION,
            d.rows,
            &[
                ptr(out),
                ptr(x),
                ptr(table),
                ptr(pos),
                KernelArg::U32(u32_of(d.ctx)?),
                KernelArg::U32(u32_of(d.dim)?),
            ],
        )
    }

    fn add(&self, out: DevicePtr, a: DevicePtr, b: DevicePtr, n: usize) -> Result<(), DeviceError> {
        strided(
            self,
            ADD,
            n,
            &[ptr(out), ptr(a), ptr(b), KernelArg::U64(n as u64)],
        )
    }

    fn layer_norm(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        gamma: DevicePtr,
        beta: DevicePtr,
        d: NormDims,
    ) -> Result<(), DeviceError> {
        if d.dim == 0 {
            return Ok(());
        }
        per_row(
            self,
            LAYER_NORM,
            d.rows,
            &[
                ptr(out),
                ptr(x),
                ptr(gamma),
                ptr(beta),
                KernelArg::U32(u32_of(d.dim)?),
                KernelArg::F32(d.eps),
            ],
        )
    }

    fn linear(&self, a: LinearArgs, d: MatmulDims) -> Result<(), DeviceError> {
        if d.rows == 0 || d.n == 0 {
            return Ok(());
        }
        // Loads the module and creates the cuBLAS handle if this is the first op.
        module(self)?;
        let gelu = KernelArg::I32(i32::from(a.gelu));
        self.sgemm(&Sgemm {
            m: d.rows,
            n: d.n,
            k: d.k,
            a: a.x,
            b: a.w,
            c: a.out,
            b_transposed: false,
            alpha: 1.0,
            beta: 0.0,
        })?;
        if a.bias.is_some() || a.residual.is_some() || a.gelu {
            let n = d.rows * d.n;
            strided(
                self,
                EPILOGUE,
                n,
                &[
                    ptr(a.out),
                    opt(a.bias),
                    opt(a.residual),
                    KernelArg::U64(n as u64),
                    KernelArg::U32(u32_of(d.n)?),
                    gelu,
                ],
            )?;
        }
        Ok(())
    }

    fn embed_norm(&self, a: EmbedNormArgs, d: EmbedDims) -> Result<(), DeviceError> {
        if d.ctx == 0 || d.dim == 0 {
            return Ok(());
        }
        per_row(
            self,
            EMBED_NORM,
            d.rows,
            &[
                ptr(a.x),
                ptr(a.h),
                ptr(a.ids),
                ptr(a.table),
                ptr(a.pos_table),
                ptr(a.pos),
                ptr(a.gamma),
                ptr(a.beta),
                KernelArg::U32(u32_of(d.vocab)?),
                KernelArg::U32(u32_of(d.ctx)?),
                KernelArg::U32(u32_of(d.dim)?),
                KernelArg::F32(d.eps),
            ],
        )
    }

    fn add_norm(&self, a: AddNormArgs, d: NormDims) -> Result<(), DeviceError> {
        if d.dim == 0 {
            return Ok(());
        }
        per_row(
            self,
            ADD_NORM,
            d.rows,
            &[
                ptr(a.x_out),
                ptr(a.h),
                ptr(a.x),
                ptr(a.a),
                opt(a.bias),
                ptr(a.gamma),
                ptr(a.beta),
                KernelArg::U32(u32_of(d.dim)?),
                KernelArg::F32(d.eps),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_step(
        &self,
        out: DevicePtr,
        qkv: DevicePtr,
        bias: Option<DevicePtr>,
        k_cache: DevicePtr,
        v_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError> {
        if d.ctx == 0 || d.head_dim == 0 {
            return Ok(());
        }
        let vec = d.head_dim.is_multiple_of(4);
        if d.head_dim > 1024 || (!vec && d.head_dim > 256) {
            return Err(invalid(
                "attention head_dim is over 1024, or over 256 and not a multiple of 4",
            ));
        }
        if vec && (!k_cache.0.is_multiple_of(16) || !v_cache.0.is_multiple_of(16)) {
            return Err(invalid("KV caches must be 16-byte aligned"));
        }
        per_row(
            self,
            ATTENTION_STEP,
            d.batch * d.heads,
            &[
                ptr(out),
                ptr(qkv),
                opt(bias),
                ptr(k_cache),
                ptr(v_cache),
                ptr(pos),
                KernelArg::U32(u32_of(d.heads)?),
                KernelArg::U32(u32_of(d.head_dim)?),
                KernelArg::U32(u32_of(d.ctx)?),
                KernelArg::F32(d.scale),
            ],
        )
    }

    fn argmax_step(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        bias: Option<DevicePtr>,
        rows: usize,
        cols: usize,
        pos: DevicePtr,
        limit: i32,
    ) -> Result<(), DeviceError> {
        if rows == 0 {
            return self.increment(pos, limit);
        }
        let m = module(self)?;
        self.launch_function(
            &m,
            ARGMAX_STEP,
            (u32_of(rows)?, 1, 1),
            (ARGMAX_BLOCK, 1, 1),
            0,
            &[
                ptr(out),
                ptr(x),
                opt(bias),
                KernelArg::U32(u32_of(cols)?),
                ptr(pos),
                KernelArg::I32(limit),
            ],
        )
    }

    fn gelu(&self, out: DevicePtr, x: DevicePtr, n: usize) -> Result<(), DeviceError> {
        strided(self, GELU, n, &[ptr(out), ptr(x), KernelArg::U64(n as u64)])
    }

    fn masked_softmax(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        pos: DevicePtr,
        d: SoftmaxDims,
    ) -> Result<(), DeviceError> {
        if d.cols == 0 {
            return Ok(());
        }
        per_row(
            self,
            MASKED_SOFTMAX,
            d.rows,
            &[ptr(out), ptr(x), ptr(pos), KernelArg::U32(u32_of(d.cols)?)],
        )
    }

    fn attention_scores(
        &self,
        out: DevicePtr,
        q: DevicePtr,
        k_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError> {
        if d.ctx == 0 {
            return Ok(());
        }
        per_row(
            self,
            ATTENTION_SCORES,
            d.batch * d.heads,
            &[
                ptr(out),
                ptr(q),
                ptr(k_cache),
                ptr(pos),
                KernelArg::U32(u32_of(d.heads)?),
                KernelArg::U32(u32_of(d.head_dim)?),
                KernelArg::U32(u32_of(d.ctx)?),
                KernelArg::F32(d.scale),
            ],
        )
    }

    fn attention_values(
        &self,
        out: DevicePtr,
        probs: DevicePtr,
        v_cache: DevicePtr,
        pos: DevicePtr,
        d: AttnDims,
    ) -> Result<(), DeviceError> {
        if d.ctx == 0 {
            return Ok(());
        }
        per_row(
            self,
            ATTENTION_VALUES,
            d.batch * d.heads,
            &[
                ptr(out),
                ptr(probs),
                ptr(v_cache),
                ptr(pos),
                KernelArg::U32(u32_of(d.heads)?),
                KernelArg::U32(u32_of(d.head_dim)?),
                KernelArg::U32(u32_of(d.ctx)?),
            ],
        )
    }

    fn kv_write(
        &self,
        cache: DevicePtr,
        x: DevicePtr,
        pos: DevicePtr,
        d: CacheDims,
    ) -> Result<(), DeviceError> {
        if d.ctx == 0 {
            return Ok(());
        }
        per_row(
            self,
            KV_WRITE,
            d.batch,
            &[
                ptr(cache),
                ptr(x),
                ptr(pos),
                KernelArg::U32(u32_of(d.ctx)?),
                KernelArg::U32(u32_of(d.dim)?),
            ],
        )
    }

    fn argmax(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        rows: usize,
        cols: usize,
    ) -> Result<(), DeviceError> {
        per_row(
            self,
            ARGMAX,
            rows,
            &[ptr(out), ptr(x), KernelArg::U32(u32_of(cols)?)],
        )
    }

    fn increment(&self, pos: DevicePtr, limit: i32) -> Result<(), DeviceError> {
        let m = module(self)?;
        self.launch_function(
            &m,
            INCREMENT,
            (1, 1, 1),
            (1, 1, 1),
            0,
            &[ptr(pos), KernelArg::I32(limit)],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{KERNEL_NAMES, KERNELS_CU};

    /// NVRTC compiles `kernels.cu` and the PTX defines every kernel the module looks up.
    #[test]
    #[ignore = "needs NVRTC (libnvrtc), present on GPU machines"]
    fn kernels_compile_with_nvrtc() {
        let ptx = graft_cuda::compile_ptx(KERNELS_CU, "graft_tensor_kernels.cu")
            .expect("kernels.cu compiles");
        let text = String::from_utf8_lossy(&ptx);
        for name in KERNEL_NAMES {
            assert!(
                text.contains(&format!(".entry {name}(")),
                "{name} missing from the PTX"
            );
        }
    }
}
