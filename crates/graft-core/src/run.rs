//! Running a body eagerly: warmups (from the graph pool) and eager runs (outside it).

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use crate::buffer::Buffer;
use crate::ctx::{Ctx, RunKind, Scope};
use crate::device::Device;
use crate::error::{BodyError, CallError};
use crate::graft::{Frame, Graft, Outcome};
use crate::lifecycle::Phase;
use crate::reason::{Decision, EagerReason, WarmupReason};
use crate::signature::call_hash;
use crate::tree::Output;

impl<D: Device, M: Clone> Graft<D, M> {
    /// Runs the body eagerly from the graph pool.
    pub(crate) fn warmup<F, E>(
        &mut self,
        frame: &mut Frame<'_, F, M, E>,
        reason: WarmupReason,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        let function = frame.function;
        let _span =
            tracing::debug_span!("warmup", function = %self.functions[function].name, %reason)
                .entered();
        self.diverge_if_replayed(function);
        self.move_to(Phase::Warmup)?;
        self.log(function, None, Decision::Warmup(reason));
        self.run_body(frame, RunKind::Warmup)?;
        let f = &mut self.functions[function];
        f.sigs[frame.sig].warmups_done += 1;
        let call = call_hash(f, frame.sig, frame.addrs);
        f.warmed.note(self.generation, call);
        self.stats.warmups += 1;
        Ok(Outcome::Warmup)
    }

    /// Runs the body eagerly outside the graph pool.
    pub(crate) fn run_eager<F, E>(
        &mut self,
        frame: &mut Frame<'_, F, M, E>,
        reason: EagerReason,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        let _span = tracing::trace_span!("eager", function = %self.functions[frame.function].name)
            .entered();
        self.run_body(frame, RunKind::Eager)?;
        self.stats.eager_runs += 1;
        Ok(Outcome::Eager(reason))
    }

    /// Runs the body on the caller's inputs, allocating from the graph pool for a warmup and
    /// from the eager pool otherwise, and keeps track of every cell it allocated and still
    /// holds (also when it panics: then the panic continues afterwards).
    pub(crate) fn run_body<F, E>(
        &mut self,
        frame: &mut Frame<'_, F, M, E>,
        kind: RunKind,
    ) -> Result<(), CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        let ctx_inputs: Vec<Buffer> = frame.inputs.iter().map(|b| (*b).clone()).collect();
        let name = self.functions[frame.function].name.clone();
        let warmup = kind == RunKind::Warmup;
        let (pool, sibling) = if warmup {
            (self.pools.graph(), self.pools.eager())
        } else {
            (self.pools.eager(), self.pools.graph())
        };
        let mut ctx = Ctx {
            device: &self.device,
            inputs: &ctx_inputs,
            pool,
            sibling,
            function: &name,
            generation: self.generation,
            kind,
            allocs: Vec::new(),
            scope: Scope::Top,
        };
        let result = catch_unwind(AssertUnwindSafe(|| (frame.body)(&mut ctx)));
        let allocs = std::mem::take(&mut ctx.allocs);
        if warmup {
            self.pools.list_held(&allocs);
            self.pools.keep_loose(allocs);
        } else {
            self.pools.keep_eager(allocs);
        }
        let outputs = result
            .unwrap_or_else(|panic| resume_unwind(panic))
            .map_err(|source| CallError::Body {
                function: name,
                source,
            })?;
        match frame.dests.as_deref_mut() {
            Some(dests) => self.deliver_eagerly(dests, frame.function, outputs, frame.out),
            None => {
                frame.out.extend(outputs);
                Ok(())
            }
        }
    }
}
