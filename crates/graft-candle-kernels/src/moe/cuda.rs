//! The mixture-of-experts kernels: routing (one warp per token: softmax, k rounds of a warp
//! argmax, renormalization), the chosen experts' gate, up and SwiGLU (one warp per
//! intermediate output of each token's each choice), and the down projections summed by
//! weight (one warp per hidden output of each token, looping over its choices). With more
//! choices than experts (a batch), both go expert-major instead: a block column per expert
//! lists the choices routed to it and reads each of its weight rows once for all of them (the
//! token-major kernels read an expert once per token that chose it: 8 times at batch 32 of
//! Mixtral), then a third kernel sums each token's choices in the same order. Expert weights
//! are found through the device table of addresses `Experts::new` made; dot products use
//! 16-byte loads, four in flight per lane, where the sizes and addresses allow.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, Map1Any};
use candle_core::{CudaStorage, Layout, Result, Shape, Tensor, WithDType};

use super::{EXPERTS, ExpertsOp, KernelError, ROUTE, Route};
use crate::check;
use crate::nvrtc::{Args, Kernels, address, view};

/// The kernels' source (`moe.cu`): the dot products, routing, the token-major and expert-major
/// gate-and-up and down kernels, and the combine.
static KERNELS: Kernels = Kernels::new("graft_kernels_moe", include_str!("moe.cu"));

/// Warps per block.
const WARPS: u32 = 8;

/// CUDA's largest grid y dimension (tokens times choices for the gate and up kernel).
const MAX_GRID_Y: usize = 65_535;

/// The most choices (tokens times k) the expert-major kernels list in shared memory (16 KiB).
const MAX_LISTED: usize = 4096;

/// The bytes of weight rows a block of the expert-major kernels may re-read from L1 per choice
/// (a quarter of an H100's or H200's 256 KiB).
const L1_ROWS: usize = 64 << 10;

/// The device table of the experts' weights.
#[derive(Debug, Clone)]
pub(super) struct Table {
    /// `[3 * experts]` i64: every gate's address, then every up's, then every down's.
    pub(super) addresses: Tensor,
    /// Every weight starts 16-byte aligned (the kernels' wide loads may then be used).
    aligned: bool,
}

/// The table of the weights `[gates, ups, downs]` (held alive by the `Experts` it is for).
pub(super) fn table(weights: [&[Tensor]; 3], device: &CudaDevice) -> Result<Table> {
    let mut all = Vec::with_capacity(3 * weights[0].len());
    for (input, ws) in ["gate", "up", "down"].into_iter().zip(weights) {
        for w in ws {
            all.push(address(EXPERTS, w, input, device)? as i64);
        }
    }
    Ok(Table {
        aligned: all.iter().all(|a| a % 16 == 0),
        addresses: Tensor::new(all, &candle_core::Device::Cuda(device.clone()))?,
    })
}

/// The routing op on CUDA: `[tokens, 2, k]` f32.
pub(super) fn route(op: &Route, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let device = s.device.clone();
    let slice = op.map(&s.slice, &device, l)?;
    let tokens = l.shape().elem_count() / op.experts;
    Ok((CudaStorage { slice, device }, op.out_shape(tokens)))
}

fn blocks(op: &'static str, what: &'static str, n: usize) -> Result<u32> {
    check::u32_of(op, what, n.div_ceil(WARPS as usize))
}

fn config(grid: (u32, u32), shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (WARPS * 32, 1, 1),
        shared_mem_bytes,
    }
}

impl Map1Any for Route {
    fn f<T: DeviceRepr + WithDType + ValidAsZeroBits, W: Fn(CudaSlice<T>) -> CudaStorageSlice>(
        &self,
        x: &CudaSlice<T>,
        device: &CudaDevice,
        l: &Layout,
        _wrap: W,
    ) -> Result<CudaStorageSlice> {
        let x = view(ROUTE, "logits", x, l)?;
        let tokens = l.shape().elem_count() / self.experts;
        // SAFETY: the kernel writes all `tokens * 2 * k` values (one warp per token, lane 0
        // writes its 2k) before anything reads them: it is launched below on the stream.
        let out = unsafe { device.alloc::<f32>(tokens * 2 * self.top_k)? };
        let name = format!("graft_moe_route_{}", T::DTYPE.as_str());
        let grid = blocks(ROUTE, "the token count", tokens)?;
        let (n, e, k) = (tokens as u32, self.experts as u32, self.top_k as u32);
        let normalize = u32::from(self.normalize);
        let stream = device.cuda_stream();
        let x = x.device_ptr(&stream).0;
        let out_ptr = out.device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&x)
            .arg(&out_ptr)
            .arg(&n)
            .arg(&e)
            .arg(&k)
            .arg(&normalize);
        let cfg = config((grid, 1), 0);
        // SAFETY: the arguments match `graft_moe_route_<dtype>(const T*, float*, unsigned int
        // x4)` with T the storage's dtype: `x` holds tokens * experts elements, `out` tokens *
        // 2k f32; experts <= 256 (eight per lane, checked by `route`) and 1 <= k <= experts;
        // warps past the last token return before any shuffle; all live until enqueued.
        unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
        Ok(CudaStorageSlice::F32(out))
    }
}

