//! The runtime: registration, and the executor of a call: validate, plan, carry the plan out.
//!
//! `Graft` owns its parts: the tree (`tree/`), the signatures (`signature.rs`), the pools and
//! the cells out of them (`pools.rs`), what the runtime learned about its calls
//! (`policy.rs`). The decision is `plan.rs`'s (with the graph budget's, `admit.rs`), made
//! over a read-only `View`; carrying it out is split by what a call does: `replay.rs` (the
//! fast path, verify mode), `record/` (capture), `run.rs` (warmup and eager runs),
//! `evict.rs` (the budget's evictions), `memory.rs` (restore, reset, the eager-memory API).

use crate::bucket::Bucket;
use crate::buffer::Buffer;
use crate::churn::Moved;
use crate::config::{Config, FunctionSpec, Mode};
use crate::ctx::Ctx;
use crate::destinations::Destinations;
use crate::device::{CORE, Device, DevicePtr};
use crate::error::{BodyError, CallError, FunctionId};
use crate::group::Member;
use crate::guard::GuardFinding;
use crate::lifecycle::{Phase, Refused, transition};
use crate::node_id::NodeId;
use crate::plan::{self, Action, Plan};
use crate::policy::Policy;
use crate::pools::{Pools, lock};
use crate::reason::{Decision, DecisionRecord, EagerReason, RecordReason, WarmupReason};
use crate::signature::Functions;
use crate::stats::Stats;
use crate::tree::{NodeKey, Output, Tree, key_of};
use crate::view::View;

/// Path warmups and recordings in one generation at which graft warns that the step's function
/// never starts a generation: several times a first step of per-layer functions (a few per
/// layer, a hundred-odd layers).
const GROWTH_WARN_CALLS: u32 = 1024;

/// What a call did.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// Replayed this node.
    Replayed(NodeId),
    /// Recorded this new node (and launched it once).
    Recorded(NodeId),
    /// Ran eagerly from the graph pool.
    Warmup,
    /// Ran eagerly outside the graph pool, for this reason.
    Eager(EagerReason),
}

/// Everything one call carries through the executor: what was called, on what (the input
/// buffers and their addresses, read once by `Graft::validate`), the body, and where the
/// outputs go (with `dests`, into memory the caller gives per output: see
/// [`Graft::call_owned`]). `E` is the framework's error type.
pub(crate) struct Frame<'c, F, M, E> {
    pub(crate) function: FunctionId,
    pub(crate) sig: usize,
    pub(crate) inputs: &'c [&'c Buffer],
    /// The inputs' addresses, in order.
    pub(crate) addrs: &'c [DevicePtr],
    pub(crate) body: &'c mut F,
    pub(crate) dests: Option<&'c mut dyn Destinations<M, E>>,
    pub(crate) out: &'c mut Vec<Output<M>>,
}

/// The graph-tree runtime over one device.
///
/// `M` is the framework's per-output metadata (shape, dtype, ...): opaque to graft, stored
/// per node at recording and handed back on replay. Keep it cheap to clone.
pub struct Graft<D: Device, M: Clone = ()> {
    pub(crate) device: D,
    pub(crate) config: Config,
    pub(crate) functions: Functions,
    pub(crate) tree: Tree<D::Graph, M>,
    pub(crate) phase: Phase,
    pub(crate) generation: u64,
    /// The pools and the cells out of them.
    pub(crate) pools: Pools,
    backward_pending: bool,
    warned_backward: bool,
    /// Calls of this generation that warmed up because the path was warming up, or recorded:
    /// at [`GROWTH_WARN_CALLS`], the step's function never starts a generation (warn once).
    growth: u32,
    warned_growth: bool,
    /// Re-recordings, fallbacks, the use counts' aging, the decision log.
    pub(crate) policy: Policy,
    pub(crate) stats: Stats,
    /// Counts replays and recordings: the nodes' `last_used` stamps.
    pub(crate) clock: u64,
    /// Capacity for a call's input addresses: lent to each call, which reads the addresses
    /// into it and carries them in its [`Frame`], and taken back, so the fast path never
    /// allocates. What it holds between calls is never read.
    scratch: Vec<DevicePtr>,
    /// This runtime's rank of a tensor-parallel group ([`Graft::join`]): recordings are
    /// agreed with the other ranks.
    pub(crate) member: Option<Member>,
    /// The next call that would replay is guarded ([`Graft::guard_next_call`]).
    pub(crate) guard_requested: bool,
    /// What guards found, each value once ([`Graft::guard_findings`]).
    pub(crate) guard_findings: Vec<GuardFinding>,
}

