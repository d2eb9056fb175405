//! What `/metrics` reports, in Prometheus's text format: the queue and the running
//! sequences, time to first token and between tokens, and graft's own counters (replays,
//! recordings, eager calls, guard findings). Written by the engine's thread after each step,
//! read by the HTTP handlers: atomics only.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Upper bounds of the latency histograms' buckets, in seconds.
const BOUNDS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

/// A latency histogram (Prometheus's cumulative buckets are computed when rendered).
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    /// Counts per bucket of [`BOUNDS`], then the overflow.
    buckets: [AtomicU64; BOUNDS.len() + 1],
    /// Sum in nanoseconds.
    sum_ns: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, seconds: f64) {
        let at = BOUNDS
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(BOUNDS.len());
        self.buckets[at].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add((seconds * 1e9) as u64, Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            total += b.load(Relaxed);
            let le = BOUNDS.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {total}");
        }
        let sum = self.sum_ns.load(Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {total}");
    }
}

/// The server's metrics.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub(crate) requests: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generated_tokens: AtomicU64,
    pub(crate) waiting: AtomicU64,
    pub(crate) running: AtomicU64,
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) replays: AtomicU64,
    pub(crate) recordings: AtomicU64,
    pub(crate) eager_calls: AtomicU64,
    pub(crate) guard_findings: AtomicU64,
}

impl Metrics {
    /// Copies graft's counters (the engine's thread, after a step).
    pub(crate) fn set_graft(&self, stats: &graft_core::Stats) {
        self.replays.store(stats.replays, Relaxed);
        self.recordings.store(stats.recordings, Relaxed);
        self.eager_calls
            .store(stats.eager_runs + stats.warmups, Relaxed);
        self.guard_findings.store(stats.guard_differences, Relaxed);
    }

    /// The text `/metrics` serves.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        let counters: [(&str, &str, &AtomicU64, &str); 11] = [
            (
                "graft_serve_requests_total",
                "requests accepted",
                &self.requests,
                "counter",
            ),
            (
                "graft_serve_refused_total",
                "requests refused (4xx, 429)",
                &self.refused,
                "counter",
            ),
            (
                "graft_serve_cancelled_total",
                "requests ended early (a stop string, a client gone)",
                &self.cancelled,
                "counter",
            ),
            (
                "graft_serve_prompt_tokens_total",
                "prompt tokens prefilled",
                &self.prompt_tokens,
                "counter",
            ),
            (
                "graft_serve_generated_tokens_total",
                "tokens generated",
                &self.generated_tokens,
                "counter",
            ),
            (
                "graft_serve_queue_depth",
                "requests waiting for a cache row",
                &self.waiting,
                "gauge",
            ),
            (
                "graft_serve_running_sequences",
                "sequences being prefilled or decoded",
                &self.running,
                "gauge",
            ),
            (
                "graft_replays_total",
                "graph replays",
                &self.replays,
                "counter",
            ),
            (
                "graft_recordings_total",
                "graphs recorded",
                &self.recordings,
                "counter",
            ),
            (
                "graft_eager_calls_total",
                "steps run eagerly (warmups, fallbacks, eager-only)",
                &self.eager_calls,
                "counter",
            ),
            (
                "graft_guard_findings_total",
                "guarded replays that found a difference",
                &self.guard_findings,
                "counter",
            ),
        ];
        for (name, help, value, kind) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                value.load(Relaxed)
            );
        }
        self.ttft.render(
            "graft_serve_time_to_first_token_seconds",
            "time from a request's arrival to its first token",
            &mut out,
        );
        self.itl.render(
            "graft_serve_inter_token_latency_seconds",
            "time between two tokens of a sequence",
            &mut out,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_counted() {
        let m = Metrics::default();
        m.ttft.observe(0.0007);
        m.ttft.observe(0.003);
        m.ttft.observe(20.0);
        let text = m.render();
        assert!(text.contains("graft_serve_time_to_first_token_seconds_bucket{le=\"0.001\"} 1"));
        assert!(text.contains("graft_serve_time_to_first_token_seconds_bucket{le=\"0.005\"} 2"));
        assert!(text.contains("graft_serve_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("graft_serve_time_to_first_token_seconds_count 3"));
    }
}
