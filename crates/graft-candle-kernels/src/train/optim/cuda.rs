//! The multi-tensor optimizer kernels. A launch's tensors travel by value in its parameters
//! (a [`Table`]: each tensor's addresses, element count, dtype and first block); every block
//! finds its tensor by a binary search of the first blocks and updates one chunk of 4096
//! elements of it, 256 threads each loading 4 elements before computing any. A step launches
//! the all-finite checks of the gradients (a thread that meets an infinity or a NaN stores 1 in
//! the scalars' flag: plain stores, no atomics), then the updates (which return at once when the
//! flag is set), then one thread that advances the applied or the skipped count and clears the
//! flag, so a replayed step starts from a clear flag.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtrMut, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{CudaStorage, DType, Layout, Result};

use super::{AdamWConsts, OPTIM_SCALARS, Rule, SgdConsts, Step};
use crate::KernelError;
use crate::nvrtc::{Args, Kernels, address};

/// The tensors one check launch holds (one address each).
macro_rules! check_tensors {
    () => {
        160
    };
}
/// The tensors one update launch holds (up to four addresses each).
macro_rules! update_tensors {
    () => {
        64
    };
}
/// The elements a block updates: 256 threads, 4 elements each per pass, 4 passes.
macro_rules! chunk {
    () => {
        4096
    };
}

const CHECK_TENSORS: usize = check_tensors!();
const UPDATE_TENSORS: usize = update_tensors!();
const CHUNK: u64 = chunk!();

/// Threads per block.
const THREADS: u32 = 256;

/// CUDA's largest grid x dimension.
const MAX_BLOCKS: u64 = (1 << 31) - 1;

static KERNELS: Kernels = Kernels::new(
    "graft_kernels_optim",
    concat!(
        "#define GRAFT_OPTIM_CHECK_TENSORS ",
        check_tensors!(),
        "\n#define GRAFT_OPTIM_UPDATE_TENSORS ",
        update_tensors!(),
        "\n#define GRAFT_OPTIM_CHUNK ",
        chunk!(),
        "\n",
        include_str!("optim.cu")
    ),
);

/// One launch's tensors, passed by value: `GraftOptimTable<D, N>` in the kernels' source, field
/// for field (`repr(C)` lays both out alike).
///
/// No byte of it is padding (`pad` is an explicit zero): CUDA copies every byte of a kernel
/// parameter into the launch, a recording bakes them in, and graft's guards compare two
/// recordings' parameters byte for byte, so an undefined padding byte reads as a host value
/// that changed from call to call (and made the update step of an accumulation path record on
/// every call).
#[derive(Clone, Copy)]
#[repr(C)]
struct Table<const D: usize, const N: usize> {
    addr: [[u64; D]; N],
    len: [u64; N],
    start: [u32; N],
    dtype: [u32; N],
    count: u32,
    pad: u32,
}

/// The size of a `Table<D, N>` whose fields leave no padding.
const fn unpadded(d: usize, n: usize) -> usize {
    n * (8 * d + 8 + 4 + 4) + 8
}
const _: () = assert!(size_of::<Table<1, CHECK_TENSORS>>() == unpadded(1, CHECK_TENSORS));
const _: () = assert!(size_of::<Table<3, UPDATE_TENSORS>>() == unpadded(3, UPDATE_TENSORS));
const _: () = assert!(size_of::<Table<5, UPDATE_TENSORS>>() == unpadded(5, UPDATE_TENSORS));

// Each launch's parameters (a table, the scalars' address, the constants) stay under CUDA's
// 4 KiB of kernel parameters.
const _: () = assert!(size_of::<Table<1, CHECK_TENSORS>>() + 8 <= 4096);
const _: () = assert!(size_of::<Table<5, UPDATE_TENSORS>>() + 8 + size_of::<AdamWConsts>() <= 4096);
const _: () = assert!(size_of::<Table<3, UPDATE_TENSORS>>() + 8 + size_of::<SgdConsts>() <= 4096);

