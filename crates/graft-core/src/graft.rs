//! The runtime: registration, and the executor of a call: validate, plan, carry the plan out.
//!
//! The decision is `plan.rs`'s; carrying it out is split by what a call does: `replay.rs`
//! (the fast path, verify mode), `record.rs` (capture), `run.rs` (warmup and eager runs),
//! `memory.rs` (the pools, restore, reset, the eager-memory API).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use foldhash::fast::FixedState;
use slotmap::SlotMap;

use crate::bucket::Bucket;
use crate::buffer::{Buffer, Cell};
use crate::config::{Config, FunctionSpec, Mode};
use crate::ctx::Ctx;
use crate::device::{CORE, Device, DevicePtr};
use crate::error::{BodyError, CallError, FunctionId};
use crate::group::Member;
use crate::lifecycle::{Phase, transition};
use crate::node_id::NodeId;
use crate::plan::{self, Action, Plan, View};
use crate::pool::Pool;
use crate::reason::{Decision, DecisionRecord, EagerReason, EvictReason, RecordReason};
use crate::stats::Stats;
use crate::tree::{self, Node, NodeKey, Output, Slots};

/// What a call did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// Replayed this node.
    Replayed(NodeId),
    /// Recorded this new node (and launched it once).
    Recorded(NodeId),
    /// Ran eagerly from the graph pool.
    Warmup,
    /// Ran eagerly outside the graph pool.
    Eager,
}

/// One signature of a function: input sizes and keys, and what graft learned about it.
pub(crate) struct Signature {
    pub(crate) sizes: Box<[usize]>,
    pub(crate) keys: Box<[u64]>,
    pub(crate) warmups_done: u32,
    pub(crate) eager: Option<EagerReason>,
    /// Copied inputs the body was found to write: recordings copy them back to the caller.
    pub(crate) mutated: Vec<usize>,
    /// Times the graph budget evicted this signature's recordings: each doubles the eager
    /// calls it needs before it records again (see [`Signature::warmups_needed`]).
    pub(crate) evictions: u32,
}

impl Signature {
    /// Warmups before the signature records: the configured count, and after evictions by
    /// the graph budget `max(count, 1) * 2^evictions` (at most 64 times): a signature the
    /// budget keeps evicting runs eagerly more often instead of evicting others in turn.
    pub(crate) fn warmups_needed(&self, configured: u32) -> u32 {
        match self.evictions {
            0 => configured,
            n => configured.max(1) << n.min(6),
        }
    }
}

pub(crate) struct Function {
    pub(crate) name: Arc<str>,
    pub(crate) spec: FunctionSpec,
    pub(crate) sigs: Vec<Signature>,
    /// Signatures by [`shape_hash`] of their sizes and keys, so a call that switches between
    /// many shapes (buckets) finds its signature with one lookup.
    by_shape: HashMap<u64, Vec<usize>, FixedState>,
    /// Has been the first call of a generation.
    pub(crate) root_level: bool,
    warned_signatures: bool,
    last_sig: usize,
}

impl Function {
    pub(crate) fn new(name: &str, spec: FunctionSpec) -> Function {
        Function {
            name: Arc::from(name),
            spec,
            sigs: Vec::new(),
            by_shape: HashMap::default(),
            root_level: false,
            warned_signatures: false,
            last_sig: 0,
        }
    }
}

/// A hash of a call's input sizes and keys (the signature's identity). Fixed-seeded, so the
/// ranks of a group hash one signature alike.
pub(crate) fn shape_hash(sizes: impl ExactSizeIterator<Item = usize>, keys: &[u64]) -> u64 {
    let mut h = FixedState::default().build_hasher();
    h.write_usize(sizes.len());
    sizes.for_each(|n| h.write_usize(n));
    keys.iter().for_each(|&k| h.write_u64(k));
    h.finish()
}

/// Everything one call carries through the executor: what was called, on what, the body,
/// and where the outputs go.
pub(crate) struct Frame<'c, F, M> {
    pub(crate) function: FunctionId,
    pub(crate) sig: usize,
    pub(crate) inputs: &'c [&'c Buffer],
    pub(crate) body: &'c mut F,
    pub(crate) out: &'c mut Vec<Output<M>>,
}

