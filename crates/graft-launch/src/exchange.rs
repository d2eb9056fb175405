//! The rendezvous's two exchanges, through rank 0: a broadcast of rank 0's bytes, and an
//! all-gather of one fixed-size part per rank. Rank 0 decides each all-gather's outcome (every
//! part arrived, or which did not) and tells every rank, so all ranks agree on it whenever
//! rank 0 can reach them.

use std::time::{Duration, Instant};

use crate::error::ExchangeError;
use crate::rendezvous::{Rendezvous, link_error};
use crate::wire::{self, Kind, WireError};

/// How a failed all-gather travels from rank 0: its kind, then its fields as words.
const ABORT_TIMEOUT: u64 = 1;
const ABORT_LOST: u64 = 2;
const ABORT_OUT_OF_STEP: u64 = 3;

/// What can be out of step, by the code it travels as.
const OUT_OF_STEP: [&str; 3] = [
    "bytes that are no message",
    "a message of another kind or size than its part of this all-gather",
    "a part of an all-gather with another tag",
];

impl Rendezvous {
    /// Runs one exchange unless an earlier one failed; remembers its failure.
    fn guarded<T>(
        &mut self,
        op: impl FnOnce(&mut Rendezvous) -> Result<T, ExchangeError>,
    ) -> Result<T, ExchangeError> {
        if let Some(cause) = &self.failed {
            return Err(ExchangeError::Failed {
                rank: self.rank,
                cause: Box::new(cause.clone()),
            });
        }
        let result = op(self);
        if let Err(e) = &result {
            self.failed = Some(e.clone());
        }
        result
    }

    /// Rank 0's `data` into every rank's `data` (all of one length), each rank waiting at most
    /// about `timeout`.
    pub fn broadcast(&mut self, data: &mut [u8], timeout: Duration) -> Result<(), ExchangeError> {
        self.guarded(|rv| {
            let start = Instant::now();
            if rv.rank == 0 {
                let until = start + timeout;
                for (i, link) in rv.links.iter_mut().enumerate() {
                    wire::send(link, Kind::Broadcast, 0, data, until)
                        .map_err(|e| link_error(0, i + 1, e, start.elapsed()))?;
                }
                return Ok(());
            }
            let until = start + timeout + wire::grace(timeout);
            let rank = rv.rank;
            let Some(link) = rv.links.first_mut() else {
                return Ok(());
            };
            let frame =
                wire::receive(link, until).map_err(|e| link_error(rank, 0, e, start.elapsed()))?;
            if frame.kind != Kind::Broadcast || frame.payload.len() != data.len() {
                return Err(ExchangeError::OutOfStep {
                    rank,
                    peer: 0,
                    what: "a message of another kind or size than the broadcast",
                });
            }
            data.copy_from_slice(&frame.payload);
            Ok(())
        })
    }