impl<D: Device, M: Clone> std::fmt::Debug for Graft<D, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graft")
            .field("device", &self.device.describe())
            .field("phase", &self.phase)
            .field("generation", &self.generation)
            .field("nodes", &self.tree.len())
            .finish_non_exhaustive()
    }
}

impl<D: Device, M: Clone> Graft<D, M> {
    /// A runtime over `device` with `config`.
    pub fn new(device: D, config: Config) -> Graft<D, M> {
        let reservation = config.pool_reservation;
        let policy = Policy::new(config.decision_log);
        Graft {
            device,
            config,
            functions: Functions::default(),
            tree: Tree::default(),
            phase: Phase::Idle,
            generation: 1,
            pools: Pools::new(reservation),
            backward_pending: false,
            warned_backward: false,
            growth: 0,
            warned_growth: false,
            policy,
            stats: Stats {
                generations: 1,
                ..Stats::default()
            },
            scratch: Vec::new(),
            clock: 0,
            member: None,
            guard_requested: false,
            guard_findings: Vec::new(),
        }
    }

    /// Makes this runtime one rank of a tensor-parallel group: from now on every recording
    /// ends with a vote of all ranks (see [`Member`]), so that all keep it, all fall back to
    /// eager, or all return an error, before any launches it. Replays take no vote. Join
    /// before the first call; joining again replaces the membership.
    pub fn join(&mut self, member: Member) {
        self.member = Some(member);
    }

    /// This runtime's group membership, if it joined one.
    pub fn member(&self) -> Option<&Member> {
        self.member.as_ref()
    }

    /// The device this runtime drives.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Registers a function and returns its id. Names need not be unique; they appear in
    /// errors, logs and dumps.
    pub fn register(&mut self, name: &str, spec: FunctionSpec) -> FunctionId {
        self.tree.add_function();
        self.functions.register(name, spec)
    }

    /// The name a function was registered with.
    pub fn function_name(&self, id: FunctionId) -> Option<&str> {
        self.functions.get(id).map(|f| &*f.name)
    }

    /// The current generation (step). Starts at 1.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Where the path stands.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// A snapshot of the counters, with pool statistics.
    pub fn stats(&self) -> Stats {
        Stats {
            nodes: self.tree.len(),
            pool: lock(self.pools.graph()).stats(),
            eager_pool: lock(self.pools.eager()).stats(),
            ..self.stats
        }
    }

    /// Guards the next call that would replay (outside a group): it captures the body again
    /// and compares the capture with the recording, as a scheduled guard does (see
    /// [`Config::guards`]), whether or not guards are on.
    pub fn guard_next_call(&mut self) {
        self.guard_requested = true;
    }

    /// The host values guards found baked into recordings, each once, oldest first (see
    /// [`Config::guards`]).
    pub fn guard_findings(&self) -> &[GuardFinding] {
        &self.guard_findings
    }

    /// The last non-replay decisions, oldest first (at most `Config::decision_log`).
    pub fn explain(&self) -> impl Iterator<Item = &DecisionRecord> {
        self.policy.decisions()
    }

    /// Starts a new generation: outputs of earlier steps become stale. They stay readable
    /// until graft must reuse their memory, and are invalidated before it does.
    pub fn mark_step_begin(&mut self) {
        self.backward_pending = false;
        self.new_generation();
    }

    pub(crate) fn new_generation(&mut self) {
        self.generation += 1;
        self.stats.generations += 1;
        self.growth = 0;
        // Every phase may move to Idle.
        let _: Result<(), Refused> = transition(&mut self.phase, Phase::Idle);
        tracing::trace!(generation = self.generation, "new generation");
    }

    /// Moves the lifecycle (see [`transition`]).
    pub(crate) fn move_to<E>(&mut self, to: Phase) -> Result<(), CallError<E>> {
        transition(&mut self.phase, to)
            .map_err(|Refused { from, to }| CallError::State { from, to })
    }

    pub(crate) fn log(&mut self, function: FunctionId, node: Option<NodeKey>, decision: Decision) {
        if !self.policy.logs() {
            return;
        }
        self.policy.log(DecisionRecord {
            generation: self.generation,
            function: self.functions[function].name.clone(),
            node: node.map(NodeKey::id),
            decision,
        });
    }

