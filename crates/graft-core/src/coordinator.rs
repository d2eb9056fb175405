//! `Coordinator`: one thread per rank, each owning its rank's state (its `Graft`, its shard of
//! the model), and `step`, which runs one closure on every rank together.

use std::any::Any;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::group::{GroupError, Member};

type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

/// Errors of [`Coordinator::start`].
#[derive(thiserror::Error, Debug)]
pub enum StartError<E: std::error::Error + 'static> {
    /// The group could not be made (no ranks).
    #[error(transparent)]
    Group(#[from] GroupError),
    /// The operating system refused a rank's thread.
    #[error("could not start the thread of rank {rank}: {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The system's error.
        source: std::io::Error,
    },
    /// A rank's state could not be built; the ranks already started were stopped.
    #[error("rank {rank} could not start: {source}")]
    Init {
        /// The lowest rank that failed.
        rank: usize,
        /// Its error.
        source: E,
    },
    /// A rank's initializer panicked; the ranks already started were stopped.
    #[error("rank {rank} panicked while starting: {message}")]
    InitPanicked {
        /// The rank.
        rank: usize,
        /// The panic's message.
        message: String,
    },
}

/// Errors of [`Coordinator::step`].
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum StepError {
    /// The closure panicked on a rank. Every other rank finished its part of the step; graft
    /// itself stays consistent across a panicking body (see the guide), the rest of the
    /// rank's state is whatever the closure left.
    #[error(
        "the step panicked on rank {rank}: {message}; the other ranks finished theirs (a panic while recording fails that recording on every rank)"
    )]
    Panicked {
        /// The lowest rank that panicked.
        rank: usize,
        /// The panic's message.
        message: String,
    },
}

/// One thread per rank of a tensor-parallel group, each owning the state `S` its initializer
/// built on that thread (typically the rank's [`Graft`](crate::Graft), joined to the group
/// with the [`Member`] it was given, and its shard of the model).
///
/// [`Coordinator::step`] starts the same closure on every rank at once and returns when all
/// have finished, so every rank makes the same graft calls in the same order: what
/// collectives inside recorded graphs need. It costs two channel messages per rank per step.
pub struct Coordinator<S> {
    workers: Vec<Worker<S>>,
}

struct Worker<S> {
    jobs: Option<mpsc::Sender<Job<S>>>,
    thread: Option<JoinHandle<()>>,
}

impl<S> fmt::Debug for Coordinator<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Coordinator")
            .field("world", &self.workers.len())
            .finish_non_exhaustive()
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_owned())
}

