//! [`Bindings`]: per step, tensors as bound to graft (its statics, its inputs, the caller's
//! output tensors), each re-bound only when the caller passes another tensor at a position:
//! the same tensors call after call cost one id comparison each and no allocation. Each step
//! also keeps a fingerprint of its bound tensors' layouts (dtype, dims, strides), updated
//! only when something is bound anew: graft tells buffers apart by address and length alone,
//! so a static passed under another layout (a reshape of the same storage) must change the
//! call's keys.

use candle_core::{Tensor, TensorId};

use super::keys::dtype_key;

/// One tensor as bound: its id, its layout's fingerprint and what it was bound as (graft's
/// external buffer over it).
#[derive(Debug)]
struct Bound<B> {
    id: TensorId,
    layout: u64,
    buffer: B,
}

/// Per registered step, tensors at positions as bound (`B`: graft's buffer in the engine).
#[derive(Debug)]
pub(crate) struct Bindings<B> {
    steps: Vec<Vec<Bound<B>>>,
    /// Per step, the fingerprint of its bound tensors' layouts, in position order.
    layouts: Vec<u64>,
}

impl<B> Default for Bindings<B> {
    fn default() -> Bindings<B> {
        Bindings {
            steps: Vec::new(),
            layouts: Vec::new(),
        }
    }
}

/// FNV-1a 64 over `words`, from `hash`.
fn fnv(hash: u64, words: impl IntoIterator<Item = u64>) -> u64 {
    words
        .into_iter()
        .fold(hash, |h, w| (h ^ w).wrapping_mul(0x0000_0100_0000_01b3))
}

const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// The fingerprint of `t`'s layout: dtype, rank, dims and strides (not its address).
fn layout_of(t: &Tensor) -> u64 {
    let layout = t.layout();
    let dims = layout.dims().iter().map(|&d| d as u64);
    let strides = layout.stride().iter().map(|&s| s as u64);
    let head = [dtype_key(t.dtype()), t.rank() as u64];
    fnv(FNV_BASIS, head.into_iter().chain(dims).chain(strides))
}

impl<B> Bindings<B> {
    /// Adds a step with nothing bound (steps are numbered in the order they are added).
    pub(crate) fn add_step(&mut self) {
        self.steps.push(Vec::new());
        self.layouts.push(FNV_BASIS);
    }

    /// The fingerprint of `step`'s bound tensors' layouts, for the call's keys.
    pub(crate) fn layout_key(&self, step: usize) -> u64 {
        self.layouts[step]
    }

    /// The number of steps.
    pub(crate) fn len(&self) -> usize {
        self.steps.len()
    }

    /// Makes the bound tensors of `step` the tensors `tensors`: a position keeps its buffer
    /// while the caller passes the same tensor there (one id comparison), and gets
    /// `bind(position, tensor)` otherwise, so graft sees the new address and never replays a
    /// graph recorded with the old one. Positions past `tensors` are unbound. On an error of
    /// `bind` the positions before it are bound and the failing one keeps its old buffer.
    pub(crate) fn bind<E>(
        &mut self,
        step: usize,
        tensors: &[&Tensor],
        mut bind: impl FnMut(usize, &Tensor) -> Result<B, E>,
    ) -> Result<(), E> {
        let bound = &mut self.steps[step];
        let mut changed = bound.len() > tensors.len();
        bound.truncate(tensors.len());
        let result = tensors.iter().enumerate().try_for_each(|(position, t)| {
            if bound.get(position).is_some_and(|b| b.id == t.id()) {
                return Ok(());
            }
            let fresh = Bound {
                id: t.id(),
                layout: layout_of(t),
                buffer: bind(position, t)?,
            };
            changed = true;
            match bound.get_mut(position) {
                Some(b) => *b = fresh,
                None => bound.push(fresh),
            }
            Ok(())
        });
        if changed {
            self.layouts[step] = fnv(FNV_BASIS, bound.iter().map(|b| b.layout));
        }
        result
    }

