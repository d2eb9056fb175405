//! `graft bench serve`: a skewed trace of batch sizes, run eagerly, through graft without a
//! budget, with a graph budget (graft learns which buckets to keep), and with the best fixed
//! choice of as many buckets, chosen offline from the first two runs (an allow-list).

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use graft_core::{AllowEntry, Buckets, Config, Outcome, Stats};
use graft_tensor::DecoderConfig;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use crate::ShapesArgs;
use crate::demo::make_room;
use crate::error::CliError;
use crate::progress;
use crate::shapes::{MIB, header, on_backend, setup};
use crate::timing::{fmt_us, median, median_us, timed};

/// `graft bench serve`.
pub fn serve(args: &ShapesArgs, out: &mut dyn Write) -> Result<(), CliError> {
    on_backend!(args, out, serve_on)
}

/// A batch size from a skewed distribution over `1..=max`: most steps are small.
fn skewed(rng: &mut Xoshiro256PlusPlus, max: usize) -> usize {
    let u: f64 = rng.random();
    ((u * u * u * max as f64).ceil() as usize).clamp(1, max)
}

/// How one run executes the trace.
enum Mode {
    Eager,
    /// Through graft, with this graph budget and allow-list.
    Graft {
        max_graphs: Option<usize>,
        allow: Option<Vec<AllowEntry>>,
    },
}

/// One serving run's figures.
struct ServeRun {
    times: Vec<Duration>,
    /// Per step, whether it replayed a graph.
    replayed: Vec<bool>,
    stats: Option<Stats>,
    mapped_early: usize,
    /// The registered name of the decode step.
    function: String,
    /// The buckets whose graphs the tree holds at the end, ascending.
    resident: Vec<u64>,
}

impl ServeRun {
    /// Mean, median and p99 step, microseconds.
    fn summary(&self) -> (f64, f64, f64) {
        let mut sorted = self.times.clone();
        sorted.sort();
        let n = sorted.len().max(1);
        let mean = sorted.iter().map(Duration::as_secs_f64).sum::<f64>() / n as f64;
        let p99 = sorted
            .get((sorted.len() * 99 / 100).min(sorted.len().saturating_sub(1)))
            .map_or(0.0, Duration::as_secs_f64);
        (mean * 1e6, median_us(&sorted), p99 * 1e6)
    }
}

/// Per bucket: how often the trace uses it, its median eager step and its median replay
/// (none where the no-budget run never replayed it), microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketCost {
    /// Steps of the trace at this bucket.
    pub count: usize,
    /// Median eager step.
    pub eager_us: f64,
    /// Median replay step.
    pub replay_us: Option<f64>,
}

/// The `k` buckets a fixed set of graphs should hold to save the most time over the trace:
/// the largest `count * (eager - replay)`, leaving out buckets a graph does not speed up or
/// that never replayed. Sorted by size.
pub fn best_fixed(costs: &BTreeMap<usize, BucketCost>, k: usize) -> Vec<usize> {
    let mut saved: Vec<(f64, usize)> = costs
        .iter()
        .filter_map(|(&b, c)| {
            let s = c.count as f64 * (c.eager_us - c.replay_us?);
            (s > 0.0).then_some((s, b))
        })
        .collect();
    saved.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut chosen: Vec<usize> = saved.into_iter().take(k).map(|(_, b)| b).collect();
    chosen.sort_unstable();
    chosen
}

/// The mean step, microseconds, that graphs of `chosen` would give by the per-bucket medians.
pub fn predicted_mean(costs: &BTreeMap<usize, BucketCost>, chosen: &[usize]) -> f64 {
    let (mut total, mut steps) = (0.0, 0);
    for (b, c) in costs {
        let each = match c.replay_us {
            Some(r) if chosen.contains(b) => r,
            _ => c.eager_us,
        };
        total += c.count as f64 * each;
        steps += c.count;
    }
    total / steps.max(1) as f64
}