/// The graph-tree runtime over one device.
///
/// `M` is the framework's per-output metadata (shape, dtype, ...): opaque to graft, stored
/// per node at recording and handed back on replay. Keep it cheap to clone.
pub struct Graft<D: Device, M: Clone = ()> {
    pub(crate) device: D,
    pub(crate) config: Config,
    pub(crate) functions: Vec<Function>,
    pub(crate) nodes: SlotMap<NodeKey, Node<D::Graph, M>>,
    pub(crate) roots: Vec<Vec<NodeKey>>,
    pub(crate) slots: Slots,
    pub(crate) phase: Phase,
    pub(crate) generation: u64,
    pub(crate) graph_pool: Arc<Mutex<Pool>>,
    pub(crate) eager_pool: Arc<Mutex<Pool>>,
    /// After a replay the pool bookkeeping describes the last recording, not the memory in
    /// use: it must be restored before anything allocates from it.
    pub(crate) pool_stale: bool,
    /// Cells of graph-pool memory not owned by a node output slot (warmup outputs, held
    /// intermediates, placeholders handed to bodies). Pruned of unheld cells now and then.
    pub(crate) loose: Registry,
    /// Cells of eager-pool memory, so `Drop` can invalidate them.
    pub(crate) eager_cells: Registry,
    /// Graph-pool cells handed to callers or kept by bodies that may still be held: what a
    /// replay must invalidate when its graph overwrites them. Each cell appears once; cells
    /// nobody holds are dropped from the list by the next replay's scan, so a replay costs
    /// the number of held cells, however large the tree.
    pub(crate) handed: Vec<Arc<Cell>>,
    backward_pending: bool,
    warned_backward: bool,
    pub(crate) rerecords: HashMap<(Option<NodeKey>, FunctionId), u32>,
    pub(crate) eager_pairs: HashMap<(Option<NodeKey>, FunctionId), EagerReason>,
    pub(crate) stats: Stats,
    decisions: VecDeque<DecisionRecord>,
    /// Counts replays and recordings: the nodes' `last_used` stamps.
    pub(crate) clock: u64,
    /// Scratch for input addresses: reused so the fast path never allocates.
    pub(crate) addrs: Vec<DevicePtr>,
    /// This runtime's rank of a tensor-parallel group ([`Graft::join`]): recordings are
    /// agreed with the other ranks.
    pub(crate) member: Option<Member>,
}

/// Adds the held ones of `cells` not yet listed to `handed` (see [`Graft::handed`]).
pub(crate) fn list_held<'a>(
    handed: &mut Vec<Arc<Cell>>,
    cells: impl IntoIterator<Item = &'a Arc<Cell>>,
) {
    for c in cells {
        if c.is_held() && c.mark_listed() {
            handed.push(Arc::clone(c));
        }
    }
}

/// Cells graft must be able to invalidate, pruned of unheld ones once the list has doubled.
#[derive(Default)]
pub(crate) struct Registry {
    pub(crate) cells: Vec<Arc<Cell>>,
    pruned_at: usize,
}

impl Registry {
    /// Adds the held ones of `cells`.
    pub(crate) fn extend(&mut self, cells: impl IntoIterator<Item = Arc<Cell>>) {
        self.cells.extend(cells.into_iter().filter(|c| c.is_held()));
        if self.cells.len() >= 2 * self.pruned_at.max(32) {
            self.cells.retain(|c| c.is_held());
            self.pruned_at = self.cells.len();
        }
    }
}

impl<D: Device, M: Clone> std::fmt::Debug for Graft<D, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graft")
            .field("device", &self.device.describe())
            .field("phase", &self.phase)
            .field("generation", &self.generation)
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

