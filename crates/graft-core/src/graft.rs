//! The runtime: registration, the call algorithm (warmup, record, replay), generations,
//! pool restores and reset.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use slotmap::{KeyData, SlotMap};

use crate::buffer::{Buffer, Cell, NodeId};
use crate::config::{Config, FunctionSpec, Mode};
use crate::ctx::{Ctx, Reclaim, RunKind, alloc_owned};
use crate::device::{Device, DeviceError, DeviceOp, DevicePtr};
use crate::error::{BodyError, CallError, FunctionId, MemoryError, VerifyTarget};
use crate::pool::Pool;
use crate::reason::{Decision, DecisionRecord, EagerReason, RecordReason, WarmupReason};
use crate::stats::Stats;
use crate::tree::{self, InputSlot, Node, NodeKey, NodeOutput, Output, OutputSlot};

/// Where the path stands: the capture lifecycle, owned by core and moved only here.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Phase {
    /// Nothing has run in this generation: the next call starts at the roots.
    Idle,
    /// A call of this generation warmed up; the rest of the generation runs eagerly in the
    /// graph pool.
    Warmup,
    /// A body is being captured.
    Recording,
    /// The path is on the tree: its tip is the node recorded or replayed last.
    Replaying,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    Idle,
    Warmup,
    Recording { parent: Option<NodeKey> },
    Replaying { tip: NodeKey },
}

impl Path {
    fn phase(self) -> Phase {
        match self {
            Path::Idle => Phase::Idle,
            Path::Warmup => Phase::Warmup,
            Path::Recording { .. } => Phase::Recording,
            Path::Replaying { .. } => Phase::Replaying,
        }
    }

    fn tip(self) -> Option<NodeKey> {
        match self {
            Path::Replaying { tip } => Some(tip),
            Path::Recording { parent } => parent,
            Path::Idle | Path::Warmup => None,
        }
    }
}

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

pub(crate) struct Signature {
    pub(crate) sizes: Box<[usize]>,
    pub(crate) keys: Box<[u64]>,
    warmups_done: u32,
    eager: Option<EagerReason>,
}

impl Signature {
    #[inline]
    fn matches(&self, inputs: &[&Buffer], keys: &[u64]) -> bool {
        // Element loops, not slice equality: that calls memcmp, which costs more than the
        // handful of integers compared here.
        self.keys.len() == keys.len()
            && self.keys.iter().zip(keys).all(|(a, b)| a == b)
            && self.sizes.len() == inputs.len()
            && self.sizes.iter().zip(inputs).all(|(&s, b)| s == b.len())
    }
}

pub(crate) struct Function {
    pub(crate) name: Arc<str>,
    spec: FunctionSpec,
    pub(crate) sigs: Vec<Signature>,
    /// Has been the first call of a generation.
    root_level: bool,
    warned_signatures: bool,
    last_sig: usize,
}

/// The graph-tree runtime over one device.
///
/// `M` is the framework's per-output metadata (shape, dtype, ...): opaque to graft, stored
/// per node at recording and handed back on replay. Keep it cheap to clone.
pub struct Graft<D: Device, M: Clone = ()> {
    pub(crate) device: D,
    config: Config,
    pub(crate) functions: Vec<Function>,
    pub(crate) nodes: SlotMap<NodeKey, Node<D::Graph, M>>,
    pub(crate) roots: Vec<Vec<NodeKey>>,
    path: Path,
    pub(crate) generation: u64,
    pub(crate) graph_pool: Arc<Mutex<Pool>>,
    eager_pool: Arc<Mutex<Pool>>,
    /// After a replay the pool bookkeeping describes the last recording, not the memory in
    /// use: it must be restored before anything allocates from it.
    pool_stale: bool,
    /// Cells of graph-pool memory not owned by a node output slot (warmup outputs, held
    /// intermediates, placeholders handed to bodies). Pruned of unheld cells now and then.
    pub(crate) loose: Vec<Arc<Cell>>,
    loose_pruned_at: usize,
    /// Cells of eager-pool memory, so `Drop` can invalidate them.
    eager_cells: Vec<Arc<Cell>>,
    eager_pruned_at: usize,
    /// Bumped when a node or loose cell appears: nodes recompute their conflict lists lazily.
    epoch: u64,
    backward_pending: bool,
    warned_backward: bool,
    rerecords: HashMap<(Option<NodeKey>, FunctionId), u32>,
    eager_pairs: HashMap<(Option<NodeKey>, FunctionId), EagerReason>,
    stats: Stats,
    decisions: VecDeque<DecisionRecord>,
    /// Scratch for input addresses: reused so the fast path never allocates.
    addrs: Vec<DevicePtr>,
}

impl<D: Device, M: Clone> std::fmt::Debug for Graft<D, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graft")
            .field("device", &self.device.describe())
            .field("phase", &self.path.phase())
            .field("generation", &self.generation)
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    pool.lock().unwrap_or_else(PoisonError::into_inner)
}

fn key_of(id: NodeId) -> NodeKey {
    KeyData::from_ffi(id.0).into()
}