impl<S: 'static> Coordinator<S> {
    /// Starts one thread per element of `seeds` (rank `i` gets `seeds[i]`, for example its
    /// device and communicator) and builds each rank's state there with `init`, which also
    /// gets the rank's [`Member`] of a new group whose recordings wait at most
    /// `agreement_timeout` for each other. Fails with the lowest failing rank's error, after
    /// stopping every rank.
    pub fn start<T, E, F>(
        seeds: Vec<T>,
        agreement_timeout: Duration,
        init: F,
    ) -> Result<Coordinator<S>, StartError<E>>
    where
        T: Send + 'static,
        E: std::error::Error + Send + 'static,
        F: Fn(T, Member) -> Result<S, E> + Send + Sync + 'static,
    {
        let members = Member::group(seeds.len(), agreement_timeout)?;
        let init = Arc::new(init);
        let (ready_tx, ready_rx) = mpsc::channel();
        let mut coordinator = Coordinator {
            workers: Vec::new(),
        };
        for (rank, (seed, member)) in seeds.into_iter().zip(members).enumerate() {
            let (jobs, rx) = mpsc::channel::<Job<S>>();
            let init = init.clone();
            let ready = ready_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("graft-rank-{rank}"))
                .spawn(move || {
                    let built = catch_unwind(AssertUnwindSafe(|| init(seed, member)));
                    let mut state = match built {
                        Ok(Ok(state)) => {
                            let _ = ready.send((rank, Ok(())));
                            state
                        }
                        Ok(Err(e)) => {
                            let _ = ready.send((rank, Err(Ok(e))));
                            return;
                        }
                        Err(panic) => {
                            let _ = ready.send((rank, Err(Err(panic_message(&*panic)))));
                            return;
                        }
                    };
                    drop(ready);
                    for job in rx {
                        job(&mut state);
                    }
                })
                .map_err(|source| StartError::Spawn { rank, source })?;
            coordinator.workers.push(Worker {
                jobs: Some(jobs),
                thread: Some(thread),
            });
        }
        drop(ready_tx);
        let mut failed: Vec<(usize, Result<E, String>)> = Vec::new();
        for (rank, ready) in ready_rx {
            if let Err(e) = ready {
                failed.push((rank, e));
            }
        }
        failed.sort_by_key(|(rank, _)| *rank);
        match failed.into_iter().next() {
            None => Ok(coordinator),
            Some((rank, Ok(source))) => Err(StartError::Init { rank, source }),
            Some((rank, Err(message))) => Err(StartError::InitPanicked { rank, message }),
        }
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.workers.len()
    }

    /// Runs `f(rank, state)` on every rank's thread at once and returns the results in rank
    /// order, once every rank has finished.
    pub fn step<R, F>(&self, f: F) -> Result<Vec<R>, StepError>
    where
        R: Send + 'static,
        F: Fn(usize, &mut S) -> R + Send + Sync + 'static,
    {
        let f = Arc::new(f);
        let (tx, rx) = mpsc::channel();
        for (rank, worker) in self.workers.iter().enumerate() {
            let (f, tx) = (f.clone(), tx.clone());
            let job: Job<S> = Box::new(move |state: &mut S| {
                let result = catch_unwind(AssertUnwindSafe(|| f(rank, state)));
                let _ = tx.send((rank, result.map_err(|p| panic_message(&*p))));
            });
            if let Some(jobs) = &worker.jobs
                && jobs.send(job).is_err()
            {
                // The thread is gone only if its initializer failed, and then `start` failed.
                unreachable!("a started rank's thread runs until the coordinator is dropped");
            }
        }
        drop(tx);
        let mut results: Vec<Option<R>> = (0..self.workers.len()).map(|_| None).collect();
        let mut panicked: Option<(usize, String)> = None;
        for (rank, result) in rx {
            match result {
                Ok(r) => results[rank] = Some(r),
                Err(message) => {
                    if panicked.as_ref().is_none_or(|(p, _)| rank < *p) {
                        panicked = Some((rank, message));
                    }
                }
            }
        }
        if let Some((rank, message)) = panicked {
            return Err(StepError::Panicked { rank, message });
        }
        Ok(results.into_iter().flatten().collect())
    }
}

impl<S> Drop for Coordinator<S> {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.jobs.take();
        }
        for w in &mut self.workers {
            if let Some(thread) = w.thread.take() {
                // Jobs catch their panics, so the thread only ends by its channel closing.
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("no state for rank {0}")]
    struct NoState(usize);

    #[test]
    fn steps_run_on_every_rank_in_order() {
        let c = Coordinator::start(vec![10, 20, 30], Duration::from_secs(5), |seed, m| {
            Ok::<_, NoState>((seed, m.rank(), std::thread::current().id()))
        })
        .unwrap();
        let out = c.step(|rank, s| (rank, s.0, s.1)).unwrap();
        assert_eq!(out, vec![(0, 10, 0), (1, 20, 1), (2, 30, 2)]);
        let threads = c.step(|_, s| s.2).unwrap();
        assert!(threads.iter().all(|t| *t != std::thread::current().id()));
        assert_ne!(threads[0], threads[1]);
    }

    #[test]
    fn a_panicking_rank_is_reported_and_the_others_go_on() {
        let c = Coordinator::start(vec![(); 2], Duration::from_secs(5), |(), _| {
            Ok::<_, NoState>(0u32)
        })
        .unwrap();
        let err = c
            .step(|rank, n| {
                *n += 1;
                assert!(rank != 1, "boom");
            })
            .unwrap_err();
        assert!(
            matches!(&err, StepError::Panicked { rank: 1, message } if message.contains("boom")),
            "{err}"
        );
        assert_eq!(c.step(|_, n| *n).unwrap(), vec![1, 1]);
    }

    #[test]
    fn a_failing_initializer_stops_every_rank() {
        let err = Coordinator::<u32>::start(vec![0, 1, 2], Duration::from_secs(5), |seed, _| {
            if seed == 1 { Err(NoState(seed)) } else { Ok(0) }
        })
        .unwrap_err();
        assert!(matches!(err, StartError::Init { rank: 1, .. }), "{err}");
    }
}
