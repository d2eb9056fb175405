//! [`launch_local`]: a job of one process per rank on this host, as a distributed launcher
//! starts it (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, and
//! `GRAFT_PORT` equal to it, set for each), with a watchdog: every rank still running at the deadline is killed, and reported so.

use std::ffi::OsStr;
use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::config::{ProcessGroup, ProcessGroupError};

/// How often the watchdog looks at the ranks.
const POLL: Duration = Duration::from_millis(10);

/// How one rank's process ended.
#[derive(Debug)]
pub struct RankExit {
    /// Its rank.
    pub rank: usize,
    /// Its exit status, or `None` when the watchdog killed it at the deadline.
    pub status: Option<ExitStatus>,
    /// What it wrote to stdout.
    pub stdout: Vec<u8>,
    /// What it wrote to stderr (lossy where it is not UTF-8).
    pub stderr: String,
    /// How long after the launch it ended.
    pub took: Duration,
}

impl RankExit {
    /// Its exit code; `None` when it was killed (by the watchdog or a signal).
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }
}

/// Errors of [`launch_local`].
#[derive(thiserror::Error, Debug)]
pub enum LaunchError {
    /// No loopback port could be had for the rendezvous.
    #[error("no free loopback port for the rendezvous ({source}); free one, or set MASTER_PORT")]
    NoPort {
        /// The system's error.
        source: std::io::Error,
    },
    /// The job's place cannot be made (no ranks, or a rank outside `0..world`).
    #[error(transparent)]
    Job(#[from] ProcessGroupError),
    /// A rank's process did not start; the ranks already started were killed.
    #[error("rank {rank}'s process did not start: {source}; check the program's path")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The system's error.
        source: std::io::Error,
    },
    /// The system could not say whether a rank's process is running; every rank was killed.
    #[error("rank {rank}'s process cannot be waited for: {source}")]
    Wait {
        /// The rank.
        rank: usize,
        /// The system's error.
        source: std::io::Error,
    },
}

/// A loopback port free now (bound, then released), for a job's rendezvous on this host.
pub fn free_port() -> Result<u16, LaunchError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| LaunchError::NoPort { source })
}

/// How long a rank's output may keep coming after it ended (a process it started may hold its
/// pipes open): what came by then is its output.
const OUTPUT_GRACE: Duration = Duration::from_secs(1);

/// The bytes read so far from one of a rank's pipes, and whether it reached its end.
#[derive(Default)]
struct Drained {
    bytes: Vec<u8>,
    ended: bool,
}

/// A thread that reads `pipe` into a shared buffer as it comes, so that a chatty rank never
/// blocks on a full pipe and a killed one's output so far can be had without waiting for the
/// pipe to close.
fn drain(pipe: Option<impl Read + Send + 'static>) -> Arc<Mutex<Drained>> {
    let drained = Arc::new(Mutex::new(Drained::default()));
    if let Some(mut pipe) = pipe {
        let sink = drained.clone();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            loop {
                let n = pipe.read(&mut chunk).unwrap_or(0);
                let mut d = sink.lock().unwrap_or_else(PoisonError::into_inner);
                d.bytes.extend_from_slice(&chunk[..n]);
                if n == 0 {
                    d.ended = true;
                    return;
                }
            }
        });
    } else {
        drained.lock().unwrap_or_else(PoisonError::into_inner).ended = true;
    }
    drained
}

/// What `drained` holds once its pipe ended, or at `by`, whichever comes first.
fn collect(drained: &Mutex<Drained>, by: Instant) -> Vec<u8> {
    loop {
        let d = drained.lock().unwrap_or_else(PoisonError::into_inner);
        if d.ended || Instant::now() >= by {
            return d.bytes.clone();
        }
        drop(d);
        std::thread::sleep(POLL);
    }
}

/// A running rank and its output so far.
struct Running {
    rank: usize,
    child: Child,
    stdout: Arc<Mutex<Drained>>,
    stderr: Arc<Mutex<Drained>>,
}

impl Running {
    /// Kills the process and reaps it (it is this launcher's own child).
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn exit(&mut self, status: Option<ExitStatus>, took: Duration) -> RankExit {
        let by = Instant::now() + OUTPUT_GRACE;
        RankExit {
            rank: self.rank,
            status,
            stdout: collect(&self.stdout, by),
            stderr: String::from_utf8_lossy(&collect(&self.stderr, by)).into_owned(),
            took,
        }
    }
}

