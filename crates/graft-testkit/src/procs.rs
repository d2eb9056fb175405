//! Tests whose ranks are processes: a small harness for a test executable built with
//! `harness = false`, which starts copies of itself as the ranks of a job (each with `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` set, on a free loopback port),
//! bounds them with a watchdog that kills what outlives its deadline, and collects how each
//! ended.
//!
//! A [`Scenario`] has a parent part (run by the test executable as a test: it calls
//! [`spawn_ranks`] and checks the [`RankExit`]s) and a child part (run by each copy: one rank,
//! which asserts what it sees and panics, so exits non-zero, when it is wrong). [`main`]
//! dispatches: in a copy it runs the named scenario's child part, otherwise it runs the
//! scenarios like libtest (a name filter, `--exact`, `--list`, `--ignored`,
//! `--include-ignored`).

use std::io::Read;
use std::net::TcpListener;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

/// How one rank's process ended.
#[derive(Debug)]
pub struct RankExit {
    /// Its rank.
    pub rank: usize,
    /// Its exit status, or `None` when the watchdog killed it.
    pub status: Option<ExitStatus>,
    /// What it wrote to stdout.
    pub stdout: String,
    /// What it wrote to stderr.
    pub stderr: String,
    /// How long it ran.
    pub took: Duration,
}

impl RankExit {
    /// Its exit code, or `None` when it was killed (by the watchdog or a signal).
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }

    /// Panics with the rank's output unless it exited with `code`.
    pub fn expect_code(&self, code: i32) {
        assert_eq!(
            self.code(),
            Some(code),
            "rank {} ended with {:?} after {:?}, not exit code {code}; its stderr:\n{}\nits stdout:\n{}",
            self.rank,
            self.status,
            self.took,
            self.stderr,
            self.stdout
        );
    }
}

/// A loopback port free now (bound, then released), for a job's rendezvous.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free loopback port: {e}"))
}

/// Starts `ranks` of a job of `world` ranks as copies of this executable running
/// `scenario`'s child part (each with its `RANK` and `LOCAL_RANK`, and `extra` variables),
/// and waits for them, killing those still running at `deadline`. Returns how each ended, in
/// the order of `ranks`.
pub fn spawn_ranks(
    scenario: &str,
    world: usize,
    ranks: &[usize],
    extra: &[(&str, String)],
    deadline: Duration,
) -> Vec<RankExit> {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("no path to this test: {e}"));
    let port = free_port().to_string();
    let start = Instant::now();
    let mut running: Vec<(usize, Child, Pipes)> = ranks
        .iter()
        .map(|&rank| {
            let mut child = Command::new(&exe)
                .env(SCENARIO_VAR, scenario)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .envs(extra.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("rank {rank} did not start: {e}"));
            let pipes = Pipes::take(&mut child);
            (rank, child, pipes)
        })
        .collect();
    let mut ended: Vec<Option<RankExit>> = ranks.iter().map(|_| None).collect();
    while ended.iter().any(Option::is_none) {
        let overdue = start.elapsed() >= deadline;
        for (i, (rank, child, pipes)) in running.iter_mut().enumerate() {
            if ended[i].is_some() {
                continue;
            }
            let status = match child.try_wait() {
                Ok(Some(status)) => Some(status),
                Ok(None) if overdue => {
                    // Ours to end: it outlived the test's deadline.
                    let _ = child.kill();
                    let _ = child.wait();
                    None
                }
                Ok(None) => continue,
                Err(e) => panic!("rank {rank} cannot be waited for: {e}"),
            };
            let (stdout, stderr) = pipes.collect();
            ended[i] = Some(RankExit {
                rank: *rank,
                status,
                stdout,
                stderr,
                took: start.elapsed(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    ended.into_iter().flatten().collect()
}

/// The threads draining a child's stdout and stderr (so that a chatty child never blocks on
/// a full pipe).
struct Pipes {
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
}

impl Pipes {
    fn take(child: &mut Child) -> Pipes {
        fn drain(pipe: Option<impl Read + Send + 'static>) -> Option<JoinHandle<String>> {
            pipe.map(|mut p| {
                std::thread::spawn(move || {
                    let mut text = String::new();
                    let _ = p.read_to_string(&mut text);
                    text
                })
            })
        }
        Pipes {
            stdout: drain(child.stdout.take()),
            stderr: drain(child.stderr.take()),
        }
    }

    fn collect(&mut self) -> (String, String) {
        let join =
            |h: Option<JoinHandle<String>>| h.and_then(|h| h.join().ok()).unwrap_or_default();
        (join(self.stdout.take()), join(self.stderr.take()))
    }
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
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let exact = flag("--exact");
    let chosen = |s: &Scenario| {
        let named = filters.is_empty()
            || filters.iter().any(|f| {
                if exact {
                    s.name == *f
                } else {
                    s.name.contains(f.as_str())
                }
            });
        let ignored_ok = if flag("--include-ignored") {
            true
        } else {
            flag("--ignored") == s.ignore.is_some()
        };
        named && ignored_ok
    };
    if flag("--list") {
        for s in scenarios.iter().filter(|s| chosen(s)) {
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
