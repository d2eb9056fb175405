//! Device-side loops and branches in a body: `Ctx::while_loop`, `if_then`, `if_else`, `switch`, run on the host when eager, captured as conditional nodes when recording.

use crate::buffer::Buffer;
use crate::ctx::{Ctx, RunKind, Scope};
use crate::device::{CORE, Conditional, Device, DeviceError, DeviceOp, ForkRule};
use crate::error::BodyError;

/// One body of a conditional: what [`Ctx::switch`] takes a slice of.
pub type Branch<'b, 'a, D, E> = &'b mut dyn FnMut(&mut Ctx<'a, D>) -> Result<(), BodyError<E>>;

impl<'a, D: Device> Ctx<'a, D> {
    /// Runs `body` again and again while the `u32` at the start of `flag` is not 0, tested
    /// before every iteration: the body must write `flag` on the device (0 to stop).
    ///
    /// Recorded, the whole loop is one conditional node: a replay runs every iteration on the
    /// device with no host round trip. Eagerly (a warmup, an eager run), graft reads `flag` on
    /// the host before each iteration, so both run the same iterations. The body runs once
    /// during the recording, and the device repeats it. Work that must outlive an iteration
    /// lives in buffers made before the loop; what the body allocates is its own iteration's.
    /// A conditional inside another's body is refused when recording
    /// (`ConditionalRule::Nested`): the call then runs eagerly, every level on the host.
    ///
    /// Nothing bounds the iterations: a body that never clears `flag` loops for ever, on the
    /// device as on the host. Count iterations in the condition (as a decoder's token limit
    /// does).
    ///
    /// # Errors
    /// The body's error; a `flag` that is not a valid buffer of this device of at least 4
    /// bytes (`DeviceError::InvalidArgument`); when recording, a device without conditional
    /// nodes (`DeviceError::Unavailable`) or a body holding what a conditional body cannot
    /// (`DeviceError::Conditional`): both end the recording and the call runs eagerly.
    pub fn while_loop<E>(
        &mut self,
        flag: &Buffer,
        mut body: impl FnMut(&mut Ctx<'a, D>) -> Result<(), BodyError<E>>,
    ) -> Result<(), BodyError<E>> {
        self.conditional(Conditional::While, flag, &mut [&mut body])
    }

    /// Runs `then` if the `u32` at the start of `flag` is not 0, decided on the device when
    /// recorded (see [`Ctx::while_loop`] for the rules).
    ///
    /// # Errors
    /// As [`Ctx::while_loop`].
    pub fn if_then<E>(
        &mut self,
        flag: &Buffer,
        mut then: impl FnMut(&mut Ctx<'a, D>) -> Result<(), BodyError<E>>,
    ) -> Result<(), BodyError<E>> {
        self.conditional(Conditional::If, flag, &mut [&mut then])
    }

    /// Runs `then` if the `u32` at the start of `flag` is not 0, else `otherwise`, decided on
    /// the device when recorded (see [`Ctx::while_loop`] for the rules).
    ///
    /// # Errors
    /// As [`Ctx::while_loop`].
    pub fn if_else<E>(
        &mut self,
        flag: &Buffer,
        mut then: impl FnMut(&mut Ctx<'a, D>) -> Result<(), BodyError<E>>,
        mut otherwise: impl FnMut(&mut Ctx<'a, D>) -> Result<(), BodyError<E>>,
    ) -> Result<(), BodyError<E>> {
        self.conditional(Conditional::IfElse, flag, &mut [&mut then, &mut otherwise])
    }

    /// Runs `cases[i]` for the `u32` `i` at the start of `index`, none if `i` is out of range,
    /// decided on the device when recorded (see [`Ctx::while_loop`] for the rules).
    ///
    /// # Errors
    /// As [`Ctx::while_loop`]; `DeviceError::InvalidArgument` for no cases.
    pub fn switch<E>(
        &mut self,
        index: &Buffer,
        cases: &mut [Branch<'_, 'a, D, E>],
    ) -> Result<(), BodyError<E>> {
        let Ok(n) = u32::try_from(cases.len()) else {
            return Err(invalid("a switch has more than u32::MAX cases").into());
        };
        if n == 0 {
            return Err(invalid("a switch needs at least one case").into());
        }
        self.conditional(Conditional::Switch(n), index, cases)
    }

    /// The one path of every conditional: refused inside a fork, else run with the body's
    /// scope marked as a conditional's (a fork there is refused), restored afterwards.
    fn conditional<E>(
        &mut self,
        kind: Conditional,
        selector: &Buffer,
        branches: &mut [Branch<'_, 'a, D, E>],
    ) -> Result<(), BodyError<E>> {
        if self.scope == Scope::Forked {
            return Err(DeviceError::Fork {
                op: DeviceOp::Conditional,
                rule: ForkRule::InConditional,
            }
            .into());
        }
        let outer = std::mem::replace(&mut self.scope, Scope::Conditional);
        let result = self.conditional_in_scope(kind, selector, branches);
        self.scope = outer;
        result
    }

    /// Captured as a node when recording, run on the host by the selector's value otherwise.
    fn conditional_in_scope<E>(
        &mut self,
        kind: Conditional,
        selector: &Buffer,
        branches: &mut [Branch<'_, 'a, D, E>],
    ) -> Result<(), BodyError<E>> {
        let device = self.device;
        let addr = selector.device_addr(DeviceOp::Conditional, device.id(), 0, 4)?;
        let span = tracing::debug_span!("conditional", %kind, kind_of_run = ?self.kind);
        let _span = span.enter();
        if self.kind == RunKind::Recording {
            device.begin_conditional(CORE, kind, addr)?;
            for (i, branch) in branches.iter_mut().enumerate() {
                if i > 0 {
                    device.next_branch(CORE)?;
                }
                branch(self)?;
            }
            device.end_conditional(CORE)?;
            return Ok(());
        }
        loop {
            let mut value = [0u8; 4];
            device.read(CORE, addr, &mut value)?;
            let Some(i) = kind.branch(u32::from_le_bytes(value)) else {
                return Ok(());
            };
            branches[i](self)?;
            if kind != Conditional::While {
                return Ok(());
            }
        }
    }
}

fn invalid(what: &'static str) -> DeviceError {
    DeviceError::InvalidArgument {
        op: DeviceOp::Conditional,
        what,
    }
}
