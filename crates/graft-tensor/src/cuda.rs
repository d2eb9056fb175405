//! [`Ops`] on CUDA ([`CudaOps`]): the kernels of `kernels.cu`, compiled with NVRTC once per
//! device and launched through graft-cuda's checked launch API (no `unsafe` here), and matrix
//! products through graft-cuda's cuBLAS `sgemm` (plus an epilogue kernel when the product
//! itself must add a bias, a GELU or a residual; the decoder passes its biases to the kernel
//! after the product instead). cuBLAS beat a hand-written few-rows kernel with the epilogue
//! fused at every batch size of the benchmark decoder inside a CUDA graph (H200, 2026-11-21),
//! so there is none.
//!
//! The module belongs to the [`CudaOps`] value that loaded it: dropping the value unloads it
//! and lets the device go.

use graft_core::{DeviceError, DeviceOp};
use graft_cuda::{CudaDevice, CudaModule, CudaQueue, KernelArg, Operand, Sgemm};

use crate::backend::{
    AddNormArgs, ArgmaxArgs, AttentionArgs, AttnDims, Backend, EmbedDims, EmbedNormArgs,
    LinearArgs, LoopArgs, LoopDims, MatmulDims, NormDims, Ops, SampleArgs,
};
use crate::error::Result;
use crate::sampling::Sampling;
use crate::tensor::Tensor;

/// CUDA C++ source of the kernels.
pub const KERNELS_CU: &str = concat!(graft_philox::philox_cu!(), include_str!("kernels.cu"));

/// The kernels, in the order of their indices in the loaded module.
pub const KERNEL_NAMES: [&str; 11] = [
    "gt_add",
    "gt_increment",
    "gt_embed_norm",
    "gt_epilogue",
    "gt_attention_step",
    "gt_argmax_step",
    "gt_add_norm",
    "gt_sample_step",
    "gt_sample_advance",
    "gt_loop_begin",
    "gt_loop_record",
];

const ADD: usize = 0;
const INCREMENT: usize = 1;
const EMBED_NORM: usize = 2;
const EPILOGUE: usize = 3;
const ATTENTION_STEP: usize = 4;
const ARGMAX_STEP: usize = 5;
const ADD_NORM: usize = 6;
const SAMPLE_STEP: usize = 7;
const SAMPLE_ADVANCE: usize = 8;
const LOOP_BEGIN: usize = 9;
const LOOP_RECORD: usize = 10;

/// Threads per block of `gt_argmax_step` and `gt_sample_step`.
const ARGMAX_BLOCK: u32 = 1024;

/// Threads per block (the reductions in `kernels.cu` assume exactly this).
const BLOCK: u32 = 256;
/// Most blocks of a grid-stride launch.
const MAX_BLOCKS: usize = 4096;

/// The decoder's kernels on one CUDA device: its queue, the module compiled from
/// [`KERNELS_CU`] and (made with it) the device's cuBLAS handle. Make it once per device
/// ([`CudaOps::new`] compiles, which takes a while) and keep it; dropping it unloads the
/// module.
#[derive(Debug)]
pub struct CudaOps {
    queue: CudaQueue,
    module: CudaModule,
}

impl CudaOps {
    /// Compiles and loads the kernels on `queue`'s device and creates its cuBLAS handle, so
    /// nothing is created during a capture. Call it outside any capture.
    pub fn new(queue: &CudaQueue) -> std::result::Result<CudaOps, DeviceError> {
        queue.init_cublas()?;
        let module = queue.load_module(KERNELS_CU, &KERNEL_NAMES)?;
        Ok(CudaOps {
            queue: queue.clone(),
            module,
        })
    }

    /// Launches `kernel` with one block per row (`rows` blocks of [`BLOCK`] threads).
    fn per_row(&self, kernel: usize, rows: usize, args: &[KernelArg]) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let grid = (u32_of(rows)?, 1, 1);
        Ok(self
            .queue
            .launch_function(&self.module, kernel, grid, (BLOCK, 1, 1), 0, args)?)
    }

    /// Launches `kernel` on one block of [`BLOCK`] threads.
    fn one_block(&self, kernel: usize, args: &[KernelArg]) -> Result<()> {
        Ok(self
            .queue
            .launch_function(&self.module, kernel, (1, 1, 1), (BLOCK, 1, 1), 0, args)?)
    }

    /// Launches a grid-stride `kernel` over `n` elements.
    fn strided(&self, kernel: usize, n: usize, args: &[KernelArg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(BLOCK as usize).min(MAX_BLOCKS) as u32;
        Ok(self.queue.launch_function(
            &self.module,
            kernel,
            (blocks, 1, 1),
            (BLOCK, 1, 1),
            0,
            args,
        )?)
    }
}