    /// The buffer bound for `step` at `position`.
    pub(crate) fn get(&self, step: usize, position: usize) -> Option<&B> {
        self.steps[step].get(position).map(|b| &b.buffer)
    }

    /// The buffers bound for `step`, in position order.
    pub(crate) fn buffers(&self, step: usize) -> impl Iterator<Item = &B> {
        self.steps[step].iter().map(|b| &b.buffer)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    fn tensor() -> Tensor {
        Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_same_tensor_keeps_its_buffer_and_another_is_bound_anew() {
        let (a, b, c) = (tensor(), tensor(), tensor());
        let mut bindings = Bindings::default();
        bindings.add_step();
        bindings.add_step();
        assert_eq!(bindings.len(), 2);
        let mut made = 0;
        let mut bind = |position: usize, _: &Tensor| -> Result<(usize, usize), ()> {
            made += 1;
            Ok((position, made))
        };
        bindings.bind(1, &[&a, &b], &mut bind).unwrap();
        assert_eq!(
            bindings.buffers(1).copied().collect::<Vec<_>>(),
            [(0, 1), (1, 2)]
        );
        // Same tensors: nothing is bound again.
        bindings.bind(1, &[&a, &b], &mut bind).unwrap();
        assert_eq!(
            bindings.buffers(1).copied().collect::<Vec<_>>(),
            [(0, 1), (1, 2)]
        );
        // Another tensor at position 1: only that position is bound anew.
        bindings.bind(1, &[&a, &c], &mut bind).unwrap();
        assert_eq!(
            bindings.buffers(1).copied().collect::<Vec<_>>(),
            [(0, 1), (1, 3)]
        );
        // Fewer statics: the positions past them are unbound.
        bindings.bind(1, &[&a], &mut bind).unwrap();
        assert_eq!(bindings.buffers(1).copied().collect::<Vec<_>>(), [(0, 1)]);
        assert_eq!(bindings.buffers(0).count(), 0);
    }

    /// The same storage under another layout (a reshape, a transpose) changes the step's
    /// layout key; the same layouts in other tensors, or the same tensors again, do not.
    #[test]
    fn a_static_under_another_layout_changes_the_layout_key() {
        let w = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
        let mut bindings = Bindings::default();
        bindings.add_step();
        let bind = |_: usize, _: &Tensor| Ok::<_, ()>(());
        bindings.bind(0, &[&w], bind).unwrap();
        let square = bindings.layout_key(0);
        bindings.bind(0, &[&w], bind).unwrap();
        assert_eq!(bindings.layout_key(0), square);
        let other = Tensor::ones((4, 4), DType::F32, &Device::Cpu).unwrap();
        bindings.bind(0, &[&other], bind).unwrap();
        assert_eq!(
            bindings.layout_key(0),
            square,
            "same layout, another tensor"
        );
        for changed in [
            w.t().unwrap(),
            w.reshape((2, 8)).unwrap(),
            w.to_dtype(DType::U32).unwrap(),
        ] {
            bindings.bind(0, &[&changed], bind).unwrap();
            assert_ne!(bindings.layout_key(0), square, "{:?}", changed.layout());
        }
        bindings.bind(0, &[&w, &w], bind).unwrap();
        let two = bindings.layout_key(0);
        bindings.bind(0, &[&w], bind).unwrap();
        assert_eq!(bindings.layout_key(0), square, "one static again");
        assert_ne!(two, square);
    }

    #[test]
    fn a_failing_bind_keeps_the_old_buffer_at_its_position() {
        let (a, b) = (tensor(), tensor());
        let mut bindings = Bindings::default();
        bindings.add_step();
        bindings.bind(0, &[&a], |_, _| Ok::<_, ()>(1)).unwrap();
        assert_eq!(
            bindings.bind(0, &[&b], |_, _| Err("no address")),
            Err("no address")
        );
        assert_eq!(bindings.buffers(0).copied().collect::<Vec<_>>(), [1]);
        // The old tensor is still the one bound: passing it binds nothing.
        bindings.bind(0, &[&a], |_, _| Err("bound again")).unwrap();
    }
}
