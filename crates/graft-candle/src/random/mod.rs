//! Random numbers whose seed and offset live on the device, so a recorded CUDA graph draws
//! new numbers at every replay.
//!
//! # Why
//!
//! A value the host holds when a step is recorded is baked into the graph: a seed or an offset
//! passed to a kernel as a parameter is the same at every replay, so a replay repeats the
//! recording's numbers, and a new seed set on the host never reaches it. candle's own
//! `Tensor::rand` has the same problem on CUDA: curand applies a new seed lazily, at the next
//! host call, which a replay never makes. [`DeviceRng`] keeps its whole state in a small
//! device tensor: every draw, eager or replayed, reads the seed and offset through a pointer
//! to that tensor and then advances the offset in place, so the sequence of draws is the same
//! whether a step ran eagerly or replayed.
//!
//! # The generator and its counter layout
//!
//! Philox4x32-10 (Salmon et al., SC 2011; the generator of Random123), counter-based: block
//! `b` of the stream is the bijection keyed by the seed applied to the counter `b`. The state
//! is a `u32` tensor of shape `[4]`: `[key_lo, key_hi, offset_lo, offset_hi]`, where the key is
//! the seed (its low word first) and the offset counts the 4-word blocks drawn so far. Element
//! `i` of a draw of `n` elements is lane `i % 4` of the block whose 128-bit counter is
//! `[lo, hi, 0, 0]` with `lo, hi` the words of `offset + i / 4` (wrapping at 2^64); after the
//! draw the offset has grown by `ceil(n / 4)`. So draws whose sizes are multiples of 4 continue
//! one stream exactly (8 then 8 equals the first 16 of a draw of 16); a draw of any other size
//! leaves the unused lanes of its last block unused. A word `x` becomes the f32
//! `(x >> 8) * 2^-24` in `[0, 1)`, exact in f32, so the CPU and the GPU give the same bits.
//!
//! # Under [`CandleGraft`](crate::CandleGraft)
//!
//! Pass [`DeviceRng::state`] among the step's `statics` and draw inside the body:
//!
//! ```
//! use graft_candle::candle_core::{DType, Tensor};
//! use graft_candle::{CandleGraft, random::DeviceRng};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let device = graft_candle::device(0)?;
//! let rng = DeviceRng::new(&device, 42)?;
//! let mut graft = CandleGraft::new(&device)?;
//! let step = graft.register("dropout");
//! let x = Tensor::ones(8, DType::F32, &device)?;
//! let mut masks = Vec::new();
//! for _ in 0..4 {
//!     // Each call, eager, recorded or replayed, draws the next 8 numbers of the stream.
//!     let out = graft.call(step, &[&x], &[rng.state()], &[], |inputs| {
//!         Ok(vec![rng.dropout(&inputs[0], 0.5)?])
//!     })?;
//!     masks.extend(out.outputs);
//! }
//! // 4 calls of 8 numbers: 8 blocks of 4.
//! assert_eq!(rng.offset()?, 8);
//! # Ok(())
//! # }
//! ```
//!
//! On CUDA, a draw is two kernels on the device's stream: one writes the numbers from the
//! state, the next (one thread) advances the offset; stream order keeps them apart. The kernels
//! are compiled with NVRTC once per process and loaded by [`DeviceRng::new`], never inside a
//! capture.

mod philox;

// The kernels' backend: NVRTC and candle's CUDA device with the `cuda` feature, a stand-in
// that refuses without it (no CUDA tensor can exist in that build).
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "no_cuda.rs"]
mod cuda;

use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Shape, Tensor, bail};
use candle_core::{CustomOp1, InplaceOp1};

/// A Philox4x32-10 generator whose seed and offset live in a device tensor (see the module
/// documentation). A clone shares the state: both draw from one stream.
#[derive(Clone, Debug)]
pub struct DeviceRng {
    state: Tensor,
}

impl DeviceRng {
    /// A generator on `device` seeded with `seed`, at offset 0. On CUDA this also compiles (once
    /// per process) and loads the kernels, so no draw loads a module, inside a capture or not;
    /// it fails if NVRTC cannot compile them or the device cannot load them.
    pub fn new(device: &Device, seed: u64) -> Result<DeviceRng> {
        if let Device::Cuda(cuda) = device {
            cuda::load(cuda)?;
        }
        let state = Tensor::new(&seeded(seed), device)?;
        Ok(DeviceRng { state })
    }

    /// Seeds the generator with `seed` and resets its offset to 0, writing the state tensor in
    /// place (same tensor, same address: a graph recorded with it stays valid and its next
    /// replay draws from the new seed). An upload: call it between steps, never inside a step's
    /// body.
    pub fn set_seed(&self, seed: u64) -> Result<()> {
        let fresh = Tensor::new(&seeded(seed), self.state.device())?;
        self.state.slice_set(&fresh, 0, 0)
    }

    /// The state tensor (`u32`, shape `[4]`: key low and high words, offset low and high
    /// words). Pass it as a static of every step whose body draws from this generator; save
    /// it in a checkpoint and resume with [`DeviceRng::load_state`].
    pub fn state(&self) -> &Tensor {
        &self.state
    }

    /// Resumes from a saved [`DeviceRng::state`] (`u32`, `[4]`), written into this
    /// generator's state in place (recorded steps stay valid): the next draws are those the
    /// saved generator would have made. An upload: between steps.
    pub fn load_state(&self, saved: &Tensor) -> Result<()> {
        if saved.dtype() != DType::U32 || saved.dims() != [4] {
            candle_core::bail!(
                "a generator state is [4] u32, got {:?} {:?}: pass what DeviceRng::state gave",
                saved.dtype(),
                saved.shape()
            );
        }
        self.state
            .slice_set(&saved.to_device(self.state.device())?, 0, 0)
    }