/// Starts `ranks` (a subset of `0..world`, usually all) of a job of `world` ranks on this host,
/// each `program` with `args`, the job's variables for its rank (on a free loopback port:
/// `LOCAL_RANK` is the rank) and `env`; waits for every one at most `deadline`, killing those
/// still running then. With `fail_fast`, a rank that exits with a failure gets the others
/// killed at once (the job cannot finish without it). Returns how each ended, in the order of
/// `ranks`.
pub fn launch_local<A: AsRef<OsStr>>(
    program: &Path,
    args: &[A],
    world: usize,
    ranks: &[usize],
    env: &[(&str, String)],
    deadline: Duration,
    fail_fast: bool,
) -> Result<Vec<RankExit>, LaunchError> {
    let job = ProcessGroup::new(0, world, 0, "127.0.0.1", free_port()?)?;
    if let Some(&rank) = ranks.iter().find(|&&r| r >= world) {
        return Err(ProcessGroupError::RankOutOfRange { rank, world }.into());
    }
    let start = Instant::now();
    let mut running: Vec<Running> = Vec::with_capacity(ranks.len());
    for &rank in ranks {
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // The job's variables, as `ProcessGroup::from_env` reads them.
        command.envs(job.env_for(rank, rank));
        command.envs(env.iter().map(|(k, v)| (k, v)));
        match command.spawn() {
            Ok(mut child) => running.push(Running {
                rank,
                stdout: drain(child.stdout.take()),
                stderr: drain(child.stderr.take()),
                child,
            }),
            Err(source) => {
                running.iter_mut().for_each(Running::kill);
                return Err(LaunchError::Spawn { rank, source });
            }
        }
    }
    let mut ended: Vec<Option<RankExit>> = running.iter().map(|_| None).collect();
    while ended.iter().any(Option::is_none) {
        let failed = ended
            .iter()
            .flatten()
            .any(|e| !e.status.is_some_and(|s| s.success()));
        let overdue = start.elapsed() >= deadline || fail_fast && failed;
        for (i, r) in running.iter_mut().enumerate() {
            if ended[i].is_some() {
                continue;
            }
            let status = match r.child.try_wait() {
                Ok(Some(status)) => Some(status),
                Ok(None) if overdue => {
                    r.kill();
                    None
                }
                Ok(None) => continue,
                Err(source) => {
                    let rank = r.rank;
                    running.iter_mut().for_each(Running::kill);
                    return Err(LaunchError::Wait { rank, source });
                }
            };
            ended[i] = Some(r.exit(status, start.elapsed()));
        }
        std::thread::sleep(POLL);
    }
    Ok(ended.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, world: usize, deadline: Duration, fail_fast: bool) -> Vec<RankExit> {
        let ranks: Vec<usize> = (0..world).collect();
        let args = ["-c", script];
        launch_local(
            Path::new("/bin/sh"),
            &args,
            world,
            &ranks,
            &[],
            deadline,
            fail_fast,
        )
        .unwrap()
    }

    #[test]
    fn every_rank_gets_its_place_and_its_output_comes_back() {
        let exits = sh(
            "echo $RANK/$WORLD_SIZE/$LOCAL_RANK@$MASTER_ADDR; exit $RANK",
            2,
            Duration::from_secs(20),
            false,
        );
        for (rank, e) in exits.iter().enumerate() {
            assert_eq!(e.rank, rank);
            assert_eq!(e.code(), Some(rank as i32));
            assert_eq!(
                String::from_utf8_lossy(&e.stdout),
                format!("{rank}/2/{rank}@127.0.0.1\n")
            );
        }
    }

    #[test]
    fn the_watchdog_kills_ranks_past_the_deadline() {
        let start = Instant::now();
        let exits = sh(
            "if [ $RANK = 1 ]; then sleep 30; fi",
            2,
            Duration::from_millis(300),
            false,
        );
        assert!(start.elapsed() < Duration::from_secs(10));
        assert_eq!(exits[0].code(), Some(0));
        assert!(exits[1].status.is_none(), "{:?}", exits[1]);
    }

    #[test]
    fn fail_fast_kills_the_others_when_a_rank_fails() {
        let start = Instant::now();
        let script = "if [ $RANK = 1 ]; then exit 4; fi; sleep 30";
        let exits = sh(script, 2, Duration::from_secs(60), true);
        assert!(start.elapsed() < Duration::from_secs(10));
        assert_eq!(exits[1].code(), Some(4));
        assert!(exits[0].status.is_none(), "{:?}", exits[0]);
    }

    #[test]
    fn a_program_that_does_not_exist_is_a_spawn_error() {
        let err = launch_local(
            Path::new("/nonexistent/graft-rank"),
            &[] as &[&str],
            1,
            &[0],
            &[],
            Duration::from_secs(1),
            false,
        )
        .unwrap_err();
        assert!(matches!(err, LaunchError::Spawn { rank: 0, .. }), "{err}");
    }
}