/// Drops cells nobody holds from a registry once it has doubled since the last pruning.
fn prune(cells: &mut Vec<Arc<Cell>>, pruned_at: &mut usize) {
    if cells.len() >= 2 * (*pruned_at).max(32) {
        cells.retain(|c| c.is_held());
        *pruned_at = cells.len();
    }
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
            path: Path::Idle,
            generation: 1,
            graph_pool: Arc::new(Mutex::new(Pool::new(reservation))),
            eager_pool: Arc::new(Mutex::new(Pool::new(reservation))),
            pool_stale: false,
            loose: Vec::new(),
            loose_pruned_at: 0,
            eager_cells: Vec::new(),
            eager_pruned_at: 0,
            epoch: 0,
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
        }
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
        self.functions.push(Function {
            name: Arc::from(name),
            spec,
            sigs: Vec::new(),
            root_level: false,
            warned_signatures: false,
            last_sig: 0,
        });
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
        self.path.phase()
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

    fn new_generation(&mut self) {
        self.generation += 1;
        self.stats.generations += 1;
        self.path = Path::Idle;
        tracing::trace!(generation = self.generation, "new generation");
    }

    /// Moves the path to `to`, refusing transitions the lifecycle does not have (leaving the
    /// state untouched).
    fn transition(&mut self, to: Path) -> Result<(), CallError> {
        let ok = !matches!(
            (self.path, to),
            (
                Path::Recording { .. },
                Path::Recording { .. } | Path::Warmup
            ) | (
                Path::Warmup,
                Path::Recording { .. } | Path::Replaying { .. }
            )
        );
        if ok {
            self.path = to;
            Ok(())
        } else {
            Err(CallError::State {
                from: self.path.phase(),
                to: to.phase(),
            })
        }
    }

    fn log(&mut self, function: FunctionId, node: Option<NodeKey>, decision: Decision) {
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
        let fi = function.0;
        let Some(f) = self.functions.get(fi) else {
            return Err(CallError::UnknownFunction { id: function });
        };
        if let Some(source) = self.device.take_sticky_error() {
            return Err(CallError::Sticky { source });
        }
        let device_id = self.device.id();
        self.addrs.clear();
        for (position, b) in inputs.iter().enumerate() {
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
        let sig = match f.sigs.get(f.last_sig) {
            Some(s) if s.matches(inputs, keys) => f.last_sig,
            _ => match f.sigs.iter().position(|s| s.matches(inputs, keys)) {
                Some(i) => i,
                None => self.new_signature(function, inputs, keys),
            },
        };
        self.functions[fi].last_sig = sig;
        let mode = self.functions[fi].spec.mode;
        let outcome = self.decide(function, sig, inputs, &mut body, out)?;
        match mode {
            Mode::Forward => self.backward_pending = true,
            Mode::Backward => self.backward_pending = false,
            Mode::Inference => {}
        }
        Ok(outcome)
    }

    /// The decision order of the call algorithm (see docs/architecture.md).
    fn decide<F>(
        &mut self,
        function: FunctionId,
        sig: usize,
        inputs: &[&Buffer],
        body: &mut F,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let fi = function.0;
        if self.functions[fi].sigs[sig].eager.is_some() {
            return self.run_eager(function, inputs, body, out);
        }
        let needed = self.functions[fi]
            .spec
            .warmups
            .unwrap_or(self.config.warmups);
        loop {
            let root_level = self.functions[fi].root_level;
            let warmed = self.functions[fi].sigs[sig].warmups_done >= needed;
            let tip = match self.path {
                Path::Recording { .. } => {
                    return Err(CallError::State {
                        from: Phase::Recording,
                        to: Phase::Recording,
                    });
                }
                Path::Warmup => {
                    if root_level && self.may_start_generation(function) {
                        self.new_generation();
                        continue;
                    }
                    return self.warmup(
                        function,
                        sig,
                        WarmupReason::PathWarmingUp,
                        inputs,
                        body,
                        out,
                    );
                }
                Path::Idle => {
                    self.functions[fi].root_level = true;
                    None
                }
                Path::Replaying { tip } => Some(tip),
            };
            let miss = if warmed {
                match self.find_candidate(tip, function, sig) {
                    Ok(key) if self.config.verify_replays => {
                        return self.replay_verified(key, inputs, body, out);
                    }
                    Ok(key) => return self.replay(key, inputs, out),
                    Err(miss) => Some(miss),
                }
            } else {
                None
            };
            if tip.is_some() && root_level && self.may_start_generation(function) {
                self.new_generation();
                continue;
            }
            let Some(reason) = miss else {
                let done = self.functions[fi].sigs[sig].warmups_done;
                return self.warmup(
                    function,
                    sig,
                    WarmupReason::FirstCalls { done, needed },
                    inputs,
                    body,
                    out,
                );
            };
            if let Some(reason) = self.eager_pairs.get(&(tip, function)) {
                let reason = reason.clone();
                tracing::trace!(function = %self.functions[fi].name, %reason, "eager fallback");
                return self.run_eager(function, inputs, body, out);
            }
            if reason.is_unexpected() {
                let limit = self.functions[fi]
                    .spec
                    .rerecord_limit
                    .unwrap_or(self.config.rerecord_limit);
                let count = self.rerecords.entry((tip, function)).or_insert(0);
                *count += 1;
                if *count > limit {
                    let why = EagerReason::RerecordLimit {
                        limit,
                        last: reason,
                    };
                    let _span =
                        tracing::info_span!("fallback", function = %self.functions[fi].name)
                            .entered();
                    tracing::warn!(reason = %why, "function runs eagerly from now on at this point of the tree");
                    self.stats.fallbacks += 1;
                    self.log(function, tip, Decision::Eager(why.clone()));
                    self.eager_pairs.insert((tip, function), why);
                    return self.run_eager(function, inputs, body, out);
                }
            }
            return self.record(function, sig, tip, reason, inputs, body, out);
        }
    }

    /// Whether a call of a root-level function may end the path and start a generation.
    fn may_start_generation(&mut self, function: FunctionId) -> bool {
        if !self.backward_pending {
            return true;
        }
        if !self.warned_backward {
            self.warned_backward = true;
            tracing::warn!(
                function = %self.functions[function.0].name,
                "outputs from a previous step still need a backward; call mark_step_begin or run backward"
            );
        }
        false
    }

    /// Finds the first candidate node whose invariants hold, or the reason the best one
    /// failed (a new signature when there is none).
    #[inline]
    fn find_candidate(
        &self,
        tip: Option<NodeKey>,
        function: FunctionId,
        sig: usize,
    ) -> Result<NodeKey, RecordReason> {
        let candidates = match tip {
            Some(t) => self.nodes[t].children_of(function),
            None => &self.roots[function.0],
        };
        let mut first_miss = None;
        let mut any_of_function = false;
        for &key in candidates {
            let node = &self.nodes[key];
            any_of_function = true;
            if node.sig != sig {
                continue;
            }
            match tree::check(&self.nodes, node, &self.addrs) {
                Ok(()) => return Ok(key),
                Err(reason) => {
                    first_miss.get_or_insert(reason);
                }
            }
        }
        Err(first_miss.unwrap_or(if any_of_function {
            RecordReason::NewSignature
        } else {
            RecordReason::FirstRecording
        }))
    }

    fn new_signature(&mut self, function: FunctionId, inputs: &[&Buffer], keys: &[u64]) -> usize {
        let f = &mut self.functions[function.0];
        let eager = if f.spec.eager_only {
            Some(EagerReason::Registered)
        } else if let Some(allow) = &self.config.allow_list {
            let listed = allow.iter().any(|e| {
                *e.function == *f.name && e.keys.as_ref().is_none_or(|k| k.as_slice() == keys)
            });
            (!listed).then_some(EagerReason::NotAllowListed)
        } else {
            None
        };
        f.sigs.push(Signature {
            sizes: inputs.iter().map(|b| b.len()).collect(),
            keys: keys.into(),
            warmups_done: 0,
            eager,
        });
        if f.sigs.len() > self.config.signature_warn_limit && !f.warned_signatures {
            f.warned_signatures = true;
            tracing::warn!(
                function = %f.name,
                signatures = f.sigs.len(),
                "function called with more distinct signatures than the warn limit; pad or bucket the inputs to fewer shapes"
            );
        }
        f.sigs.len() - 1
    }

    // ----- replay: the fast path -------------------------------------------------------

    fn replay(
        &mut self,
        key: NodeKey,
        inputs: &[&Buffer],
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError> {
        let _span = tracing::trace_span!("replay", node = ?key).entered();
        if self.nodes[key].conflicts_epoch != self.epoch {
            self.rebuild_conflicts(key);
        }
        let id = key.id();
        let function = self.nodes[key].function;
        let fail = |source| CallError::Device {
            function: self.functions[function.0].name.clone(),
            source,
        };
        let node = &mut self.nodes[key];
        // The graph copies the copied inputs itself; re-point a copy only if the caller's
        // buffer moved (in a loop it usually does not).
        let mut copied = 0;
        let mut repointed = 0;
        for (slot, &src) in node.inputs.iter_mut().zip(&self.addrs) {
            if let InputSlot::Copied {
                placeholder,
                len,
                source,
            } = slot
                && *len > 0
            {
                if *source != src {
                    self.device
                        .set_copy_source(&mut node.graph, *placeholder, src)
                        .map_err(fail)?;
                    *source = src;
                    repointed += 1;
                }
                copied += 1;
            }
        }
        let node = &self.nodes[key];
        let mut invalidated = 0;
        for &(k, o) in &node.slot_conflicts {
            if let OutputSlot::Tracked { cell, .. } = &self.nodes[k].outputs[o as usize].slot
                && cell.is_readable_by_someone()
            {
                cell.invalidate_overwritten(Some(id));
                invalidated += 1;
            }
        }
        for cell in &node.cell_conflicts {
            if cell.is_readable_by_someone() {
                cell.invalidate_overwritten(Some(id));
                invalidated += 1;
            }
        }
        self.device.launch(&node.graph).map_err(fail)?;
        self.stats.invalidations += invalidated;
        self.stats.copied_inputs += copied;
        self.stats.copy_sources_updated += repointed;
        let generation = self.generation;
        let node = &mut self.nodes[key];
        for i in 0..node.outputs.len() {
            let out_i = &mut node.outputs[i];
            let buffer = match &mut out_i.slot {
                OutputSlot::Tracked { cell, spares } => {
                    if cell.is_held() {
                        cell.invalidate_overwritten(Some(id));
                        let fresh = match spares.iter().position(|c| !c.is_held()) {
                            Some(j) => spares.swap_remove(j),
                            None => {
                                let c = Cell::new(
                                    cell.addr(),
                                    cell.len(),
                                    self.device.id(),
                                    self.functions[node.function.0].name.clone(),
                                    generation,
                                    Some(Arc::downgrade(&self.graph_pool)),
                                );
                                c.set_node(id);
                                c
                            }
                        };
                        spares.push(std::mem::replace(cell, fresh));
                    }
                    cell.recycle(generation);
                    Buffer::from_cell(cell)
                }
                OutputSlot::StaticInput(p) => (*inputs[*p]).clone(),
                OutputSlot::Alias(j) => out[*j].buffer.clone(),
                OutputSlot::Empty(cell) => Buffer::from_cell(cell),
            };
            out.push(Output {
                buffer,
                meta: out_i.meta.clone(),
            });
        }
        node.replays += 1;
        self.stats.replays += 1;
        self.pool_stale = true;
        self.path = Path::Replaying { tip: key };
        Ok(Outcome::Replayed(id))
    }

    /// Verify mode: snapshots the inputs into scratch memory, replays, runs the body eagerly
    /// on the snapshot, and compares every output and every input afterwards (bodies may
    /// update inputs in place, like a KV cache), byte for byte.
    fn replay_verified<F>(
        &mut self,
        key: NodeKey,
        inputs: &[&Buffer],
        body: &mut F,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let function = self.nodes[key].function;
        let name = self.functions[function.0].name.clone();
        let memory = |source: MemoryError| CallError::Verify {
            function: name.clone(),
            source,
        };
        let scratch = inputs
            .iter()
            .map(|b| self.copy_out(b))
            .collect::<Result<Vec<Buffer>, _>>()
            .map_err(memory)?;
        let outcome = self.replay(key, inputs, out)?;
        let scratch_refs: Vec<&Buffer> = scratch.iter().collect();
        let mut eager = Vec::new();
        self.run_body(function, &scratch_refs, body, RunKind::Eager, &mut eager)?;
        let pairs = out
            .iter()
            .map(|o| &o.buffer)
            .zip(eager.iter().map(|o| &o.buffer))
            .chain(inputs.iter().copied().zip(scratch.iter()));
        for (index, (replayed, reference)) in pairs.enumerate() {
            let a = self.read_bytes(replayed).map_err(memory)?;
            let b = self.read_bytes(reference).map_err(memory)?;
            if let Some(byte) = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x != y)
                .or((a.len() != b.len()).then_some(a.len().min(b.len())))
            {
                return Err(CallError::VerifyMismatch {
                    function: name,
                    node: key.id(),
                    what: if index < out.len() {
                        VerifyTarget::Output(index)
                    } else {
                        VerifyTarget::Input(index - out.len())
                    },
                    byte,
                });
            }
        }
        if out.len() != eager.len() {
            return Err(CallError::VerifyMismatch {
                function: name,
                node: key.id(),
                what: VerifyTarget::Output(out.len().min(eager.len())),
                byte: 0,
            });
        }
        Ok(outcome)
    }

    fn read_bytes(&self, buffer: &Buffer) -> Result<Vec<u8>, MemoryError> {
        let mut bytes = vec![0u8; buffer.len()];
        self.read(buffer, &mut bytes)?;
        Ok(bytes)
    }

    /// Recomputes which held memory a node's graph overwrites (slow path: after a node or
    /// loose cell appeared).
    fn rebuild_conflicts(&mut self, key: NodeKey) {
        let node = &self.nodes[key];
        let mut slots = Vec::new();
        for (k, other) in &self.nodes {
            for (i, o) in other.outputs.iter().enumerate() {
                if let OutputSlot::Tracked { cell, .. } = &o.slot
                    && node.footprint_overlaps(cell.addr().0, cell.end())
                {
                    slots.push((k, i as u16));
                }
            }
        }
        let cells: Vec<Arc<Cell>> = self
            .loose
            .iter()
            .filter(|c| c.is_held() && node.footprint_overlaps(c.addr().0, c.end()))
            .cloned()
            .collect();
        let node = &mut self.nodes[key];
        node.slot_conflicts = slots;
        node.cell_conflicts = cells;
        node.conflicts_epoch = self.epoch;
    }

    // ----- slow paths: warmup, eager, record ----------------------------------------------

    /// Before a warmup or recording: if replays ran since the bookkeeping was last true, the
    /// path diverged from the recorded tree here, and the pool is restored.
    fn diverge_if_replayed(&mut self, function: FunctionId) {
        if self.pool_stale {
            let _span = tracing::debug_span!(
                "divergence",
                function = %self.functions[function.0].name,
                tip = ?self.path.tip().map(NodeKey::id)
            )
            .entered();
            self.restore(function);
        }
    }

    /// Rebuilds the graph pool's bookkeeping from what is actually held (after replays).
    fn restore(&mut self, function: FunctionId) {
        let _span =
            tracing::debug_span!("restore", function = %self.functions[function.0].name).entered();
        let mut held: Vec<Arc<Cell>> = Vec::new();
        let mut consider = |c: &Arc<Cell>| {
            c.disown();
            if c.is_readable_by_someone() && c.len() > 0 {
                held.push(c.clone());
            }
        };
        for node in self.nodes.values() {
            for o in &node.outputs {
                if let OutputSlot::Tracked { cell, spares } = &o.slot {
                    consider(cell);
                    spares.iter().for_each(&mut consider);
                }
            }
        }
        self.loose.iter().for_each(&mut consider);
        let live: Vec<(DevicePtr, usize)> = held.iter().map(|c| (c.addr(), c.len())).collect();
        let mut pool = lock(&self.graph_pool);
        let placed = pool.restore(&live);
        let mut invalidated = 0;
        for (cell, block) in held.iter().zip(&placed) {
            match block {
                Some(b) => cell.adopt(b.id, &mut pool),
                None => {
                    cell.invalidate_reclaimed();
                    invalidated += 1;
                }
            }
        }
        drop(pool);
        self.pool_stale = false;
        self.stats.restores += 1;
        self.stats.invalidations += invalidated as u64;
        let kept = held.len() - invalidated;
        tracing::debug!(kept, invalidated, "pool restored");
        self.log(
            function,
            self.path.tip(),
            Decision::Restore { kept, invalidated },
        );
    }

    fn run_body<F>(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        body: &mut F,
        kind: RunKind,
        out: &mut Vec<Output<M>>,
    ) -> Result<(), CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let ctx_inputs: Vec<Buffer> = inputs.iter().map(|b| (*b).clone()).collect();
        let name = self.functions[function.0].name.clone();
        let (pool, sibling) = if kind == RunKind::Warmup {
            (&self.graph_pool, &self.eager_pool)
        } else {
            (&self.eager_pool, &self.graph_pool)
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
        };
        let result = body(&mut ctx);
        let allocs = std::mem::take(&mut ctx.allocs);
        let (registry, pruned_at) = if kind == RunKind::Warmup {
            (&mut self.loose, &mut self.loose_pruned_at)
        } else {
            (&mut self.eager_cells, &mut self.eager_pruned_at)
        };
        let before = registry.len();
        registry.extend(allocs.into_iter().filter(|c| c.is_held()));
        if registry.len() != before && kind == RunKind::Warmup {
            self.epoch += 1;
        }
        prune(registry, pruned_at);
        let outputs = result.map_err(|source| CallError::Body {
            function: name,
            source,
        })?;
        out.extend(outputs);
        Ok(())
    }

    fn warmup<F>(
        &mut self,
        function: FunctionId,
        sig: usize,
        reason: WarmupReason,
        inputs: &[&Buffer],
        body: &mut F,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let _span =
            tracing::debug_span!("warmup", function = %self.functions[function.0].name, %reason)
                .entered();
        self.diverge_if_replayed(function);
        self.transition(Path::Warmup)?;
        self.log(function, None, Decision::Warmup(reason));
        self.run_body(function, inputs, body, RunKind::Warmup, out)?;
        self.functions[function.0].sigs[sig].warmups_done += 1;
        self.stats.warmups += 1;
        Ok(Outcome::Warmup)
    }

    fn run_eager<F>(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        body: &mut F,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let _span =
            tracing::trace_span!("eager", function = %self.functions[function.0].name).entered();
        self.run_body(function, inputs, body, RunKind::Eager, out)?;
        self.stats.eager_runs += 1;
        Ok(Outcome::Eager)
    }

    /// The nodes from the root to `tip`, tip last.
    fn path_nodes(&self, tip: Option<NodeKey>) -> Vec<NodeKey> {
        let mut path = Vec::new();
        let mut at = tip;
        while let Some(k) = at {
            path.push(k);
            at = self.nodes[k].parent;
        }
        path.reverse();
        path
    }

    #[allow(clippy::too_many_arguments)]
    fn record<F>(
        &mut self,
        function: FunctionId,
        sig: usize,
        parent: Option<NodeKey>,
        reason: RecordReason,
        inputs: &[&Buffer],
        body: &mut F,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let name = self.functions[function.0].name.clone();
        let span = tracing::debug_span!("record", function = %name, reason = %reason);
        let _span = span.enter();
        self.diverge_if_replayed(function);
        let generation = self.generation;
        let path = self.path_nodes(parent);
        let checkpoint = lock(&self.graph_pool).checkpoint();
        let device_err = |source| CallError::Device {
            function: name.clone(),
            source,
        };

        // Classify inputs; copy the copied ones into fresh placeholders.
        let mut slots = Vec::with_capacity(inputs.len());
        let mut ctx_inputs = Vec::with_capacity(inputs.len());
        let mut placeholder_cells = Vec::new();
        let mut footprint = Vec::new();
        let spec_static = self.functions[function.0].spec.static_inputs.clone();
        for (position, b) in inputs.iter().enumerate() {
            let addr = self.addrs[position];
            let cell = b.cell();
            let managed = cell.generation() == generation
                && cell.node().is_some_and(|n| path.contains(&key_of(n)))
                && !b.is_empty();
            if spec_static.contains(&position) || cell.is_static() {
                slots.push(InputSlot::Static { addr });
                ctx_inputs.push((*b).clone());
            } else if managed {
                slots.push(InputSlot::Managed { addr });
                ctx_inputs.push((*b).clone());
            } else if b.is_empty() {
                slots.push(InputSlot::Copied {
                    placeholder: DevicePtr(0),
                    len: 0,
                    source: addr,
                });
                ctx_inputs.push((*b).clone());
            } else {
                // No reclaiming here: a checkpoint is pending.
                let placeholder = alloc_owned(
                    &self.graph_pool,
                    &self.device,
                    b.len(),
                    name.clone(),
                    generation,
                    Reclaim::Never,
                );
                let (cell, handle) = match placeholder {
                    Ok(placed) => placed,
                    Err(source) => {
                        self.undo_recording(&checkpoint, &placeholder_cells, &[]);
                        return Err(CallError::Pool {
                            function: name.clone(),
                            source,
                        });
                    }
                };
                let block_addr = cell.addr();
                ctx_inputs.push(handle);
                placeholder_cells.push(cell);
                footprint.push((block_addr.0, block_addr.0 + b.len() as u64));
                if b.len() > self.config.large_copy_warn_bytes {
                    tracing::warn!(
                        function = %name, position, bytes = b.len(),
                        "a large input is copied on every replay; if its address is stable, declare it static"
                    );
                }
                slots.push(InputSlot::Copied {
                    placeholder: block_addr,
                    len: b.len(),
                    source: addr,
                });
            }
        }

        // Capture.
        let previous = self.path;
        self.transition(Path::Recording { parent })?;
        if let Err(e) = self.device.begin_capture(self.config.capture_mode) {
            self.path = previous;
            self.undo_recording(&checkpoint, &placeholder_cells, &[]);
            return Err(device_err(e));
        }
        let mut ctx = Ctx {
            device: &self.device,
            inputs: &ctx_inputs,
            pool: &self.graph_pool,
            sibling: &self.eager_pool,
            function: &name,
            generation,
            kind: RunKind::Recording,
            allocs: Vec::new(),
        };
        // `keep` holds the body's own handles until the caller's are made, so that no output
        // block is freed in between.
        let mut keep = Vec::new();
        // The graph begins with the input copies, so a replay needs no separate copy.
        let copies = slots.iter().try_for_each(|slot| match *slot {
            InputSlot::Copied {
                placeholder,
                len,
                source,
            } if len > 0 => self
                .device
                .copy(placeholder, source, len)
                .map_err(BodyError::Device),
            _ => Ok(()),
        });
        let captured = copies
            .and_then(|()| body(&mut ctx))
            .and_then(|outs| Self::classify_outputs(&mut ctx, &slots, outs, &mut keep));
        let allocs = std::mem::take(&mut ctx.allocs);
        drop(ctx);
        let graph = match captured {
            Ok(outs) => self
                .device
                .end_capture()
                .map(|g| (g, outs))
                .map_err(BodyError::Device),
            Err(e) => {
                let aborted = self.device.abort_capture();
                match aborted {
                    Ok(()) => Err(e),
                    Err(abort) => {
                        self.device.record_sticky_error(abort);
                        Err(e)
                    }
                }
            }
        };
        drop(ctx_inputs);
        let (graph, outs) = match graph {
            Ok(g) => g,
            Err(e) => {
                self.path = previous;
                self.undo_recording(&checkpoint, &placeholder_cells, &allocs);
                return self.capture_failed(function, sig, parent, e, inputs, body, out);
            }
        };

        // The node: footprint, liveness facts, outputs.
        footprint.extend(
            allocs
                .iter()
                .filter(|c| c.len() > 0)
                .map(|c| (c.addr().0, c.end())),
        );
        let mut expected_dead = Vec::new();
        for &anc in &path {
            for (i, o) in self.nodes[anc].outputs.iter().enumerate() {
                if let OutputSlot::Tracked { cell, .. } = &o.slot
                    && !cell.is_held()
                {
                    expected_dead.push((anc, i as u16));
                }
            }
        }
        // The counts are diagnostics only: a failure to read them must not fail the call.
        let summary = self.device.summarize(&graph).unwrap_or_else(|error| {
            tracing::warn!(%error, function = %name, "could not count the nodes of a recorded graph");
            Default::default()
        });
        let outputs: Vec<NodeOutput<M>> = outs;
        let key = self.nodes.insert(Node {
            function,
            sig,
            parent,
            children: Vec::new(),
            graph,
            inputs: slots.into_boxed_slice(),
            expected_dead: expected_dead.into_boxed_slice(),
            outputs,
            footprint: tree::merge_ranges(footprint),
            slot_conflicts: Vec::new(),
            cell_conflicts: Vec::new(),
            conflicts_epoch: u64::MAX,
            replays: 0,
            recorded_generation: generation,
            reason: reason.clone(),
            summary,
        });
        let id = key.id();
        let pins: Vec<(DevicePtr, usize)> = self.nodes[key]
            .footprint
            .iter()
            .map(|&(s, e)| (DevicePtr(s), (e - s) as usize))
            .collect();
        lock(&self.graph_pool).pin(&pins);
        for o in &self.nodes[key].outputs {
            if let OutputSlot::Tracked { cell, .. } = &o.slot {
                cell.set_node(id);
            }
        }
        match parent {
            Some(p) => self.nodes[p].add_child(function, key),
            None => self.roots[function.0].push(key),
        }
        let output_cells: Vec<*const Cell> = self.nodes[key]
            .outputs
            .iter()
            .filter_map(|o| match &o.slot {
                OutputSlot::Tracked { cell, .. } => Some(Arc::as_ptr(cell)),
                _ => None,
            })
            .collect();
        self.loose.extend(
            allocs
                .into_iter()
                .chain(placeholder_cells)
                .filter(|c| c.is_held() && !output_cells.contains(&Arc::as_ptr(c))),
        );
        prune(&mut self.loose, &mut self.loose_pruned_at);
        self.epoch += 1;
        self.path = Path::Replaying { tip: key };
        self.stats.recordings += 1;
        match &reason {
            RecordReason::FirstRecording => {}
            RecordReason::NewSignature => self.stats.rerecords.new_signature += 1,
            RecordReason::StaticAddressChanged { .. } => {
                self.stats.rerecords.static_address_changed += 1
            }
            RecordReason::ManagedAddressChanged { .. } => {
                self.stats.rerecords.managed_address_changed += 1
            }
            RecordReason::ExpectedDeadAlive { .. } => self.stats.rerecords.expected_dead_alive += 1,
            RecordReason::InputOverlapsPlaceholder { .. } => {
                self.stats.rerecords.input_overlaps_placeholder += 1
            }
        }
        tracing::debug!(node = %id, "recorded");
        self.log(function, Some(key), Decision::Record(reason));

        // Launch once: the recording only captured the work.
        let node = &self.nodes[key];
        self.device.launch(&node.graph).map_err(device_err)?;
        for o in &node.outputs {
            let buffer = match &o.slot {
                OutputSlot::Tracked { cell, .. } | OutputSlot::Empty(cell) => {
                    Buffer::from_cell(cell)
                }
                OutputSlot::StaticInput(p) => (*inputs[*p]).clone(),
                OutputSlot::Alias(j) => out[*j].buffer.clone(),
            };
            out.push(Output {
                buffer,
                meta: o.meta.clone(),
            });
        }
        drop(keep);
        Ok(Outcome::Recorded(id))
    }

    /// Turns the body's outputs into node output slots, copying (inside the capture) any
    /// output that is not memory this body allocated, a static input, or empty.
    fn classify_outputs(
        ctx: &mut Ctx<'_, D>,
        slots: &[InputSlot],
        outs: Vec<Output<M>>,
        keep: &mut Vec<Buffer>,
    ) -> Result<Vec<NodeOutput<M>>, BodyError> {
        let mut result: Vec<NodeOutput<M>> = Vec::with_capacity(outs.len());
        let mut seen: Vec<Arc<Cell>> = Vec::with_capacity(outs.len());
        for o in outs {
            let cell = o.buffer.cell().clone();
            let slot = if o.buffer.is_empty() {
                OutputSlot::Empty(cell.clone())
            } else if let Some(p) = ctx.inputs.iter().enumerate().position(|(p, b)| {
                matches!(slots[p], InputSlot::Static { .. }) && b.same_storage(&o.buffer)
            }) {
                OutputSlot::StaticInput(p)
            } else if let Some(j) = seen.iter().position(|c| Arc::ptr_eq(c, &cell)) {
                OutputSlot::Alias(j)
            } else if ctx.allocs.iter().any(|c| Arc::ptr_eq(c, &cell)) {
                OutputSlot::Tracked {
                    cell: cell.clone(),
                    spares: Vec::new(),
                }
            } else {
                let src = o.buffer.addr()?;
                let copy = ctx.alloc(o.buffer.len())?;
                ctx.device.copy(copy.addr()?, src, o.buffer.len())?;
                let slot = OutputSlot::Tracked {
                    cell: copy.cell().clone(),
                    spares: Vec::new(),
                };
                keep.push(copy);
                slot
            };
            seen.push(cell);
            keep.push(o.buffer);
            result.push(NodeOutput { slot, meta: o.meta });
        }
        Ok(result)
    }

    /// Puts the pool back as it was before a recording began.
    fn undo_recording(
        &mut self,
        checkpoint: &crate::pool::Checkpoint,
        placeholders: &[Arc<Cell>],
        allocs: &[Arc<Cell>],
    ) {
        for c in placeholders.iter().chain(allocs) {
            c.disown();
            c.invalidate_reclaimed();
        }
        lock(&self.graph_pool).rollback(checkpoint);
    }

    #[allow(clippy::too_many_arguments)]
    fn capture_failed<F>(
        &mut self,
        function: FunctionId,
        sig: usize,
        parent: Option<NodeKey>,
        error: BodyError,
        inputs: &[&Buffer],
        body: &mut F,
        out: &mut Vec<Output<M>>,
    ) -> Result<Outcome, CallError>
    where
        F: FnMut(&mut Ctx<'_, D>) -> Result<Vec<Output<M>>, BodyError>,
    {
        let name = self.functions[function.0].name.clone();
        let why = match error {
            BodyError::Device(DeviceError::Capture { op, violation }) => {
                EagerReason::CaptureFailed { op, violation }
            }
            BodyError::Device(e)
                if matches!(
                    e.op(),
                    DeviceOp::EndCapture | DeviceOp::Instantiate | DeviceOp::Upload
                ) =>
            {
                EagerReason::InstantiateFailed { error: e }
            }
            source => {
                return Err(CallError::Body {
                    function: name,
                    source,
                });
            }
        };
        let _span = tracing::info_span!("fallback", function = %name).entered();
        tracing::warn!(reason = %why, "capture failed; the function runs eagerly from now on");
        self.stats.capture_failures += 1;
        self.stats.fallbacks += 1;
        self.log(function, parent, Decision::Eager(why.clone()));
        self.functions[function.0].sigs[sig].eager = Some(why);
        self.run_eager(function, inputs, body, out)
    }

    // ----- memory outside calls ------------------------------------------------------------

    /// Allocates `bytes` outside the graph pool, for memory that lives across steps
    /// (weights, caches, copies). Freed when the last handle drops.
    pub fn alloc(&mut self, bytes: usize) -> Result<Buffer, MemoryError> {
        if let Some(e) = self.device.take_sticky_error() {
            return Err(e.into());
        }
        let (cell, buffer) = alloc_owned(
            &self.eager_pool,
            &self.device,
            bytes,
            Arc::from("alloc"),
            self.generation,
            Reclaim::Unused {
                sibling: &self.graph_pool,
            },
        )?;
        self.eager_cells.push(cell);
        prune(&mut self.eager_cells, &mut self.eager_pruned_at);
        Ok(buffer)
    }

    fn check_device(&self, buffer: &Buffer) -> Result<DevicePtr, MemoryError> {
        if buffer.device() != self.device.id() {
            return Err(MemoryError::WrongDevice {
                expected: self.device.id(),
                found: buffer.device(),
            });
        }
        Ok(buffer.addr()?)
    }

    /// Copies a buffer into new memory outside the graph pool that the caller owns: it stays
    /// valid across steps.
    pub fn copy_out(&mut self, buffer: &Buffer) -> Result<Buffer, MemoryError> {
        let src = self.check_device(buffer)?;
        let copy = self.alloc(buffer.len())?;
        if !buffer.is_empty() {
            self.device.copy(copy.addr()?, src, buffer.len())?;
        }
        Ok(copy)
    }

    /// Reads a buffer's bytes to the host.
    pub fn read(&self, buffer: &Buffer, dst: &mut [u8]) -> Result<(), MemoryError> {
        let src = self.check_device(buffer)?;
        if dst.len() != buffer.len() {
            return Err(MemoryError::LengthMismatch {
                host: dst.len(),
                buffer: buffer.len(),
            });
        }
        Ok(self.device.read(src, dst)?)
    }

    /// Writes host bytes into a buffer.
    pub fn write(&self, buffer: &Buffer, src: &[u8]) -> Result<(), MemoryError> {
        let dst = self.check_device(buffer)?;
        if src.len() != buffer.len() {
            return Err(MemoryError::LengthMismatch {
                host: src.len(),
                buffer: buffer.len(),
            });
        }
        Ok(self.device.write(dst, src)?)
    }

    /// Reads a buffer of f32 values.
    pub fn read_f32(&self, buffer: &Buffer) -> Result<Vec<f32>, MemoryError> {
        let mut bytes = vec![0u8; buffer.len()];
        self.read(buffer, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Writes f32 values into a buffer.
    pub fn write_f32(&self, buffer: &Buffer, values: &[f32]) -> Result<(), MemoryError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(buffer, &bytes)
    }

    /// Drops every graph and returns the graph pool's memory and address range to the device. Buffers still
    /// held from graph-pool memory become invalid (reading them returns
    /// [`crate::BufferError::Reset`]); memory from [`Graft::alloc`] and eager runs stays.
    pub fn reset(&mut self) -> Result<(), MemoryError> {
        let _span = tracing::info_span!("reset").entered();
        let synced = self.device.synchronize();
        self.invalidate_graph_memory();
        self.nodes.clear();
        self.roots.iter_mut().for_each(Vec::clear);
        self.rerecords.clear();
        self.eager_pairs.clear();
        for f in &mut self.functions {
            for s in &mut f.sigs {
                s.warmups_done = 0;
            }
            f.root_level = false;
        }
        self.pool_stale = false;
        self.epoch += 1;
        self.new_generation();
        let device = &self.device;
        let released = lock(&self.graph_pool).release_all(device);
        synced?;
        released?;
        if let Some(e) = self.device.take_sticky_error() {
            return Err(e.into());
        }
        Ok(())
    }

    fn invalidate_graph_memory(&mut self) {
        for node in self.nodes.values() {
            for o in &node.outputs {
                if let OutputSlot::Tracked { cell, spares } = &o.slot {
                    cell.invalidate_reset();
                    spares.iter().for_each(|c| c.invalidate_reset());
                }
            }
        }
        self.loose.drain(..).for_each(|c| c.invalidate_reset());
    }

    // ----- introspection used by tests and diagnostics ---------------------------------------

    /// The node a call with these inputs would replay at the current tip, running the same
    /// invariant check as a call but nothing else (no launch, no state change).
    pub fn probe(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
    ) -> Result<Option<NodeId>, CallError> {
        let Some(f) = self.functions.get(function.0) else {
            return Err(CallError::UnknownFunction { id: function });
        };
        self.addrs.clear();
        for (position, b) in inputs.iter().enumerate() {
            let addr = b.addr().map_err(|source| CallError::InvalidInput {
                function: f.name.clone(),
                position,
                source,
            })?;
            self.addrs.push(addr);
        }
        let Some(sig) = f.sigs.iter().position(|s| s.matches(inputs, keys)) else {
            return Ok(None);
        };
        Ok(self
            .find_candidate(self.path.tip(), function, sig)
            .ok()
            .map(NodeKey::id))
    }

    /// How often a node has been replayed.
    pub fn node_replays(&self, node: NodeId) -> Option<u64> {
        self.nodes.get(key_of(node)).map(|n| n.replays)
    }

    /// The nodes of the tree, in arena order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        self.nodes.keys().map(NodeKey::id).collect()
    }

    /// The function a node records.
    pub fn node_function(&self, node: NodeId) -> Option<FunctionId> {
        self.nodes.get(key_of(node)).map(|n| n.function)
    }

    /// A node's parent.
    pub fn node_parent(&self, node: NodeId) -> Option<NodeId> {
        self.nodes
            .get(key_of(node))
            .and_then(|n| n.parent.map(NodeKey::id))
    }
}

impl<D: Device, M: Clone> Drop for Graft<D, M> {
    fn drop(&mut self) {
        let synced = self.device.synchronize();
        self.invalidate_graph_memory();
        self.eager_cells
            .drain(..)
            .for_each(|c| c.invalidate_reset());
        self.nodes.clear();
        let device = &self.device;
        let record = |r: Result<(), crate::pool::PoolError>| {
            if let Err(e) = r {
                tracing::error!(error = %e, "releasing pool memory failed while dropping the runtime");
                if let crate::pool::PoolError::Release { source, .. } = e {
                    device.record_sticky_error(source);
                }
            }
        };
        record(lock(&self.graph_pool).release_all(device));
        record(lock(&self.eager_pool).release_all(device));
        if let Err(e) = synced {
            device.record_sticky_error(e);
        }
    }
}