    /// Every rank's `part` (all of one length), in rank order, on every rank. `tag` names the
    /// all-gather: ranks whose next all-gathers carry different tags are out of step. Rank 0
    /// waits at most `timeout` for the others' parts, then answers every rank; the others wait
    /// for that answer a little longer (so that rank 0's report of a timeout reaches them).
    pub fn all_gather(
        &mut self,
        tag: u32,
        part: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, ExchangeError> {
        self.guarded(|rv| {
            if rv.rank == 0 {
                rv.gather_at_hub(u64::from(tag), part, timeout)
            } else {
                rv.gather_at_spoke(u64::from(tag), part, timeout)
            }
        })
    }

    fn gather_at_hub(
        &mut self,
        tag: u64,
        part: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, ExchangeError> {
        let start = Instant::now();
        let until = start + timeout;
        let mut gathered = Vec::with_capacity(part.len() * self.world);
        gathered.extend_from_slice(part);
        let mut missing = Vec::new();
        let mut abort = None;
        for (i, link) in self.links.iter_mut().enumerate() {
            let peer = i + 1;
            // Past the deadline, only parts that already arrived count.
            let by = if missing.is_empty() {
                until
            } else {
                Instant::now()
            };
            match wire::receive(link, by) {
                Ok(f) if f.kind == Kind::Part && f.word == tag && f.payload.len() == part.len() => {
                    gathered.extend_from_slice(&f.payload);
                }
                Ok(f) => {
                    let tag_differs = f.kind == Kind::Part && f.payload.len() == part.len();
                    let code = if tag_differs { 2 } else { 1 };
                    abort = Some(Abort::OutOfStep { peer, code });
                    break;
                }
                Err(WireError::TimedOut) => missing.push(peer),
                Err(WireError::Lost(kind)) => {
                    abort = Some(Abort::Lost { peer, kind });
                    break;
                }
                Err(WireError::Garbled) => {
                    abort = Some(Abort::OutOfStep { peer, code: 0 });
                    break;
                }
            }
        }
        let abort = abort.or_else(|| {
            (!missing.is_empty()).then(|| Abort::Missing {
                // Whole microseconds, as the report carries it: every rank says the same.
                waited: Duration::from_micros(wire::micros(start.elapsed())),
                missing,
            })
        });
        let answer_by = Instant::now() + timeout;
        if let Some(abort) = abort {
            let report = wire::bytes_of(&abort.words());
            for link in &mut self.links {
                // Best effort: a rank that cannot be told finds out when its own wait ends.
                let _ = wire::send(link, Kind::Aborted, tag, &report, answer_by);
            }
            return Err(abort.error());
        }
        let mut first_error = None;
        for (i, link) in self.links.iter_mut().enumerate() {
            if let Err(e) = wire::send(link, Kind::Gathered, tag, &gathered, answer_by) {
                first_error.get_or_insert(link_error(0, i + 1, e, start.elapsed()));
            }
        }
        first_error.map_or(Ok(gathered), Err)
    }

    fn gather_at_spoke(
        &mut self,
        tag: u64,
        part: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, ExchangeError> {
        let start = Instant::now();
        let (rank, world) = (self.rank, self.world);
        let Some(link) = self.links.first_mut() else {
            return Ok(part.to_vec());
        };
        let failed = |e| link_error(rank, 0, e, start.elapsed());
        wire::send(link, Kind::Part, tag, part, start + timeout).map_err(failed)?;
        let answer = wire::receive(link, start + timeout + wire::grace(timeout)).map_err(failed)?;
        match answer.kind {
            Kind::Gathered if answer.word == tag && answer.payload.len() == part.len() * world => {
                Ok(answer.payload)
            }
            Kind::Aborted => Err(ExchangeError::Aborted {
                rank,
                cause: Box::new(
                    Abort::from_words(&wire::all_words(&answer.payload))
                        .ok_or(ExchangeError::OutOfStep {
                            rank,
                            peer: 0,
                            what: "a failure report it cannot read",
                        })?
                        .error(),
                ),
            }),
            _ => Err(ExchangeError::OutOfStep {
                rank,
                peer: 0,
                what: "an answer of another kind or size than this all-gather's",
            }),
        }
    }
}

/// Why rank 0 failed an all-gather, as it tells the other ranks.
#[derive(Debug)]
enum Abort {
    /// These ranks' parts did not arrive within the timeout.
    Missing {
        waited: Duration,
        missing: Vec<usize>,
    },
    /// The connection to `peer` closed or failed.
    Lost {
        peer: usize,
        kind: std::io::ErrorKind,
    },
    /// `peer` sent `OUT_OF_STEP[code]`.
    OutOfStep { peer: usize, code: usize },
}

impl Abort {
    fn words(&self) -> Vec<u64> {
        match self {
            Abort::Missing { waited, missing } => {
                let mut w = vec![ABORT_TIMEOUT, wire::micros(*waited)];
                w.extend(missing.iter().map(|&r| r as u64));
                w
            }
            Abort::Lost { peer, kind } => vec![ABORT_LOST, *peer as u64, wire::kind_code(*kind)],
            Abort::OutOfStep { peer, code } => vec![ABORT_OUT_OF_STEP, *peer as u64, *code as u64],
        }
    }

    /// [`Abort::words`] read back, or `None` when they are not a report.
    fn from_words(words: &[u64]) -> Option<Abort> {
        let usize_of = |w: u64| usize::try_from(w).ok();
        match words {
            [ABORT_TIMEOUT, waited, missing @ ..] => Some(Abort::Missing {
                waited: Duration::from_micros(*waited),
                missing: missing
                    .iter()
                    .map(|&r| usize_of(r))
                    .collect::<Option<_>>()?,
            }),
            [ABORT_LOST, peer, kind] => Some(Abort::Lost {
                peer: usize_of(*peer)?,
                kind: wire::kind_of(*kind),
            }),
            [ABORT_OUT_OF_STEP, peer, code] => Some(Abort::OutOfStep {
                peer: usize_of(*peer)?,
                code: usize_of(*code).filter(|&c| c < OUT_OF_STEP.len())?,
            }),
            _ => None,
        }
    }

    /// Rank 0's error.
    fn error(self) -> ExchangeError {
        match self {
            Abort::Missing { waited, missing } => ExchangeError::Timeout {
                rank: 0,
                waited,
                missing,
            },
            Abort::Lost { peer, kind } => ExchangeError::Lost {
                rank: 0,
                peer,
                kind,
            },
            Abort::OutOfStep { peer, code } => ExchangeError::OutOfStep {
                rank: 0,
                peer,
                what: OUT_OF_STEP[code],
            },
        }
    }
}
