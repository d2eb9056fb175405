//! [`Statics`]: per step, the static tensors as bound to graft, re-bound only when the caller
//! passes another tensor at a position.

use candle_core::{Tensor, TensorId};

/// One static tensor as bound: its id and what it was bound as (graft's external buffer over
/// it, which keeps the tensor, so its memory stays allocated while graphs may use it).
#[derive(Debug)]
struct Bound<B> {
    id: TensorId,
    buffer: B,
}

/// Per registered step, its static tensors as bound (`B`: graft's buffer in the engine).
#[derive(Debug)]
pub(crate) struct Statics<B> {
    steps: Vec<Vec<Bound<B>>>,
}

impl<B> Default for Statics<B> {
    fn default() -> Statics<B> {
        Statics { steps: Vec::new() }
    }
}

impl<B> Statics<B> {
    /// Adds a step with nothing bound (steps are numbered in the order they are added).
    pub(crate) fn add_step(&mut self) {
        self.steps.push(Vec::new());
    }

    /// The number of steps.
    pub(crate) fn len(&self) -> usize {
        self.steps.len()
    }

    /// Makes the bound statics of `step` the tensors `tensors`: a position keeps its buffer
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
        let mut statics = Statics::default();
        statics.add_step();
        statics.add_step();
        assert_eq!(statics.len(), 2);
        let mut made = 0;
        let mut bind = |position: usize, _: &Tensor| -> Result<(usize, usize), ()> {
            made += 1;
            Ok((position, made))
        };
        statics.bind(1, &[&a, &b], &mut bind).unwrap();
        assert_eq!(
            statics.buffers(1).copied().collect::<Vec<_>>(),
            [(0, 1), (1, 2)]
        );
        // Same tensors: nothing is bound again.
        statics.bind(1, &[&a, &b], &mut bind).unwrap();
        assert_eq!(
            statics.buffers(1).copied().collect::<Vec<_>>(),
            [(0, 1), (1, 2)]
        );
        // Another tensor at position 1: only that position is bound anew.
        statics.bind(1, &[&a, &c], &mut bind).unwrap();
        assert_eq!(
            statics.buffers(1).copied().collect::<Vec<_>>(),
            [(0, 1), (1, 3)]
        );
        // Fewer statics: the positions past them are unbound.
        statics.bind(1, &[&a], &mut bind).unwrap();
        assert_eq!(statics.buffers(1).copied().collect::<Vec<_>>(), [(0, 1)]);
        assert_eq!(statics.buffers(0).count(), 0);
    }

    #[test]
    fn a_failing_bind_keeps_the_old_buffer_at_its_position() {
        let (a, b) = (tensor(), tensor());
        let mut statics = Statics::default();
        statics.add_step();
        statics.bind(0, &[&a], |_, _| Ok::<_, ()>(1)).unwrap();
        assert_eq!(
            statics.bind(0, &[&b], |_, _| Err("no address")),
            Err("no address")
        );
        assert_eq!(statics.buffers(0).copied().collect::<Vec<_>>(), [1]);
        // The old tensor is still the one bound: passing it binds nothing.
        statics.bind(0, &[&a], |_, _| Err("bound again")).unwrap();
    }
}
