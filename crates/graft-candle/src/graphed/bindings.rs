//! [`Bindings`]: per step, tensors as bound to graft (its statics, its inputs, the caller's
//! output tensors), each re-bound only when the caller passes another tensor at a position:
//! the same tensors call after call cost one id comparison each and no allocation.

use candle_core::{Tensor, TensorId};

/// One tensor as bound: its id and what it was bound as (graft's external buffer over it).
#[derive(Debug)]
struct Bound<B> {
    id: TensorId,
    buffer: B,
}

/// Per registered step, tensors at positions as bound (`B`: graft's buffer in the engine).
#[derive(Debug)]
pub(crate) struct Bindings<B> {
    steps: Vec<Vec<Bound<B>>>,
}

impl<B> Default for Bindings<B> {
    fn default() -> Bindings<B> {
        Bindings { steps: Vec::new() }
    }
}

impl<B> Bindings<B> {
    /// Adds a step with nothing bound (steps are numbered in the order they are added).
    pub(crate) fn add_step(&mut self) {
        self.steps.push(Vec::new());
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
        bound.truncate(tensors.len());
        for (position, t) in tensors.iter().enumerate() {
            if bound.get(position).is_some_and(|b| b.id == t.id()) {
                continue;
            }
            let fresh = Bound {
                id: t.id(),
                buffer: bind(position, t)?,
            };
            match bound.get_mut(position) {
                Some(b) => *b = fresh,
                None => bound.push(fresh),
            }
        }
        Ok(())
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