impl Backend for CudaDevice {
    type Ops = CudaOps;

    fn load_ops(&self) -> std::result::Result<CudaOps, DeviceError> {
        CudaOps::new(self)
    }
}

fn u32_of(x: usize) -> std::result::Result<u32, DeviceError> {
    u32::try_from(x).map_err(|_| invalid("a tensor dimension exceeds u32::MAX"))
}

fn invalid(what: &'static str) -> DeviceError {
    DeviceError::InvalidArgument {
        op: DeviceOp::KernelLaunch,
        what,
    }
}

/// `t` as a kernel's pointer argument (checked by the launch).
fn arg(t: &Tensor) -> KernelArg<'_> {
    KernelArg::BufferAt(t.buffer(), t.offset())
}

/// An optional operand: a null pointer when absent (the kernels check).
fn opt(t: Option<&Tensor>) -> KernelArg<'_> {
    t.map_or(KernelArg::Null, arg)
}

/// The token-loop kernels' leading arguments: out, cur, left, ctl, pos.
fn loop_args<'t>(a: &LoopArgs<'t>) -> [KernelArg<'t>; 5] {
    [arg(a.out), arg(a.cur), arg(a.left), arg(a.ctl), arg(a.pos)]
}

/// `t` as a GEMM operand (checked against the matrix's size by `sgemm`).
fn operand(t: &Tensor) -> Operand<'_> {
    Operand::at(t.buffer(), t.offset())
}

impl Ops for CudaOps {
    fn add(&self, out: &Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
        let n = out.numel();
        self.strided(
            ADD,
            n,
            &[arg(out), arg(a), arg(b), KernelArg::U64(n as u64)],
        )
    }

    fn linear(&self, a: LinearArgs<'_>, d: MatmulDims) -> Result<()> {
        if d.rows == 0 || d.n == 0 {
            return Ok(());
        }
        self.queue.sgemm(&Sgemm {
            m: d.rows,
            n: d.n,
            k: d.k,
            a: operand(a.x),
            b: operand(a.w),
            c: operand(a.out),
            b_transposed: false,
            alpha: 1.0,
            beta: 0.0,
        })?;
        if a.bias.is_some() || a.residual.is_some() || a.gelu {
            let n = d.rows * d.n;
            self.strided(
                EPILOGUE,
                n,
                &[
                    arg(a.out),
                    opt(a.bias),
                    opt(a.residual),
                    KernelArg::U64(n as u64),
                    KernelArg::U32(u32_of(d.n)?),
                    KernelArg::I32(i32::from(a.gelu)),
                ],
            )?;
        }
        Ok(())
    }

    fn embed_norm(&self, a: EmbedNormArgs<'_>, d: EmbedDims) -> Result<()> {
        if d.ctx == 0 || d.dim == 0 {
            return Ok(());
        }
        self.per_row(
            EMBED_NORM,
            d.rows,
            &[
                arg(a.x),
                arg(a.h),
                arg(a.ids),
                arg(a.table),
                arg(a.pos_table),
                arg(a.pos),
                arg(a.gamma),
                arg(a.beta),
                KernelArg::U32(u32_of(d.vocab)?),
                KernelArg::U32(u32_of(d.ctx)?),
                KernelArg::U32(u32_of(d.dim)?),
                KernelArg::F32(d.eps),
            ],
        )
    }

    fn add_norm(&self, a: AddNormArgs<'_>, d: NormDims) -> Result<()> {
        if d.dim == 0 {
            return Ok(());
        }
        self.per_row(
            ADD_NORM,
            d.rows,
            &[
                arg(a.x_out),
                arg(a.h),
                arg(a.x),
                arg(a.a),
                opt(a.bias),
                arg(a.gamma),
                arg(a.beta),
                KernelArg::U32(u32_of(d.dim)?),
                KernelArg::F32(d.eps),
            ],
        )
    }

