//! [`Diagnostics`]: graft's decision log, tree, statistics and memory figures of a graphed
//! [`CandleGraft`](crate::CandleGraft), whatever device type graft runs on underneath.

use graft_core::{
    Churn, DecisionRecord, FunctionId, Graft, GuardFinding, MemoryReport, NodeInfo, Stats,
};

use crate::step::OutputMeta;

/// graft's diagnostics of a graphed runtime (see graft-core's `Graft` for each).
#[derive(Clone, Copy)]
pub struct Diagnostics<'g> {
    graft: &'g dyn Inspect,
}

impl std::fmt::Debug for Diagnostics<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Diagnostics")
            .field("stats", &self.graft.stats())
            .finish_non_exhaustive()
    }
}

impl<'g> Diagnostics<'g> {
    pub(crate) fn new(graft: &'g dyn Inspect) -> Diagnostics<'g> {
        Diagnostics { graft }
    }

    /// Counts of recordings, replays, warmups and eager runs (graft's `Graft::stats`).
    pub fn stats(&self) -> Stats {
        self.graft.stats()
    }

    /// graft's decision log, oldest first (`Graft::explain`).
    pub fn explain(&self) -> impl Iterator<Item = &'g DecisionRecord> + use<'g> {
        self.graft.explain().into_iter()
    }

    /// The graph tree as text (`Graft::dump_text`).
    pub fn dump_text(&self) -> String {
        self.graft.dump_text()
    }

    /// Every recorded node (`Graft::nodes`).
    pub fn nodes(&self) -> Vec<NodeInfo> {
        self.graft.nodes()
    }

    /// The memory graft's pools hold (`Graft::memory_report`).
    pub fn memory_report(&self) -> MemoryReport {
        self.graft.memory_report()
    }

    /// The host values guards found baked into recordings, each once
    /// (`Graft::guard_findings`; guards are on by default, see `Config::guards`).
    pub fn guard_findings(&self) -> &'g [GuardFinding] {
        self.graft.guard_findings()
    }

    /// What kept `function` from replaying, if graft found it (`Graft::churn`).
    pub(crate) fn churn(&self, function: FunctionId) -> Option<Churn> {
        self.graft.churn(function)
    }
}

/// What [`Diagnostics`] reads of a graft runtime, for any device type.
pub(crate) trait Inspect {
    fn stats(&self) -> Stats;
    fn explain(&self) -> Vec<&DecisionRecord>;
    fn dump_text(&self) -> String;
    fn nodes(&self) -> Vec<NodeInfo>;
    fn memory_report(&self) -> MemoryReport;
    fn churn(&self, function: FunctionId) -> Option<Churn>;
    fn guard_findings(&self) -> &[GuardFinding];
}

impl<D: graft_core::Device> Inspect for Graft<D, OutputMeta> {
    fn stats(&self) -> Stats {
        Graft::stats(self)
    }

    fn explain(&self) -> Vec<&DecisionRecord> {
        Graft::explain(self).collect()
    }

    fn dump_text(&self) -> String {
        Graft::dump_text(self)
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        Graft::nodes(self)
    }

    fn memory_report(&self) -> MemoryReport {
        Graft::memory_report(self)
    }

    fn churn(&self, function: FunctionId) -> Option<Churn> {
        Graft::churn(self, function).copied()
    }

    fn guard_findings(&self) -> &[GuardFinding] {
        Graft::guard_findings(self)
    }
}