/// The per-bucket costs of the trace (`bucket_of` each step), from an eager run and a graft
/// run without budget over it.
fn costs(bucket_of: &[usize], eager: &ServeRun, graft: &ServeRun) -> BTreeMap<usize, BucketCost> {
    let mut times: BTreeMap<usize, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for (n, &b) in bucket_of.iter().enumerate() {
        let (e, r) = times.entry(b).or_default();
        e.push(eager.times[n].as_secs_f64() * 1e6);
        if graft.replayed[n] {
            r.push(graft.times[n].as_secs_f64() * 1e6);
        }
    }
    times
        .into_iter()
        .map(|(b, (e, r))| {
            let cost = BucketCost {
                count: e.len(),
                eager_us: median(e),
                replay_us: (!r.is_empty()).then(|| median(r)),
            };
            (b, cost)
        })
        .collect()
}

fn serve_on<D: graft_tensor::Backend>(
    device: D,
    config: DecoderConfig,
    name: &str,
    args: &ShapesArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    header(out, &device.describe(), name, &config)?;
    let buckets = Buckets::stepped(args.max);
    let steps = args.steps;
    let k = args.budget;
    writeln!(
        out,
        "trace: {steps} steps, batch sizes 1..={} drawn as ceil(max * u^3) (seed {}), padded to {} buckets (1, 2, 4, then every 8 up to 256, then every 16)",
        args.max,
        args.seed,
        buckets.sizes().len()
    )?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(args.seed);
    let trace: Vec<usize> = (0..steps).map(|_| skewed(&mut rng, args.max)).collect();
    let bucket_of: Vec<usize> = trace.iter().map(|&s| buckets.pick(s).size()).collect();
    let distinct: std::collections::BTreeSet<usize> = bucket_of.iter().copied().collect();
    writeln!(out, "the trace uses {} distinct buckets", distinct.len())?;
    let bar = progress::bar((4 * steps) as u64);
    let run = |mode: Mode| -> Result<ServeRun, CliError> {
        let (graft, cfg) = match mode {
            Mode::Eager => (false, Config::default()),
            Mode::Graft { max_graphs, allow } => {
                let cfg = Config {
                    max_graphs,
                    allow_list: allow,
                    ..Config::default()
                };
                (true, cfg)
            }
        };
        let (mut g, dec, fid, mut lanes) = setup(&device, cfg, config, args.seed, &buckets)?;
        let mut run = ServeRun {
            times: Vec::with_capacity(steps),
            replayed: Vec::with_capacity(steps),
            stats: None,
            mapped_early: 0,
            function: g.function_name(fid).unwrap_or_default().to_string(),
            resident: Vec::new(),
        };
        for (n, &bucket) in bucket_of.iter().enumerate() {
            let i = lanes.index(bucket);
            make_room(&mut lanes.states[i], &device)?;
            let (state, tokens) = (&mut lanes.states[i], &lanes.tokens[i]);
            let (replayed, dt) = timed(&device, || -> Result<bool, CliError> {
                if graft {
                    let (_, o) = dec.step_graft_outcome(&mut g, fid, state, tokens)?;
                    Ok(matches!(o, Outcome::Replayed(_)))
                } else {
                    drop(dec.step_eager(&mut g, state, tokens)?);
                    Ok(false)
                }
            })?;
            run.times.push(dt);
            run.replayed.push(replayed);
            if n == steps / 10 {
                run.mapped_early = g.stats().pool.mapped;
            }
            bar.inc(1);
        }
        if graft {
            run.stats = Some(g.stats());
            run.resident = g
                .nodes()
                .iter()
                .filter_map(|n| n.keys.first().copied())
                .collect();
            run.resident.sort_unstable();
        }
        Ok(run)
    };
    let eager = run(Mode::Eager)?;
    let unbounded = run(Mode::Graft {
        max_graphs: None,
        allow: None,
    })?;
    let learned = run(Mode::Graft {
        max_graphs: Some(k),
        allow: None,
    })?;
    let costs = costs(&bucket_of, &eager, &unbounded);
    let chosen = best_fixed(&costs, k);
    let allow = chosen
        .iter()
        .map(|&b| AllowEntry {
            function: unbounded.function.clone(),
            keys: Some(vec![b as u64]),
        })
        .collect();
    let fixed = run(Mode::Graft {
        max_graphs: None,
        allow: Some(allow),
    })?;
    bar.finish_and_clear();
    writeln!(
        out,
        "\n{:<24} {:>12} {:>12} {:>12} {:>11} {:>10} {:>22}",
        "mode", "median", "mean", "p99", "recordings", "evictions", "graph pool (10%/end)"
    )?;
    let rows = [
        ("eager".to_string(), &eager),
        ("graft, no budget".to_string(), &unbounded),
        (format!("graft, budget {k}"), &learned),
        (format!("graft, best fixed {k}"), &fixed),
    ];
    for (mode, run) in rows {
        let (mean, median, p99) = run.summary();
        let (rec, ev, mem) = match &run.stats {
            Some(s) => (
                s.recordings.to_string(),
                s.evictions.to_string(),
                format!(
                    "{:.1}/{:.1} MiB",
                    run.mapped_early as f64 / MIB,
                    s.pool.mapped as f64 / MIB
                ),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        writeln!(
            out,
            "{mode:<24} {:>12} {:>12} {:>12} {rec:>11} {ev:>10} {mem:>22}",
            fmt_us(median),
            fmt_us(mean),
            fmt_us(p99),
        )?;
    }
    let list = |b: &[u64]| b.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
    let chosen_keys: Vec<u64> = chosen.iter().map(|&b| b as u64).collect();
    writeln!(
        out,
        "\nbest fixed {k}: buckets {} (most steps x (eager - replay), by per-bucket medians of the eager and no-budget runs), predicted mean {}",
        list(&chosen_keys),
        fmt_us(predicted_mean(&costs, &chosen))
    )?;
    writeln!(
        out,
        "budget {k} ends holding buckets {}",
        list(&learned.resident)
    )?;
    let (learned_mean, _, learned_p99) = learned.summary();
    let (fixed_mean, _, _) = fixed.summary();
    let (_, _, eager_p99) = eager.summary();
    writeln!(
        out,
        "budget {k} against best fixed {k}, mean: {:.3}x (target 1.03x or less); p99 against eager: {:.3}x (target 1x or less)",
        learned_mean / fixed_mean.max(1e-9),
        learned_p99 / eager_p99.max(1e-9)
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(count: usize, eager_us: f64, replay_us: Option<f64>) -> BucketCost {
        BucketCost {
            count,
            eager_us,
            replay_us,
        }
    }

    #[test]
    fn best_fixed_takes_the_largest_savings() {
        let costs = BTreeMap::from([
            (1, cost(100, 300.0, Some(200.0))), // saves 10,000
            (2, cost(10, 300.0, Some(100.0))),  // 2,000
            (4, cost(40, 500.0, Some(200.0))),  // 12,000
            (8, cost(50, 300.0, None)),         // never replayed
            (16, cost(90, 300.0, Some(310.0))), // slower as a graph
        ]);
        assert_eq!(best_fixed(&costs, 2), vec![1, 4]);
        assert_eq!(best_fixed(&costs, 10), vec![1, 2, 4]);
        let all_eager = (100. * 300. + 10. * 300. + 40. * 500. + 50. * 300. + 90. * 300.) / 290.;
        assert_eq!(predicted_mean(&costs, &[]), all_eager);
        let saved = (10_000. + 12_000.) / 290.;
        assert!((predicted_mean(&costs, &[1, 4]) - (all_eager - saved)).abs() < 1e-9);
    }
}