    fn attention_step(&self, a: AttentionArgs<'_>, d: AttnDims) -> Result<()> {
        if d.ctx == 0 || d.head_dim == 0 {
            return Ok(());
        }
        let vec = d.head_dim.is_multiple_of(4);
        if d.head_dim > 1024 || (!vec && d.head_dim > 256) {
            return Err(invalid(
                "attention head_dim is over 1024, or over 256 and not a multiple of 4",
            )
            .into());
        }
        let aligned = |t: &Tensor| -> Result<bool> { Ok(t.ptr()?.0.is_multiple_of(16)) };
        if vec && (!aligned(a.k_cache)? || !aligned(a.v_cache)?) {
            return Err(invalid("KV caches must be 16-byte aligned").into());
        }
        self.per_row(
            ATTENTION_STEP,
            d.batch * d.heads,
            &[
                arg(a.out),
                arg(a.qkv),
                opt(a.bias),
                arg(a.k_cache),
                arg(a.v_cache),
                arg(a.pos),
                KernelArg::U32(u32_of(d.heads)?),
                KernelArg::U32(u32_of(d.head_dim)?),
                KernelArg::U32(u32_of(d.ctx)?),
                KernelArg::F32(d.scale),
            ],
        )
    }

    fn argmax_step(&self, a: ArgmaxArgs<'_>, rows: usize, cols: usize, limit: i32) -> Result<()> {
        if rows == 0 {
            let args = [arg(a.pos), KernelArg::I32(limit)];
            return Ok(self.queue.launch_function(
                &self.module,
                INCREMENT,
                (1, 1, 1),
                (1, 1, 1),
                0,
                &args,
            )?);
        }
        let args = [
            arg(a.out),
            arg(a.x),
            opt(a.bias),
            KernelArg::U32(u32_of(cols)?),
            arg(a.pos),
            KernelArg::I32(limit),
        ];
        Ok(self.queue.launch_function(
            &self.module,
            ARGMAX_STEP,
            (u32_of(rows)?, 1, 1),
            (ARGMAX_BLOCK, 1, 1),
            0,
            &args,
        )?)
    }

    fn sample_step(
        &self,
        a: SampleArgs<'_>,
        rows: usize,
        cols: usize,
        limit: i32,
        s: Sampling,
    ) -> Result<()> {
        if rows > 0 {
            let args = [
                arg(a.out),
                arg(a.x),
                opt(a.bias),
                KernelArg::U32(u32_of(cols)?),
                arg(a.rng),
                KernelArg::F32(s.temperature),
                KernelArg::U32(s.top_k),
            ];
            self.queue.launch_function(
                &self.module,
                SAMPLE_STEP,
                (u32_of(rows)?, 1, 1),
                (ARGMAX_BLOCK, 1, 1),
                0,
                &args,
            )?;
        }
        let args = [arg(a.rng), arg(a.pos), KernelArg::I32(limit)];
        Ok(self.queue.launch_function(
            &self.module,
            SAMPLE_ADVANCE,
            (1, 1, 1),
            (1, 1, 1),
            0,
            &args,
        )?)
    }

    fn loop_begin(
        &self,
        a: &LoopArgs<'_>,
        tokens: &Tensor,
        limits: &Tensor,
        d: LoopDims,
    ) -> Result<()> {
        let [out, cur, left, ctl, pos] = loop_args(a);
        self.one_block(
            LOOP_BEGIN,
            &[
                out,
                cur,
                left,
                ctl,
                pos,
                arg(tokens),
                arg(limits),
                KernelArg::U32(u32_of(d.rows)?),
                KernelArg::U32(u32_of(d.steps)?),
                KernelArg::I32(d.ctx),
            ],
        )
    }

    fn loop_record(&self, a: &LoopArgs<'_>, next: &Tensor, d: LoopDims) -> Result<()> {
        let [out, cur, left, ctl, pos] = loop_args(a);
        self.one_block(
            LOOP_RECORD,
            &[
                out,
                cur,
                left,
                ctl,
                pos,
                arg(next),
                KernelArg::U32(u32_of(d.rows)?),
                KernelArg::U32(u32_of(d.steps)?),
                KernelArg::I32(d.ctx),
                KernelArg::I32(d.eos),
            ],
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