// SAFETY: plain `repr(C)` data of integers, the layout of `GraftOptimTable<D, N>`.
unsafe impl<const D: usize, const N: usize> DeviceRepr for Table<D, N> {}
// SAFETY: `repr(C)` f32s, the layout of `GraftAdamW`.
unsafe impl DeviceRepr for AdamWConsts {}
// SAFETY: `repr(C)` f32s and u32s, the layout of `GraftSgd`.
unsafe impl DeviceRepr for SgdConsts {}

/// One tensor of the step: its parameter's, gradient's, states' and copy's addresses (0 past
/// the rule's states and without a copy), its elements, and the codes of its parameter's dtype
/// and its gradient's (0 f32, 1 bf16, 2 f16).
struct Entry {
    addr: [u64; 5],
    len: u64,
    dtype: u8,
    grad_dtype: u8,
}

/// The kernels' code of a float dtype.
fn code(op: &'static str, input: &'static str, dtype: DType) -> Result<u8> {
    match dtype {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Ok(2),
        got => Err(KernelError::UnsupportedDType { op, input, got }.into()),
    }
}

impl Step<'_> {
    /// The tensors with elements, in order.
    fn entries(&self, device: &CudaDevice) -> Result<Vec<Entry>> {
        let states = self.rule.states();
        let mut entries = Vec::with_capacity(self.params.len());
        for (i, (p, g)) in self.params.iter().zip(&self.grads).enumerate() {
            if p.elem_count() == 0 {
                continue;
            }
            let mut addr = [0; 5];
            addr[0] = address(self.op, p, "params", device)?;
            addr[1] = address(self.op, g, "grads", device)?;
            for (a, (input, list)) in addr[2..4].iter_mut().zip(&states) {
                *a = address(self.op, list[i], input, device)?;
            }
            if let Some(copies) = self.rule.copies() {
                addr[4] = address(self.op, copies[i], "copies", device)?;
            }
            entries.push(Entry {
                addr,
                len: p.elem_count() as u64,
                dtype: code(self.op, "params", p.dtype())?,
                grad_dtype: code(self.op, "grads", g.dtype())?,
            });
        }
        Ok(entries)
    }
}

/// The launches over `entries`, in order, each with its grid: up to `N` tensors and at most
/// [`MAX_BLOCKS`] blocks a launch, each tensor's addresses and dtype code picked by `pick`.
fn tables<const D: usize, const N: usize>(
    op: &'static str,
    entries: &[Entry],
    pick: impl Fn(&Entry) -> ([u64; D], u8),
) -> Result<Vec<(Table<D, N>, u32)>> {
    let empty = Table {
        addr: [[0; D]; N],
        len: [0; N],
        start: [0; N],
        dtype: [0; N],
        count: 0,
        pad: 0,
    };
    let mut out = Vec::new();
    let (mut table, mut blocks) = (empty, 0u64);
    for e in entries {
        let need = e.len.div_ceil(CHUNK);
        if need > MAX_BLOCKS {
            return Err(KernelError::TooLarge {
                op,
                what: "a tensor's elements / 4096",
                size: need as usize,
            }
            .into());
        }
        if table.count as usize == N || blocks + need > MAX_BLOCKS {
            out.push((table, blocks as u32));
            (table, blocks) = (empty, 0);
        }
        let k = table.count as usize;
        let (addr, dtype) = pick(e);
        table.addr[k] = addr;
        table.len[k] = e.len;
        table.start[k] = blocks as u32;
        table.dtype[k] = u32::from(dtype);
        table.count += 1;
        blocks += need;
    }
    if table.count > 0 {
        out.push((table, blocks as u32));
    }
    Ok(out)
}

