//! Tests whose ranks are processes: a small harness for a test executable built with
//! `harness = false`, which starts copies of itself as the ranks of a job (each with `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` set, on a free loopback port),
//! bounds them with a watchdog that kills what outlives its deadline, and collects how each
//! ended.
//!
//! A [`Scenario`] has a parent part (run by the test executable as a test: it calls
//! [`spawn_ranks`] and checks the [`RankExit`]s with [`expect_code`]) and a child part (run by each copy: one rank,
//! which asserts what it sees and panics, so exits non-zero, when it is wrong). [`main`]
//! dispatches: in a copy it runs the named scenario's child part, otherwise it runs the
//! scenarios like libtest (a name filter, `--exact`, `--list`, `--ignored`,
//! `--include-ignored`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use graft_launch::{RankExit, launch_local};

/// The variable that makes a copy of the test executable a rank of a scenario: its name.
const SCENARIO_VAR: &str = "GRAFT_TEST_SCENARIO";

/// One multi-process test.
#[derive(Clone, Copy, Debug)]
pub struct Scenario {
    /// The test's name.
    pub name: &'static str,
    /// Why it runs only with `--ignored` (as libtest's `#[ignore = "..."]`), if it does.
    pub ignore: Option<&'static str>,
    /// The test, given the scenario's name: starts the ranks with [`spawn_ranks`] and checks
    /// how they ended.
    pub parent: fn(&'static str),
    /// One rank, in a copy of the executable: panics when what it sees is wrong.
    pub child: fn(),
}

/// Panics with the rank's output unless it exited with `code`.
pub fn expect_code(exit: &RankExit, code: i32) {
    assert_eq!(
        exit.code(),
        Some(code),
        "rank {} ended with {:?} after {:?}, not exit code {code}; its stderr:\n{}\nits stdout:\n{}",
        exit.rank,
        exit.status,
        exit.took,
        exit.stderr,
        String::from_utf8_lossy(&exit.stdout)
    );
}

/// Starts `ranks` of a job of `world` ranks as copies of this executable running
/// `scenario`'s child part (graft's [`launch_local`], with `extra` variables), and waits for
/// them, killing those still running at `deadline`. Returns how each ended, in the order of
/// `ranks`.
pub fn spawn_ranks(
    scenario: &str,
    world: usize,
    ranks: &[usize],
    extra: &[(&str, String)],
    deadline: Duration,
) -> Vec<RankExit> {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("no path to this test: {e}"));
    let mut env = vec![(SCENARIO_VAR, scenario.to_owned())];
    env.extend(extra.iter().cloned());
    launch_local(&exe, &[] as &[&str], world, ranks, &env, deadline, false)
        .unwrap_or_else(|e| panic!("the ranks of {scenario} did not start: {e}"))
}

/// The scenario this process is a rank of, when it is a copy started by [`spawn_ranks`].
fn child_scenario() -> Option<String> {
    std::env::var(SCENARIO_VAR).ok()
}

/// The `main` of a `harness = false` test of `scenarios`: a rank's copy runs its scenario's
/// child part (exit code 0 when it returns, 101 when it panics); otherwise the scenarios run
/// as tests, one after another, and the process exits non-zero if one failed.
pub fn main(scenarios: &[Scenario]) -> ! {
    if let Some(name) = child_scenario() {
        let scenario = scenarios
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no scenario {name}"));
        (scenario.child)();
        std::process::exit(0);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    // libtest's options that take a value in the next argument: not filters.
    const VALUED: [&str; 5] = [
        "--test-threads",
        "--format",
        "--color",
        "--logfile",
        "--skip",
    ];
    let (mut filters, mut skips) = (Vec::new(), Vec::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if VALUED.contains(&a.as_str()) {
            let value = it.next();
            if a == "--skip" {
                skips.extend(value);
            }
        } else if !a.starts_with('-') {
            filters.push(a);
        }
    }
    let exact = flag("--exact");
    let matches = |f: &String, name: &str| {
        if exact {
            name == f.as_str()
        } else {
            name.contains(f.as_str())
        }
    };
    let named = |s: &Scenario| {
        (filters.is_empty() || filters.iter().any(|f| matches(f, s.name)))
            && !skips.iter().any(|f| matches(f, s.name))
    };
    // As libtest: ignored scenarios run only with `--ignored` (then only they) or
    // `--include-ignored`; `--list` lists every scenario, or the ignored ones with `--ignored`.
    let ignored_only = flag("--ignored");
    let chosen = |s: &Scenario| {
        named(s) && (flag("--include-ignored") || ignored_only == s.ignore.is_some())
    };
    if flag("--list") {
        for s in scenarios
            .iter()
            .filter(|s| named(s) && (!ignored_only || s.ignore.is_some()))
        {
            println!("{}: test", s.name);
        }
        std::process::exit(0);
    }
    let run: Vec<&Scenario> = scenarios.iter().filter(|s| chosen(s)).collect();
    println!("\nrunning {} tests", run.len());
    let mut failed = Vec::new();
    let start = Instant::now();
    for s in &run {
        let ok = catch_unwind(AssertUnwindSafe(|| (s.parent)(s.name))).is_ok();
        println!("test {} ... {}", s.name, if ok { "ok" } else { "FAILED" });
        if !ok {
            failed.push(s.name);
        }
    }
    let ignored = scenarios.len() - run.len();
    println!(
        "\ntest result: {}. {} passed; {} failed; {ignored} ignored or filtered out; finished in {:.2}s\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        run.len() - failed.len(),
        failed.len(),
        start.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        println!("failures: {failed:?}");
        std::process::exit(101);
    }
    std::process::exit(0);
}
