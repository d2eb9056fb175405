//! [`Ops`] on CUDA: the kernels of `kernels.cu`, compiled with NVRTC once per device and
//! launched through graft-cuda's checked launch API (no `unsafe` here), and matrix products
//! through graft-cuda's cuBLAS `sgemm` followed by a bias kernel.
//!
//! Modules are kept in a process-wide registry keyed by device, with a per-thread cache of
//! the last one looked up, so a launch costs a comparison, not a lock. A device's module stays
//! loaded (and keeps the device alive) until the process exits.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};

use graft_core::{Device, DeviceError, DeviceId, DevicePtr};
use graft_cuda::{CudaDevice, CudaModule, KernelArg, Sgemm};

use crate::backend::{
    AttnDims, CacheDims, GatherDims, MatmulDims, NormDims, Ops, PositionDims, SoftmaxDims,
};

/// CUDA C++ source of the kernels.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// The kernels, in the order of their indices in the loaded module.
pub const KERNEL_NAMES: [&str; 12] = [
    "gt_embedding",
    "gt_add_position",
    "gt_add",
    "gt_add_bias",
    "gt_layer_norm",
    "gt_gelu",
    "gt_masked_softmax",
    "gt_attention_scores",
    "gt_attention_values",
    "gt_kv_write",
    "gt_argmax",
    "gt_increment",
];

const EMBEDDING: usize = 0;
const ADD_POSITION: usize = 1;
const ADD: usize = 2;
const ADD_BIAS: usize = 3;
const LAYER_NORM: usize = 4;
const GELU: usize = 5;
const MASKED_SOFTMAX: usize = 6;
const ATTENTION_SCORES: usize = 7;
const ATTENTION_VALUES: usize = 8;
const KV_WRITE: usize = 9;
const ARGMAX: usize = 10;
const INCREMENT: usize = 11;

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
fn module(dev: &CudaDevice) -> Result<Arc<CudaModule>, DeviceError> {
    let id = dev.id();
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
    u32::try_from(x).map_err(|_| DeviceError::Driver {
        op: graft_core::DeviceOp::KernelLaunch,
        code: 1,
        name: "CUDA_ERROR_INVALID_VALUE (a tensor dimension exceeds u32::MAX)",
    })
}

fn ptr(p: DevicePtr) -> KernelArg {
    KernelArg::Ptr(p)
}

/// Launches `kernel` with one block per row (`rows` blocks of [`BLOCK`] threads).
fn per_row(
    dev: &CudaDevice,
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
    dev: &CudaDevice,
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

impl Ops for CudaDevice {
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

    fn matmul(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        bias: Option<DevicePtr>,
        d: MatmulDims,
    ) -> Result<(), DeviceError> {
        if d.rows == 0 || d.n == 0 {
            return Ok(());
        }
        // Loads the module and creates the cuBLAS handle if this is the first op.
        let _ = module(self)?;
        self.sgemm(&Sgemm {
            m: d.rows,
            n: d.n,
            k: d.k,
            a: x,
            b: w,
            c: out,
            b_transposed: false,
            alpha: 1.0,
            beta: 0.0,
        })?;
        if let Some(bias) = bias {
            let n = d.rows * d.n;
            strided(
                self,
                ADD_BIAS,
                n,
                &[
                    ptr(out),
                    ptr(bias),
                    KernelArg::U64(n as u64),
                    KernelArg::U32(u32_of(d.n)?),
                ],
            )?;
        }
        Ok(())
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