fn config(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The step on CUDA: the checks, the updates and the count, on the device's stream.
pub(super) fn step(step: &Step<'_>, storage: &mut CudaStorage, layout: &Layout) -> Result<()> {
    let op = step.op;
    let device = storage.device.clone();
    let dtype = storage.dtype();
    let entries = step.entries(&device)?;
    let Some((start, _)) = layout.contiguous_offsets() else {
        return Err(KernelError::NotContiguous {
            op,
            input: "scalars",
        }
        .into());
    };
    let CudaStorageSlice::F32(slice) = &mut storage.slice else {
        return Err(KernelError::ExpectedDType {
            op,
            input: "scalars",
            got: dtype,
            expected: DType::F32,
        }
        .into());
    };
    let mut scalars = slice.slice_mut(start..start + OPTIM_SCALARS);
    let stream = device.cuda_stream();
    let scalars = scalars.device_ptr_mut(&stream).0;

    for (table, blocks) in
        tables::<1, CHECK_TENSORS>(op, &entries, |e| ([e.addr[1]], e.grad_dtype))?
    {
        let mut args = Args::new();
        args.arg(&table).arg(&scalars);
        // SAFETY: the arguments match `graft_optim_check(GraftOptimTable<1, 160>, float*)`:
        // the table (the same layout) holds the addresses of contiguous gradients of
        // `len` elements of their dtype, which the step holds until the launch is enqueued;
        // the grid is the table's blocks, so every block finds a tensor and reads only below
        // its `len`; `scalars` holds the 4 f32 of the scalars.
        unsafe {
            KERNELS.launch(
                &device,
                &stream,
                "graft_optim_check",
                config(blocks, THREADS),
                false,
                &mut args,
            )
        }?;
    }
    match step.rule {
        Rule::AdamW { consts, .. } => {
            // The parameter's code, plus 16 times the gradient's (and copy's) with a copy.
            let pick = |e: &Entry| {
                let mixed = if e.addr[4] == 0 { 0 } else { 16 * e.grad_dtype };
                (e.addr, e.dtype + mixed)
            };
            for (table, blocks) in tables::<5, UPDATE_TENSORS>(op, &entries, pick)? {
                let mut args = Args::new();
                args.arg(&table).arg(&scalars).arg(&consts);
                // SAFETY: the arguments match `graft_optim_adamw(GraftOptimTable<5, 64>, const
                // float*, GraftAdamW)`: each tensor's parameter, gradient, m, v and copy (or 0)
                // are contiguous, of `len` elements of the dtypes its code names (checked by
                // `run`: an f32 parameter and a 16-bit gradient and copy of one dtype when
                // there is a copy), written ones not overlapping, held by the step until the
                // launch is enqueued; every block touches only indices below its tensor's
                // `len`.
                unsafe {
                    KERNELS.launch(
                        &device,
                        &stream,
                        "graft_optim_adamw",
                        config(blocks, THREADS),
                        false,
                        &mut args,
                    )
                }?;
            }
        }
        Rule::Sgd { consts, .. } => {
            let pick = |e: &Entry| ([e.addr[0], e.addr[1], e.addr[2]], e.dtype);
            for (table, blocks) in tables::<3, UPDATE_TENSORS>(op, &entries, pick)? {
                let mut args = Args::new();
                args.arg(&table).arg(&scalars).arg(&consts);
                // SAFETY: as AdamW's launch, for `graft_optim_sgd(GraftOptimTable<3, 64>,
                // const float*, GraftSgd)` with each tensor's parameter, gradient and momentum
                // buffer; the buffer's address is 0 exactly when `consts.buffers` is 0, and
                // the kernel reads and writes buffers only when it is 1.
                unsafe {
                    KERNELS.launch(
                        &device,
                        &stream,
                        "graft_optim_sgd",
                        config(blocks, THREADS),
                        false,
                        &mut args,
                    )
                }?;
            }
        }
    }
    let mut args = Args::new();
    args.arg(&scalars);
    // SAFETY: the argument matches `graft_optim_count(float*)`: `scalars` holds the 4 f32 its
    // one thread reads and writes.
    unsafe {
        KERNELS.launch(
            &device,
            &stream,
            "graft_optim_count",
            config(1, 1),
            false,
            &mut args,
        )
    }?;
    Ok(())
}