pub(crate) fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<D: Device, M: Clone> Graft<D, M> {
    /// A runtime over `device` with `config`.
    pub fn new(device: D, config: Config) -> Graft<D, M> {
        let reservation = config.pool_reservation;
        Graft {
            device,
            config,
            functions: Vec::new(),
            nodes: SlotMap::with_key(),
            roots: Vec::new(),
            slots: Slots::default(),
            phase: Phase::Idle,
            generation: 1,
            graph_pool: Arc::new(Mutex::new(Pool::new(reservation))),
            eager_pool: Arc::new(Mutex::new(Pool::new(reservation))),
            pool_stale: false,
            loose: Registry::default(),
            eager_cells: Registry::default(),
            handed: Vec::new(),
            backward_pending: false,
            warned_backward: false,
            rerecords: HashMap::new(),
            eager_pairs: HashMap::new(),
            stats: Stats {
                generations: 1,
                ..Stats::default()
            },
            decisions: VecDeque::new(),
            addrs: Vec::new(),
            clock: 0,
            member: None,
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
        self.functions.push(Function::new(name, spec));
        self.roots.push(Vec::new());
        FunctionId(self.functions.len() - 1)
    }

    /// The name a function was registered with.
    pub fn function_name(&self, id: FunctionId) -> Option<&str> {
        self.functions.get(id.0).map(|f| &*f.name)
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
            nodes: self.nodes.len(),
            pool: lock(&self.graph_pool).stats(),
            eager_pool: lock(&self.eager_pool).stats(),
            ..self.stats
        }
    }

    /// The last non-replay decisions, oldest first (at most `Config::decision_log`).
    pub fn explain(&self) -> impl Iterator<Item = &DecisionRecord> {
        self.decisions.iter()
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
        // Every phase may move to Idle.
        let _ = transition(&mut self.phase, Phase::Idle);
        tracing::trace!(generation = self.generation, "new generation");
    }

    /// Moves the lifecycle (see [`transition`]).
    pub(crate) fn move_to(&mut self, to: Phase) -> Result<(), CallError> {
        transition(&mut self.phase, to)
    }

    pub(crate) fn log(&mut self, function: FunctionId, node: Option<NodeKey>, decision: Decision) {
        if self.config.decision_log == 0 {
            return;
        }
        if self.decisions.len() == self.config.decision_log {
            self.decisions.pop_front();
        }
        self.decisions.push_back(DecisionRecord {
            generation: self.generation,
            function: self.functions[function.0].name.clone(),
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
        out.clear();
        let sig = self.validate(function, inputs, keys)?;
        let plan = plan::plan(&self.view(), function, sig, &self.addrs);
        let mut frame = Frame {
            function,
            sig,
            inputs,
            body: &mut body,
            out,
        };
        let outcome = self.execute(plan, &mut frame)?;
        match self.functions[function.0].spec.mode {
            Mode::Forward => self.backward_pending = true,
            Mode::Backward => self.backward_pending = false,
            Mode::Inference => {}
        }
        Ok(outcome)
    }

    /// Checks the function and inputs (device, readability) and finds the signature; leaves
    /// the input addresses in `self.addrs`.
    fn validate(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
    ) -> Result<usize, CallError> {
        let Some(f) = self.functions.get(function.0) else {
            return Err(CallError::UnknownFunction { id: function });
        };
        if let Some(source) = self.device.take_sticky_error(CORE) {
            return Err(CallError::Sticky { source });
        }
        let device_id = self.device.id();
        self.addrs.clear();
        // One pass over the inputs: device, readability, and the sizes of the signature used
        // last (the usual case in a loop), so each input's cell is read once.
        let last = f.sigs.get(f.last_sig);
        let last_sizes = last.map_or(&[][..], |s| &s.sizes[..]);
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
                Ok(a) => self.addrs.push(a),
                Err(source) => {
                    return Err(CallError::InvalidInput {
                        function: f.name.clone(),
                        position,
                        source,
                    });
                }
            }
        }
        let same = |s: &Signature| plan::matches(&s.sizes, &s.keys, inputs, keys);
        let sig = match last {
            Some(s) if same_sizes && plan::same_keys(&s.keys, keys) => f.last_sig,
            _ => {
                let hash = shape_hash(inputs.iter().map(|b| b.len()), keys);
                let found = f
                    .by_shape
                    .get(&hash)
                    .and_then(|c| c.iter().copied().find(|&i| same(&f.sigs[i])));
                match found {
                    Some(i) => i,
                    None => {
                        let i = self.new_signature(function, inputs, keys)?;
                        let f = &mut self.functions[function.0];
                        f.by_shape.entry(hash).or_default().push(i);
                        i
                    }
                }
            }
        };
        self.functions[function.0].last_sig = sig;
        Ok(sig)
    }

    /// What the planner reads.
    pub(crate) fn view(&self) -> View<'_, D::Graph, M> {
        View {
            phase: self.phase,
            config: &self.config,
            functions: &self.functions,
            nodes: &self.nodes,
            roots: &self.roots,
            slots: &self.slots,
            backward_pending: self.backward_pending,
            eager_pairs: &self.eager_pairs,
            rerecords: &self.rerecords,
        }
    }

    /// Carries out a plan.
    fn execute<F>(&mut self, plan: Plan, frame: &mut Frame<'_, F, M>) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let function = frame.function;
        if plan.backward_blocked && !self.warned_backward {
            self.warned_backward = true;
            tracing::warn!(
                function = %self.functions[function.0].name,
                "outputs from a previous step still need a backward; call mark_step_begin or run backward"
            );
        }
        if plan.new_generation {
            self.new_generation();
        }
        let eager_signature = self.functions[function.0].sigs[frame.sig].eager.is_some();
        if self.phase == Phase::Idle && !eager_signature {
            self.functions[function.0].root_level = true;
        }
        match plan.action {
            Action::Replay(key) if self.config.verify_replays => self.replay_verified(key, frame),
            Action::Replay(key) => self.replay(key, frame.inputs, frame.out),
            Action::Warmup(reason) => self.warmup(frame, reason),
            Action::Record { parent, reason } => {
                if reason.is_unexpected() {
                    *self.rerecords.entry((parent, function)).or_insert(0) += 1;
                }
                let replaced = self.replaced_by(frame, parent, &reason);
                let mut reuse = replaced.and_then(|k| self.evict(k, EvictReason::Replaced));
                match self.make_room(function, parent) {
                    Ok(evicted) => reuse = reuse.or(evicted),
                    Err(limit) => {
                        let why = EagerReason::GraphBudget { limit };
                        tracing::debug!(reason = %why, "graph budget full: running eagerly");
                        self.log(function, parent, Decision::Eager(why));
                        return self.run_eager(frame);
                    }
                }
                self.record(frame, parent, reason, reuse)
            }
            Action::Eager {
                reason,
                new_fallback,
            } => {
                if new_fallback {
                    self.fall_back(function, self.phase.tip().map(crate::tree::key_of), reason);
                }
                self.run_eager(frame)
            }
        }
    }

    /// With [`Config::replace_moved_static`], the node a re-recording for a moved static
    /// input replaces: the candidate that failed for that reason.
    fn replaced_by<F>(
        &self,
        frame: &Frame<'_, F, M>,
        parent: Option<NodeKey>,
        reason: &RecordReason,
    ) -> Option<NodeKey> {
        let moved = matches!(reason, RecordReason::StaticAddressChanged { .. });
        if !self.config.replace_moved_static || !moved {
            return None;
        }
        let candidates = self.slots.get(&(parent, frame.function, frame.sig))?;
        candidates.iter().copied().find(|&k| {
            tree::check(&self.nodes, &self.nodes[k], &self.addrs)
                .err()
                .as_ref()
                == Some(reason)
        })
    }

    /// The (parent, function) pair runs eagerly for good (the re-record limit was exceeded).
    fn fall_back(&mut self, function: FunctionId, parent: Option<NodeKey>, why: EagerReason) {
        let _span =
            tracing::info_span!("fallback", function = %self.functions[function.0].name).entered();
        tracing::warn!(reason = %why, "function runs eagerly from now on at this point of the tree");
        self.stats.fallbacks += 1;
        self.log(function, parent, Decision::Eager(why.clone()));
        self.eager_pairs.insert((parent, function), why);
    }

    /// Adds a signature for these inputs and keys, checking the bucket of a function with
    /// buckets (the signature of a size above the largest bucket is eager).
    fn new_signature(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
    ) -> Result<usize, CallError> {
        let f = &mut self.functions[function.0];
        let above = match (&f.spec.buckets, keys.first()) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(CallError::MissingBucket {
                    function: f.name.clone(),
                });
            }
            (Some(b), Some(&size)) => match usize::try_from(size).map(|s| b.pick(s)) {
                Ok(Bucket::Padded(bucket)) if bucket as u64 == size => None,
                Ok(Bucket::Padded(bucket)) => {
                    return Err(CallError::NotABucket {
                        function: f.name.clone(),
                        size,
                        bucket,
                    });
                }
                Ok(Bucket::Above { .. }) | Err(_) => Some(EagerReason::AboveLargestBucket {
                    size,
                    largest: b.largest(),
                }),
            },
        };
        let eager = if above.is_some() {
            above
        } else if f.spec.eager_only {
            Some(EagerReason::Registered)
        } else if let Some(allow) = &self.config.allow_list {
            let listed = allow.iter().any(|e| {
                *e.function == *f.name && e.keys.as_ref().is_none_or(|k| k.as_slice() == keys)
            });
            (!listed).then_some(EagerReason::NotAllowListed)
        } else {
            None
        };
        if let Some(why) = &eager {
            tracing::debug!(function = %f.name, reason = %why, "a new signature runs eagerly");
        }
        let logged = eager.clone();
        f.sigs.push(Signature {
            sizes: inputs.iter().map(|b| b.len()).collect(),
            keys: keys.into(),
            warmups_done: 0,
            eager,
            mutated: Vec::new(),
            evictions: 0,
        });
        // Buckets bound the signatures by design: no warning for them.
        let limit = match &f.spec.buckets {
            Some(b) => self.config.signature_warn_limit.max(b.sizes().len()),
            None => self.config.signature_warn_limit,
        };
        if f.sigs.len() > limit && !f.warned_signatures {
            f.warned_signatures = true;
            tracing::warn!(
                function = %f.name,
                signatures = f.sigs.len(),
                "function called with more distinct signatures than the warn limit; pad or bucket the inputs to fewer shapes"
            );
        }
        let sig = f.sigs.len() - 1;
        if let Some(why) = logged {
            self.log(function, None, Decision::Eager(why));
        }
        Ok(sig)
    }

    /// The bucket a call of `function` with real size `size` runs at: pad the inputs to
    /// [`Bucket::size`] and pass it as `keys[0]`.
    pub fn bucket(&self, function: FunctionId, size: usize) -> Result<Bucket, CallError> {
        let Some(f) = self.functions.get(function.0) else {
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