    /// The seed, read to the host (synchronizes: for tests and checkpoints, never inside a
    /// step's body).
    pub fn seed(&self) -> Result<u64> {
        let [lo, hi, _, _] = self.read()?;
        Ok(join(lo, hi))
    }

    /// The 4-word blocks drawn since the last seeding, read to the host (synchronizes: for
    /// tests and checkpoints, never inside a step's body).
    pub fn offset(&self) -> Result<u64> {
        let [_, _, lo, hi] = self.read()?;
        Ok(join(lo, hi))
    }

    /// `shape`'s elements, f32 uniform in `[0, 1)`, drawn from the state on the device, which
    /// then advances by `ceil(n / 4)` blocks. An empty shape draws nothing.
    pub fn uniform(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.elem_count();
        if n == 0 {
            return Tensor::zeros(shape, DType::F32, self.state.device());
        }
        let numbers = self.state.apply_op1_no_bwd(&Uniform { shape })?;
        self.state.inplace_op1(&Advance {
            blocks: philox::blocks(n),
        })?;
        Ok(numbers)
    }

    /// Inverted dropout: `x * mask / (1 - p)` in `x`'s dtype, where the mask keeps an element
    /// when a uniform drawn for it (one per element of `x`, as [`DeviceRng::uniform`]) is at
    /// least `p`. Differentiable in `x`: the mask is a constant, so the gradient is
    /// `mask / (1 - p)`. A draw happens even at `p = 0`, so the stream does not depend on `p`.
    /// `p` must be in `[0, 1)`, and `x` on the generator's device.
    pub fn dropout(&self, x: &Tensor, p: f32) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            bail!(
                "dropout probability {p} is outside [0, 1): pass a probability of dropping below 1"
            );
        }
        if !x.device().same_device(self.state.device()) {
            bail!(
                "dropout of a tensor on {:?} with a generator on {:?}: make the DeviceRng on the tensor's device",
                x.device().location(),
                self.state.device().location()
            );
        }
        let numbers = self.uniform(x.shape())?;
        let threshold = Tensor::full(p, x.shape(), x.device())?;
        let scale = 1.0 / (1.0 - f64::from(p));
        let mask = numbers
            .ge(&threshold)?
            .to_dtype(x.dtype())?
            .affine(scale, 0.0)?;
        x.mul(&mask)
    }

    /// The state's four words, read to the host.
    fn read(&self) -> Result<[u32; 4]> {
        let words = self.state.to_vec1::<u32>()?;
        words.try_into().map_err(|words: Vec<u32>| {
            candle_core::Error::Msg(format!(
                "the generator's state holds {} words instead of 4; make it with DeviceRng::new",
                words.len()
            ))
        })
    }
}

/// The state words of `seed` at offset 0.
fn seeded(seed: u64) -> [u32; 4] {
    [seed as u32, (seed >> 32) as u32, 0, 0]
}

/// The u64 whose low and high words are `lo` and `hi`.
fn join(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

/// The range of the four state words in their storage, checked: the state is contiguous with
/// exactly 4 elements.
fn state_range(layout: &Layout) -> Result<Range<usize>> {
    match layout.contiguous_offsets() {
        Some((start, end)) if end - start == 4 => Ok(start..end),
        _ => bail!(
            "the generator's state must be a contiguous tensor of 4 u32 words, got shape {:?}; make it with DeviceRng::new",
            layout.shape()
        ),
    }
}

/// The four state words of a CPU storage.
fn cpu_words<'s>(storage: &'s CpuStorage, layout: &Layout) -> Result<&'s [u32]> {
    let range = state_range(layout)?;
    match storage {
        CpuStorage::U32(words) => Ok(&words[range]),
        other => bail!(
            "the generator's state must be u32, got {:?}; make it with DeviceRng::new",
            other.dtype()
        ),
    }
}

/// Draws `shape`'s elements from the state it is applied to, leaving the state unchanged.
struct Uniform {
    shape: Shape,
}

impl CustomOp1 for Uniform {
    fn name(&self) -> &'static str {
        "graft-philox-uniform"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let state = cpu_words(storage, layout)?;
        let mut out = vec![0f32; self.shape.elem_count()];
        philox::fill_uniform([state[0], state[1]], join(state[2], state[3]), &mut out);
        Ok((CpuStorage::F32(out), self.shape.clone()))
    }

    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let range = state_range(layout)?;
        let out = cuda::uniform(storage, range, self.shape.elem_count())?;
        Ok((out, self.shape.clone()))
    }
}

/// Advances the offset of the state it is applied to by `blocks`.
struct Advance {
    blocks: u64,
}

impl InplaceOp1 for Advance {
    fn name(&self) -> &'static str {
        "graft-philox-advance"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let start = state_range(layout)?.start;
        let CpuStorage::U32(words) = storage else {
            bail!(
                "the generator's state must be u32, got {:?}; make it with DeviceRng::new",
                storage.dtype()
            );
        };
        let offset = join(words[start + 2], words[start + 3]).wrapping_add(self.blocks);
        words[start + 2] = offset as u32;
        words[start + 3] = (offset >> 32) as u32;
        Ok(())
    }

    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> Result<()> {
        let range = state_range(layout)?;
        cuda::advance(storage, range, self.blocks)
    }
}