    /// Calls a registered function: warms it up, records it, or replays a recorded graph,
    /// as the tree decides. Returns the outputs (see [`Graft::call_into`] for the
    /// allocation-free form).
    pub fn call<F>(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
        body: F,
    ) -> Result<Vec<Output<M>>, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let mut out = Vec::new();
        self.call_into(function, inputs, keys, body, &mut out)?;
        Ok(out)
    }

    /// Like [`Graft::call`], writing the outputs into `out` (cleared first) and returning
    /// what was done. Reusing `out` across calls keeps the replay path free of allocation.
    ///
    /// `keys` are integers the framework adds to the signature (shapes, bucket sizes): a
    /// replay needs the same function, input sizes and keys. `body` runs the function on a
    /// [`Ctx`]; on a replay it is not run.
    pub fn call_into<F>(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
        mut body: F,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        self.call_with(function, inputs, keys, &mut body, None, out)
    }

    /// Like [`Graft::call_into`], with every output delivered into memory the caller gives
    /// for it: before each launch (and after each eager run of the body) graft asks `dests`
    /// for a buffer per output, usually the framework's own fresh tensor
    /// ([`Buffer::external`]), and the graph's last copy for that output writes it. The
    /// caller owns every output: no later replay writes it, so none is ever invalidated, and
    /// each costs one copy, inside the graph. `out` gets `dests`' buffers with the outputs'
    /// metadata, in order.
    ///
    /// `E` is the framework's own error type, which the body returns in
    /// [`BodyError::Framework`] and `dests` on failure: it comes back as it was, in
    /// [`CallError::Body`] or [`CallError::Destination`].
    pub fn call_owned<F, E, S>(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
        mut body: F,
        dests: &mut S,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
        S: Destinations<M, E>,
    {
        self.call_with(function, inputs, keys, &mut body, Some(dests), out)
    }

    fn call_with<F, E>(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
        body: &mut F,
        dests: Option<&mut dyn Destinations<M, E>>,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        out.clear();
        let mut addrs = std::mem::take(&mut self.scratch);
        addrs.clear();
        let called = self
            .validate(function, inputs, &mut addrs, keys)
            .and_then(|sig| {
                let mut frame = Frame {
                    function,
                    sig,
                    inputs,
                    addrs: &addrs,
                    body,
                    dests: dests.map(|d| d as &mut dyn Destinations<M, E>),
                    out,
                };
                self.call_frame(&mut frame)
            });
        self.scratch = addrs;
        called
    }

    /// A validated call: plans it and carries the plan out.
    fn call_frame<F, E>(&mut self, frame: &mut Frame<'_, F, M, E>) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        let function = frame.function;
        let plan = plan::plan(&self.view(), function, frame.sig, frame.addrs);
        let outcome = self
            .execute(plan, frame)
            .map_err(|e| self.blame_group(function, e))?;
        match self.functions[function].spec.mode {
            Mode::Forward => self.backward_pending = true,
            Mode::Backward => self.backward_pending = false,
            Mode::Inference => {}
        }
        Ok(outcome)
    }

    /// Checks the function and inputs (device, readability) and finds the signature; pushes
    /// the input addresses onto `addrs`.
    fn validate<E>(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        addrs: &mut Vec<DevicePtr>,
        keys: &[u64],
    ) -> Result<usize, CallError<E>> {
        let Some(f) = self.functions.get(function) else {
            return Err(CallError::UnknownFunction { id: function });
        };
        if let Some(source) = self.device.take_sticky_error(CORE) {
            return Err(CallError::Sticky { source });
        }
        // A broken group refuses every call, replays included: their collectives would wait on
        // a lost peer, or run on an aborted communicator.
        if let Some(m) = &self.member
            && m.is_broken()
            && let Some(source) = m.refuse()
        {
            return Err(CallError::Group {
                function: f.name.clone(),
                source,
            });
        }
        let device_id = self.device.id();
        // One pass over the inputs: device, readability, and the sizes of the signature used
        // last (the usual case in a loop), so each input's cell is read once.
        let last_sizes = f.last_sizes();
        let mut same_sizes = last_sizes.len() == inputs.len();
        for (position, b) in inputs.iter().enumerate() {
            same_sizes &= last_sizes.get(position) == Some(&b.len());
            if b.device() != device_id {
                return Err(CallError::WrongDevice {
                    function: f.name.clone(),
                    position,
                    expected: device_id,
                    found: b.device(),
                });
            }
            match b.addr() {
                Ok(a) => addrs.push(a),
                Err(source) => {
                    return Err(CallError::InvalidInput {
                        function: f.name.clone(),
                        position,
                        source,
                    });
                }
            }
        }
        let found = self
            .functions
            .signature(function, inputs, keys, same_sizes, &self.config)?;
        if let Some(why) = found.new_eager {
            self.log(function, None, Decision::Eager(why));
        }
        Ok(found.sig)
    }

    /// A call that failed while its group broke (a watchdog found a peer gone and aborted the
    /// communicator under the body's collective) reports the group's error, which names the
    /// lost rank, rather than the aborted collective's.
    fn blame_group<E>(&self, function: FunctionId, error: CallError<E>) -> CallError<E> {
        match (&error, self.member.as_ref().and_then(Member::refuse)) {
            (CallError::Group { .. }, _) | (_, None) => error,
            (_, Some(source)) => CallError::Group {
                function: self.functions[function].name.clone(),
                source,
            },
        }
    }

    /// What the planner reads.
    pub(crate) fn view(&self) -> View<'_, D::Graph, M> {
        View {
            phase: self.phase,
            config: &self.config,
            functions: &self.functions,
            tree: &self.tree,
            policy: &self.policy,
            backward_pending: self.backward_pending,
            generation: self.generation,
            replays: self.stats.replays,
        }
    }

    /// Carries out a plan.
    fn execute<F, E>(
        &mut self,
        plan: Plan,
        frame: &mut Frame<'_, F, M, E>,
    ) -> Result<Outcome, CallError<E>>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError<E>>,
    {
        let function = frame.function;
        if plan.backward_blocked && !self.warned_backward {
            self.warned_backward = true;
            tracing::warn!(
                function = %self.functions[function].name,
                "outputs from a previous step still need a backward; call mark_step_begin or run backward"
            );
        }
        if plan.new_generation {
            self.new_generation();
        }
        let eager_signature = self.functions[function].sigs[frame.sig].eager.is_some();
        if self.phase == Phase::Idle && !eager_signature {
            self.functions[function].root_level = true;
        }
        // Every call that does not replay stamps and counts its signature (a replay is
        // counted by its node: see `admit.rs`).
        match plan.action {
            Action::Replay(key) if self.config.verify_replays => self.replay_verified(key, frame),
            Action::Replay(key) if self.guard_due(key) => self.guard(key, frame),
            Action::Replay(key) => self.replay(key, frame),
            Action::Warmup(reason) => {
                self.count_off_replay(function, frame.sig);
                if reason == WarmupReason::PathWarmingUp {
                    self.count_growth(function);
                }
                self.warmup(frame, reason)
            }
            Action::Record {
                parent,
                reason,
                evicts,
            } => {
                self.count_off_replay(function, frame.sig);
                self.count_miss(function, frame.sig, parent, &reason);
                self.count_growth(function);
                let reuse = self.make_room(function, &evicts);
                self.record(frame, parent, reason, reuse)
            }
            Action::OverBudget {
                parent,
                reason,
                evicts,
                why,
            } => {
                self.count_off_replay(function, frame.sig);
                self.count_miss(function, frame.sig, parent, &reason);
                drop(self.make_room(function, &evicts));
                self.stats.over_budget += 1;
                let f = &mut self.functions[function];
                // Every graph on the current path: a step that repeats it meets the same full
                // budget every time, so this call runs eagerly on every step from now on.
                if let EagerReason::GraphBudget { limit } = &why
                    && !f.warned_budget
                {
                    f.warned_budget = true;
                    tracing::warn!(
                        function = %f.name, limit,
                        "the graph budget is full with graphs of the current path, so this call of the function runs eagerly, and will on every step that takes the same path: raise Config::max_graphs (or FunctionSpec::max_graphs) to at least the graphs one step records"
                    );
                }
                tracing::debug!(
                    function = %self.functions[function].name,
                    reason = %why,
                    "graph budget full: running eagerly"
                );
                self.log(function, parent, Decision::Eager(why.clone()));
                self.run_eager(frame, why)
            }
            Action::Eager {
                reason,
                new_fallback,
            } => {
                self.count_off_replay(function, frame.sig);
                if new_fallback {
                    self.fall_back(function, self.phase.tip().map(key_of), reason.clone());
                }
                self.run_eager(frame, reason)
            }
        }
    }

    /// Counts a call that grows this generation's path (a warmup of a warming path, a
    /// recording); warns once when a generation reaches [`GROWTH_WARN_CALLS`] calls, the
    /// sign of a step function whose calls never repeat (its static inputs move on every
    /// call), so each continues the path instead of starting the next step.
    fn count_growth(&mut self, function: FunctionId) {
        self.growth = self.growth.saturating_add(1);
        if self.growth >= GROWTH_WARN_CALLS && !self.warned_growth {
            self.warned_growth = true;
            tracing::warn!(
                function = %self.functions[function].name,
                calls = self.growth,
                "one generation has warmed up or recorded {} calls without a new one; if each call of this function is a step, call mark_step_begin before it",
                self.growth
            );
        }
    }

    /// Whether the call that would replay `key` is guarded: a flag and one compare.
    #[inline]
    fn guard_due(&self, key: NodeKey) -> bool {
        let node = &self.tree[key];
        (self.guard_requested && self.member.is_none()) || node.guard.due(node.replays)
    }

    /// Counts a call that does not replay (and stamps its signature: `Function::touch`),
    /// first aging every use count if a window ended (see `admit.rs`): O(graphs +
    /// signatures), at most once per window.
    fn count_off_replay(&mut self, function: FunctionId, sig: usize) {
        let windows = self
            .policy
            .count_off_replay(self.stats.replays, self.config.budget_window);
        if windows > 0 {
            for f in self.functions.iter_mut() {
                f.sigs.iter_mut().for_each(|s| s.age(windows));
            }
            for n in self.tree.values_mut() {
                n.uses.age(n.replays, windows);
            }
            tracing::trace!(windows, "aged the graph budget's use counts");
        }
        self.functions[function].touch(sig);
    }

    /// A recording is due for `reason`: the watch hears of a moved static input, an in-place
    /// input a recording could not follow is copied by the signature's recordings from now on
    /// (so it replays wherever the caller's buffer is, instead of recording at each new
    /// address), and the re-record limit counts an unexpected miss.
    fn count_miss(
        &mut self,
        function: FunctionId,
        sig: usize,
        parent: Option<NodeKey>,
        reason: &RecordReason,
    ) {
        match *reason {
            RecordReason::StaticAddressChanged { position, .. } => {
                self.functions[function].moved(sig, Moved::Static, position);
            }
            RecordReason::OverlappingInputMoved { position, .. } => {
                self.functions[function].moved(sig, Moved::Overlapping, position);
            }
            RecordReason::InPlaceInputMoved { position, .. } => {
                let f = &mut self.functions[function];
                if f.spec.never_copy_inputs {
                    f.moved(sig, Moved::InPlace, position);
                } else if !f.sigs[sig].copy_in_place.contains(&position) {
                    tracing::debug!(
                        function = %f.name, position,
                        "an in-place input the graph cannot follow moved: recordings copy it from now on"
                    );
                    f.sigs[sig].copy_in_place.push(position);
                }
            }
            _ => {}
        }
        if reason.is_unexpected() {
            self.policy.count_rerecord(parent, function);
        }
    }

    /// The (parent, function) pair runs eagerly for good (the re-record limit was exceeded).
    fn fall_back(&mut self, function: FunctionId, parent: Option<NodeKey>, why: EagerReason) {
        let _span =
            tracing::info_span!("fallback", function = %self.functions[function].name).entered();
        tracing::warn!(reason = %why, "function runs eagerly from now on at this point of the tree");
        self.stats.fallbacks += 1;
        self.log(function, parent, Decision::Eager(why.clone()));
        self.policy.fall_back(parent, function, why);
    }

    /// The bucket a call of `function` with real size `size` runs at: pad the inputs to
    /// [`Bucket::size`] and pass it as `keys[0]`.
    pub fn bucket(&self, function: FunctionId, size: usize) -> Result<Bucket, CallError> {
        let Some(f) = self.functions.get(function) else {
            return Err(CallError::UnknownFunction { id: function });
        };
        match &f.spec.buckets {
            Some(b) => Ok(b.pick(size)),
            None => Err(CallError::NoBuckets {
                function: f.name.clone(),
            }),
        }
    }
}