/// The experts op on CUDA: `[tokens, hidden]` in `x`'s dtype.
pub(super) fn experts(
    op: &ExpertsOp<'_>,
    x: &CudaStorage,
    xl: &Layout,
    r: &CudaStorage,
    rl: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let device = x.device.clone();
    let CudaStorageSlice::F32(routing) = &r.slice else {
        return Err(KernelError::UnsupportedDType {
            op: EXPERTS,
            input: "routing",
            got: r.dtype(),
        }
        .into());
    };
    let slice = match &x.slice {
        CudaStorageSlice::F32(s) => CudaStorageSlice::F32(op.run(s, xl, routing, rl, &device)?),
        CudaStorageSlice::BF16(s) => CudaStorageSlice::BF16(op.run(s, xl, routing, rl, &device)?),
        CudaStorageSlice::F16(s) => CudaStorageSlice::F16(op.run(s, xl, routing, rl, &device)?),
        _ => {
            return Err(KernelError::UnsupportedDType {
                op: EXPERTS,
                input: "x",
                got: x.dtype(),
            }
            .into());
        }
    };
    Ok((CudaStorage { slice, device }, xl.shape().clone()))
}

impl ExpertsOp<'_> {
    fn run<T: DeviceRepr + WithDType + ValidAsZeroBits>(
        &self,
        x: &CudaSlice<T>,
        xl: &Layout,
        routing: &CudaSlice<f32>,
        rl: &Layout,
        device: &CudaDevice,
    ) -> Result<CudaSlice<T>> {
        let e = self.experts;
        let Some(table) = &e.table else {
            // Experts made on another device than x's (checked by `forward`): unreachable.
            return Err(KernelError::Device {
                op: EXPERTS,
                input: "the experts' weights",
            }
            .into());
        };
        let (d, f, k) = (e.hidden, e.intermediate, self.top_k);
        let tokens = xl.shape().elem_count() / d;
        if tokens * k > MAX_GRID_Y {
            return Err(KernelError::TooLarge {
                op: EXPERTS,
                what: "tokens times experts per token",
                size: tokens * k,
            }
            .into());
        }
        let x = view(EXPERTS, "x", x, xl)?;
        let routing = view(EXPERTS, "routing", routing, rl)?;
        let stream = device.cuda_stream();
        let table_at = address(EXPERTS, &table.addresses, "the address table", device)?;
        let weights_aligned = table.aligned;
        let x = x.device_ptr(&stream).0;
        let routing = routing.device_ptr(&stream).0;
        let x_aligned = x.is_multiple_of(16);
        // Gate and up read rows of `hidden`, down rows of `intermediate`; `h` is a fresh
        // allocation (256-byte aligned).
        let vec_up = weights_aligned && x_aligned && (d * size_of::<T>()).is_multiple_of(16);
        let vec_down = weights_aligned && (f * size_of::<T>()).is_multiple_of(16);
        // SAFETY: the gate-and-up kernel writes all `tokens * k * f` elements (a warp per
        // intermediate output of each choice) before the down kernel reads them, on one stream.
        let h = unsafe { device.alloc::<T>(tokens * k * f)? };
        // SAFETY: all `tokens * d` outputs are written before anything reads them: by the
        // token-major down kernel (a warp per hidden output of each token), or by the combine
        // kernel (a thread per output).
        let y = unsafe { device.alloc::<T>(tokens * d)? };
        let (h_ptr, y_ptr) = (h.device_ptr(&stream).0, y.device_ptr(&stream).0);
        let dtype = T::DTYPE.as_str();
        let kind = |vec: bool| if vec { "vec" } else { "scalar" };
        let slots = tokens * k;
        // More choices than experts: some expert serves several, so read each expert's rows
        // once for all of them (the list of an expert's choices is in shared memory).
        let by_expert = slots > e.len() && slots <= MAX_LISTED;
        let (grid_y, shared) = if by_expert {
            (e.len() as u32, (slots * size_of::<u32>()) as u32)
        } else {
            (slots as u32, 0)
        };
        // By expert: the choices per read of a weight row, 1 when the block's 8 warps' rows
        // fit in a quarter of L1 (re-read from there: Qwen3-MoE's bf16 experts at batch 32 ran
        // steps 1.3 times faster so than 8 at a time), else 8 (Mixtral's f32 experts at batch
        // 32: steps 2.5 times faster than 1, whose rows did not stay in L1) (H200).
        let order = |row_bytes: usize| match (by_expert, row_bytes * WARPS as usize <= L1_ROWS) {
            (false, _) => "",
            (true, true) => "by_expert1_",
            (true, false) => "by_expert8_",
        };
        let (hidden, inter) = (d as u32, f as u32);
        let (k32, n32, slots32) = (k as u32, e.len() as u32, slots as u32);
        let up_name = format!(
            "graft_moe_gate_up_{}{}_{dtype}",
            order(2 * d * size_of::<T>()),
            kind(vec_up)
        );
        let grid = (blocks(EXPERTS, "the intermediate size", f)?, grid_y);
        let mut args = Args::new();
        args.arg(&x)
            .arg(&routing)
            .arg(&table_at)
            .arg(&h_ptr)
            .arg(&hidden)
            .arg(&inter)
            .arg(&k32)
            .arg(&n32);
        if by_expert {
            args.arg(&slots32);
        }
        let cfg = config(grid, shared);
        // SAFETY: the arguments match `graft_moe_gate_up_[by_expert_]<kind>_<dtype>(const T*,
        // const float*, const long long*, T*, unsigned int x4 [, unsigned int slots])`: `x`
        // holds tokens * hidden elements, `routing` tokens * 2k f32 made by `route` (indices
        // clamped to the table in the kernel), the table 3 * experts addresses of contiguous
        // weights of T that `Experts` holds alive ([inter, hidden] gates and ups), `h` tokens
        // * k * inter; by expert, the dynamic shared memory holds the `slots` list entries;
        // the 16-byte loads only with every weight, `x` and the row length 16-byte aligned.
        unsafe { KERNELS.launch(device, &stream, &up_name, cfg, false, &mut args) }?;
        let down_name = format!(
            "graft_moe_down_{}{}_{dtype}",
            order(f * size_of::<T>()),
            kind(vec_down)
        );
        let grid = (blocks(EXPERTS, "the hidden size", d)?, grid_y);
        if !by_expert {
            let grid = (grid.0, tokens as u32);
            let mut args = Args::new();
            args.arg(&h_ptr)
                .arg(&routing)
                .arg(&table_at)
                .arg(&y_ptr)
                .arg(&hidden)
                .arg(&inter)
                .arg(&k32)
                .arg(&n32);
            let cfg = config(grid, 0);
            // SAFETY: as above, with the downs ([hidden, inter]) read through the table's last
            // third, `h` the gate-and-up kernel's tokens * k * inter elements and `y` tokens *
            // hidden; the 16-byte loads only with the weights and the row length aligned.
            unsafe { KERNELS.launch(device, &stream, &down_name, cfg, false, &mut args) }?;
            return Ok(y);
        }
        // SAFETY: the down kernel by expert writes all `slots * d` weighted outputs (every
        // choice is on exactly one expert's list, a warp per hidden output) before the combine
        // kernel reads them.
        let ys = unsafe { device.alloc::<f32>(slots * d)? };
        let ys_ptr = ys.device_ptr(&stream).0;
        let mut args = Args::new();
        args.arg(&h_ptr)
            .arg(&routing)
            .arg(&table_at)
            .arg(&ys_ptr)
            .arg(&hidden)
            .arg(&inter)
            .arg(&k32)
            .arg(&n32)
            .arg(&slots32);
        let cfg = config(grid, shared);
        // SAFETY: as the gate-and-up launch, with the downs ([hidden, inter]) through the
        // table's last third, `h` its slots * inter elements and `ys` slots * hidden f32.
        unsafe { KERNELS.launch(device, &stream, &down_name, cfg, false, &mut args) }?;
        let name = format!("graft_moe_combine_{dtype}");
        let grid = check::u32_of(EXPERTS, "the outputs / 256", (tokens * d).div_ceil(256))?;
        let tokens32 = tokens as u32;
        let mut args = Args::new();
        args.arg(&ys_ptr)
            .arg(&y_ptr)
            .arg(&hidden)
            .arg(&k32)
            .arg(&tokens32);
        let cfg = config((grid, 1), 0);
        // SAFETY: the arguments match `graft_moe_combine_<dtype>(const float*, T*, unsigned
        // int x3)`: `ys` holds tokens * k * hidden f32, `y` tokens * hidden; one thread per
        // output, the threads past the last returning.
        unsafe { KERNELS.launch(device, &stream, &name, cfg, false, &mut args) }?;
        Ok(y)
    }
}
