//! Tensors (a graft [`Buffer`] with a shape and a dtype), the metadata graft stores for
//! outputs, and the allocators ops draw from.

use std::fmt;
use std::sync::Arc;

use graft_core::{Buffer, Ctx, Device, DevicePtr, Graft, Output};

use crate::dtype::DType;
use crate::error::{Result, TensorError};

/// What graft stores per output (opaque to it) and hands back on replay: cheap to clone.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Meta {
    /// The output's shape.
    pub shape: Arc<[usize]>,
    /// Its element type.
    pub dtype: DType,
}

/// A dense, contiguous, row-major tensor in graft-managed memory: a [`Buffer`] plus a byte
/// offset into it (non-zero for views into a larger buffer, such as a weight arena), a shape
/// and a dtype. Cloning shares the memory.
#[derive(Clone)]
pub struct Tensor {
    buffer: Buffer,
    offset: usize,
    shape: Arc<[usize]>,
    dtype: DType,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &&*self.shape)
            .field("dtype", &self.dtype)
            .field("offset", &self.offset)
            .field("buffer", &self.buffer)
            .finish()
    }
}

/// Elements of a shape.
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    /// A tensor over the start of `buffer`. Fails if the buffer is too small for the shape.
    pub fn from_buffer(buffer: Buffer, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::view_of(buffer, 0, Arc::from(shape), dtype)
    }

    fn view_of(buffer: Buffer, offset: usize, shape: Arc<[usize]>, dtype: DType) -> Result<Tensor> {
        let needed = numel(&shape)
            .checked_mul(dtype.size())
            .and_then(|b| b.checked_add(offset));
        match needed {
            Some(n) if n <= buffer.len() => Ok(Tensor {
                buffer,
                offset,
                shape,
                dtype,
            }),
            _ => Err(TensorError::OutOfBounds {
                shape: shape.to_vec(),
                dtype,
                offset,
                needed: needed.unwrap_or(usize::MAX),
                available: buffer.len(),
            }),
        }
    }

    /// A tensor over a graft output, with the shape and dtype graft stored for it.
    pub fn from_output(output: Output<Meta>) -> Result<Tensor> {
        Tensor::view_of(output.buffer, 0, output.meta.shape, output.meta.dtype)
    }

    /// This tensor as a graft output (a whole-buffer tensor and its metadata).
    pub fn into_output(self) -> Output<Meta> {
        Output::new(
            self.buffer,
            Meta {
                shape: self.shape,
                dtype: self.dtype,
            },
        )
    }

    /// A new uninitialized tensor from `alloc`.
    pub fn empty<D: Device, A: Alloc<D> + ?Sized>(
        alloc: &mut A,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let bytes =
            numel(shape)
                .checked_mul(dtype.size())
                .ok_or_else(|| TensorError::OutOfBounds {
                    shape: shape.to_vec(),
                    dtype,
                    offset: 0,
                    needed: usize::MAX,
                    available: 0,
                })?;
        let buffer = alloc.alloc(bytes)?;
        Tensor::from_buffer(buffer, shape, dtype)
    }

    /// A new tensor holding `data` (written synchronously: not inside a captured body).
    pub fn from_f32<D: Device, A: EagerAlloc<D> + ?Sized>(
        alloc: &mut A,
        shape: &[usize],
        data: &[f32],
    ) -> Result<Tensor> {
        let t = Tensor::empty(alloc, shape, DType::F32)?;
        t.write_f32(alloc.device(), data)?;
        Ok(t)
    }

    /// A new i32 tensor holding `data` (written synchronously: not inside a captured body).
    pub fn from_i32<D: Device, A: EagerAlloc<D> + ?Sized>(
        alloc: &mut A,
        shape: &[usize],
        data: &[i32],
    ) -> Result<Tensor> {
        let t = Tensor::empty(alloc, shape, DType::I32)?;
        t.write_i32(alloc.device(), data)?;
        Ok(t)
    }

    /// A new u32 tensor holding `data` (written synchronously: not inside a captured body).
    pub fn from_u32<D: Device, A: EagerAlloc<D> + ?Sized>(
        alloc: &mut A,
        shape: &[usize],
        data: &[u32],
    ) -> Result<Tensor> {
        let t = Tensor::empty(alloc, shape, DType::U32)?;
        t.write_u32(alloc.device(), data)?;
        Ok(t)
    }

    /// A view of `shape` starting `elem_offset` elements into this tensor (same dtype).
    pub fn view(&self, elem_offset: usize, shape: &[usize]) -> Result<Tensor> {
        let within = elem_offset
            .checked_add(numel(shape))
            .is_some_and(|end| end <= self.numel());
        if !within {
            return Err(TensorError::OutOfBounds {
                shape: shape.to_vec(),
                dtype: self.dtype,
                offset: self.offset + elem_offset.saturating_mul(self.dtype.size()),
                needed: usize::MAX,
                available: self.offset + self.bytes(),
            });
        }
        Tensor::view_of(
            self.buffer.clone(),
            self.offset + elem_offset * self.dtype.size(),
            Arc::from(shape),
            self.dtype,
        )
    }

    /// The same memory with another shape of the same element count.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.numel() {
            return Err(TensorError::Shape {
                op: "reshape",
                operand: "tensor",
                expected: self.shape.to_vec(),
                found: shape.to_vec(),
            });
        }
        self.view(0, shape)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Bytes the tensor covers.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// Byte offset into the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The underlying graft buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The device address of the first element, or why the memory may no longer be read.
    #[inline]
    pub fn ptr(&self) -> Result<DevicePtr> {
        Ok(self.buffer.addr()?.offset(self.offset))
    }

    /// Whether the tensor covers its whole buffer (what graft calls need of inputs).
    pub fn is_whole_buffer(&self) -> bool {
        self.offset == 0 && self.bytes() == self.buffer.len()
    }

    fn check_len(&self, found: usize) -> Result<()> {
        if found != self.numel() {
            return Err(TensorError::HostLength {
                shape: self.shape.to_vec(),
                expected: self.numel(),
                found,
            });
        }
        Ok(())
    }

    fn check_dtype(&self, op: &'static str, dtype: DType) -> Result<()> {
        if self.dtype != dtype {
            return Err(TensorError::DType {
                op,
                operand: "tensor",
                expected: dtype,
                found: self.dtype,
            });
        }
        Ok(())
    }

    fn read_bytes<D: Device>(&self, device: &D) -> Result<Vec<u8>> {
        let mut raw = vec![0u8; self.bytes()];
        // Memory graft reused is the buffer's own error, checked before the device sees it.
        self.buffer.addr()?;
        self.buffer.read_at(device, self.offset, &mut raw)?;
        // The read raced with nothing on this thread, but the buffer may have been
        // invalidated before it: check again so stale bytes are never returned.
        self.buffer.addr()?;
        Ok(raw)
    }

    fn write_bytes<D: Device>(&self, device: &D, raw: &[u8]) -> Result<()> {
        // As in `read_bytes`: memory graft reused is the buffer's own error.
        self.buffer.addr()?;
        Ok(self.buffer.write_at(device, self.offset, raw)?)
    }

    /// Copies the tensor to the host as f32s (synchronizes the device).
    pub fn to_vec_f32<D: Device>(&self, device: &D) -> Result<Vec<f32>> {
        self.check_dtype("to_vec_f32", DType::F32)?;
        Ok(self
            .read_bytes(device)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Copies the tensor to the host as i32s (synchronizes the device).
    pub fn to_vec_i32<D: Device>(&self, device: &D) -> Result<Vec<i32>> {
        self.check_dtype("to_vec_i32", DType::I32)?;
        Ok(self
            .read_bytes(device)?
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Copies the tensor to the host as u32s (synchronizes the device).
    pub fn to_vec_u32<D: Device>(&self, device: &D) -> Result<Vec<u32>> {
        self.check_dtype("to_vec_u32", DType::U32)?;
        Ok(self
            .read_bytes(device)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Writes host f32s into the tensor (synchronously: not inside a captured body).
    pub fn write_f32<D: Device>(&self, device: &D, data: &[f32]) -> Result<()> {
        self.check_dtype("write_f32", DType::F32)?;
        self.check_len(data.len())?;
        let raw: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write_bytes(device, &raw)
    }

    /// Writes host i32s into the tensor (synchronously: not inside a captured body).
    pub fn write_i32<D: Device>(&self, device: &D, data: &[i32]) -> Result<()> {
        self.check_dtype("write_i32", DType::I32)?;
        self.check_len(data.len())?;
        let raw: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write_bytes(device, &raw)
    }

    /// Writes host u32s into the tensor (synchronously: not inside a captured body).
    pub fn write_u32<D: Device>(&self, device: &D, data: &[u32]) -> Result<()> {
        self.check_dtype("write_u32", DType::U32)?;
        self.check_len(data.len())?;
        let raw: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write_bytes(device, &raw)
    }
}

/// Where ops get their memory: inside a graft body the [`Ctx`] (graft's pool), eagerly a
/// [`Graft`] (its eager caching pool, [`Graft::alloc`]), or a [`Keep`] wrapper that holds on
/// to everything it hands out (for capturing a raw graph).
pub trait Alloc<D: Device> {
    /// `bytes` of device memory.
    fn alloc(&mut self, bytes: usize) -> Result<Buffer>;
}

/// An allocator outside any body, which also has the device: what host writes and graph
/// captures of their own need ([`Graft`], and [`Keep`] over one).
pub trait EagerAlloc<D: Device>: Alloc<D> {
    /// The device.
    fn device(&self) -> &D;
}

impl<D: Device> Alloc<D> for Ctx<'_, D> {
    fn alloc(&mut self, bytes: usize) -> Result<Buffer> {
        Ok(Ctx::alloc(self, bytes)?)
    }
}

impl<D: Device, M: Clone> Alloc<D> for Graft<D, M> {
    fn alloc(&mut self, bytes: usize) -> Result<Buffer> {
        Ok(Graft::alloc(self, bytes)?)
    }
}

impl<D: Device, M: Clone> EagerAlloc<D> for Graft<D, M> {
    fn device(&self) -> &D {
        Graft::device(self)
    }
}

/// An allocator that keeps a handle to every buffer it hands out, so none is freed (and so
/// none reused) while it lives: what a raw captured graph needs of its memory, which it
/// writes on every launch at the addresses it was captured with.
pub struct Keep<'a, D: Device, A: Alloc<D> + ?Sized> {
    inner: &'a mut A,
    kept: Vec<Buffer>,
    _device: std::marker::PhantomData<fn() -> D>,
}

impl<'a, D: Device, A: Alloc<D> + ?Sized> Keep<'a, D, A> {
    /// Wraps `inner`.
    pub fn new(inner: &'a mut A) -> Keep<'a, D, A> {
        Keep {
            inner,
            kept: Vec::new(),
            _device: std::marker::PhantomData,
        }
    }

    /// Every buffer handed out, in order.
    pub fn into_kept(self) -> Vec<Buffer> {
        self.kept
    }
}

impl<D: Device, A: Alloc<D> + ?Sized> Alloc<D> for Keep<'_, D, A> {
    fn alloc(&mut self, bytes: usize) -> Result<Buffer> {
        let b = self.inner.alloc(bytes)?;
        self.kept.push(b.clone());
        Ok(b)
    }
}

impl<D: Device, A: EagerAlloc<D> + ?Sized> EagerAlloc<D> for Keep<'_, D, A> {
    fn device(&self) -> &D {
        self.inner.device()
    }
}

impl<D: Device, A: Alloc<D> + ?Sized> fmt::Debug for Keep<'_, D, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keep")
            .field("kept", &self.kept.len())
            .finish_non_exhaustive()
    }
}
