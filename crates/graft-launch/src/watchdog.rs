//! [`Watchdog`]: each rank's watch on its peers, so that a rank whose peer died or stopped
//! returns within a bound wherever it waits (a vote, a collective, a replay whose recorded
//! collective waits on the peer). It keeps a TCP star of its own beside the job's rendezvous
//! (rank 0 at the centre): every rank sends a heartbeat a few times per bound; a link that
//! closes (the process ended) or stays silent past the bound (stopped, hung) is a loss. On a
//! loss it breaks the rank's group (every later call and read refuses) and then runs the
//! caller's `on_loss` (abort the communicators, so that what waits on the peer returns).

use std::io::ErrorKind;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::ProcessGroup;
use crate::error::{ExchangeError, JoinError};
use crate::rendezvous::Rendezvous;
use crate::wire::{self, Kind, WireError};
use graft_core::{Gone, GroupError, Member};

/// What runs once, on the first loss a watchdog finds.
type OnLoss = Box<dyn FnOnce(&GroupError) + Send>;

/// Errors of [`Watchdog::start`].
#[derive(thiserror::Error, Debug)]
pub enum WatchdogError {
    /// Rank 0 found no free port for the watchdog's star on MASTER_ADDR.
    #[error(
        "rank 0 cannot find a free port for the watchdog on {addr} ({source}); check that MASTER_ADDR is this host's"
    )]
    Port {
        /// MASTER_ADDR.
        addr: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// The watchdog's port did not reach every rank over the job's rendezvous.
    #[error("the watchdog's port did not reach every rank: {0}")]
    Exchange(#[from] ExchangeError),
    /// The ranks could not join the watchdog's star.
    #[error("the ranks could not join the watchdog's star: {0}")]
    Join(#[from] JoinError),
    /// A thread could not be started.
    #[error("cannot start the watchdog's threads ({0}); the system is out of threads or memory")]
    Thread(std::io::Error),
}

/// One rank's watch on its peers (see the module). Start it on every rank of a job right after
/// the communicators are made, keep it for the job's life, drop it when the rank is done: it
/// says goodbye, so its peers do not take the end of the job for a loss.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    /// The write ends of the star's links (rank 0: one per other rank; others: to rank 0).
    writers: Arc<Vec<Mutex<TcpStream>>>,
    /// Wakes the heartbeat thread (dropped to stop it).
    wake: Option<Sender<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("links", &self.writers.len())
            .finish_non_exhaustive()
    }
}

/// What the threads of one watchdog share.
struct Watch {
    rank: usize,
    stop: Arc<AtomicBool>,
    writers: Arc<Vec<Mutex<TcpStream>>>,
    member: Member,
    on_loss: Mutex<Option<OnLoss>>,
}

impl Watchdog {
    /// How long a peer may stay silent before it counts as lost, unless told otherwise.
    pub const DEFAULT_BOUND: Duration = Duration::from_secs(10);

    /// Starts this rank's watchdog: rank 0 picks a port and sends it over `rv` (every rank of
    /// the job must call this at the same point), the ranks join a star on it within `join`,
    /// and from then on a peer that closes its link or stays silent for `bound` breaks
    /// `member`'s group, then `on_loss` runs once with the error (on the watchdog's thread):
    /// abort the job's communicators there.
    pub fn start(
        rv: &mut Rendezvous,
        place: &ProcessGroup,
        join: Duration,
        bound: Duration,
        member: &Member,
        on_loss: impl FnOnce(&GroupError) + Send + 'static,
    ) -> Result<Watchdog, WatchdogError> {
        let mut port = [0u8; 2];
        if place.rank() == 0 {
            let addr = place.master_addr().to_owned();
            let free = TcpListener::bind((addr.as_str(), 0))
                .and_then(|l| l.local_addr())
                .map_err(|source| WatchdogError::Port { addr, source })?;
            port = free.port().to_le_bytes();
        }
        rv.broadcast(&mut port, join)?;
        let star = place.with_port(u16::from_le_bytes(port));
        let star = Rendezvous::join(&star, join)?;
        let stop = Arc::new(AtomicBool::new(false));
        let writers = star
            .links
            .iter()
            .map(|l| l.try_clone().map(Mutex::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(WatchdogError::Thread)?;
        let writers = Arc::new(writers);
        let watch = Arc::new(Watch {
            rank: place.rank(),
            stop: stop.clone(),
            writers: writers.clone(),
            member: member.clone(),
            on_loss: Mutex::new(Some(Box::new(on_loss))),
        });
        let (wake, asleep) = mpsc::channel();
        let mut dog = Watchdog {
            stop,
            writers,
            wake: Some(wake),
            threads: Vec::new(),
        };
        let beats = watch.clone();
        dog.spawn("graft-watchdog-beat", move || {
            beats.beat(&asleep, bound / 4)
        })?;
        for (i, link) in star.links.into_iter().enumerate() {
            let peer = if place.rank() == 0 { i + 1 } else { 0 };
            let listens = watch.clone();
            dog.spawn("graft-watchdog-listen", move || {
                listens.listen(link, i, peer, bound);
            })?;
        }
        tracing::debug!(rank = place.rank(), ?bound, "watchdog started");
        Ok(dog)
    }

    fn spawn(
        &mut self,
        name: &str,
        body: impl FnOnce() + Send + 'static,
    ) -> Result<(), WatchdogError> {
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(body)
            .map_err(WatchdogError::Thread)?;
        self.threads.push(handle);
        Ok(())
    }
}

impl Drop for Watchdog {
    /// Says goodbye to every peer, closes the links and joins the threads (each wakes at once).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let until = Instant::now() + Duration::from_millis(200);
        for w in self.writers.iter() {
            let mut w = w.lock().unwrap_or_else(PoisonError::into_inner);
            // Best effort: a peer that misses it finds the link closed, after its own end.
            let _ = wire::send(&mut w, Kind::Bye, 0, &[], until);
            let _ = w.shutdown(Shutdown::Both);
        }
        self.wake = None;
        for t in self.threads.drain(..) {
            // A watchdog thread that panicked has nothing left to clean up.
            let _ = t.join();
        }
    }
}

impl Watch {
    /// Sends a heartbeat on every link each `every`, until the watchdog stops.
    fn beat(&self, asleep: &mpsc::Receiver<()>, every: Duration) {
        loop {
            for w in self.writers.iter() {
                let mut w = w.lock().unwrap_or_else(PoisonError::into_inner);
                // A failed send shows up on that link's listener.
                let _ = wire::send(&mut w, Kind::Beat, 0, &[], Instant::now() + every);
            }
            match asleep.recv_timeout(every) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Reads link `index` (to `peer`) until the peer says goodbye, or is found gone.
    fn listen(&self, mut link: TcpStream, index: usize, peer: usize, bound: Duration) {
        loop {
            let gone = match wire::receive(&mut link, Instant::now() + bound) {
                Ok(f) if f.kind == Kind::Beat => continue,
                Ok(f) if f.kind == Kind::Bye => return,
                Ok(f) if f.kind == Kind::Gone => {
                    let Ok(gone) = usize::try_from(f.word) else {
                        continue;
                    };
                    self.lost(gone, Gone::Reported, None);
                    return;
                }
                Ok(_) => continue,
                Err(WireError::TimedOut) => Gone::Silent(bound),
                Err(WireError::Lost(kind)) => Gone::Closed(kind),
                Err(WireError::Garbled) => Gone::Closed(ErrorKind::InvalidData),
            };
            self.lost(peer, gone, Some(index));
            return;
        }
    }

    /// Rank `peer` is gone: breaks the group, tells the other ranks (rank 0), runs `on_loss`
    /// (the first loss only). Nothing when the watchdog is stopping (its own links closing).
    fn lost(&self, peer: usize, gone: Gone, index: Option<usize>) {
        if self.stop.load(Ordering::Acquire) {
            return;
        }
        let error = GroupError::Watchdog {
            rank: self.rank,
            peer,
            gone,
        };
        tracing::warn!(%error, "watchdog: a peer is gone");
        self.member.note(&error);
        if self.rank == 0 {
            let until = Instant::now() + Duration::from_millis(200);
            for (i, w) in self.writers.iter().enumerate() {
                if Some(i) != index {
                    let mut w = w.lock().unwrap_or_else(PoisonError::into_inner);
                    // Best effort: a rank that misses it finds rank 0 gone in its turn.
                    let _ = wire::send(&mut w, Kind::Gone, peer as u64, &[], until);
                }
            }
        }
        let on_loss = self
            .on_loss
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(on_loss) = on_loss {
            on_loss(&error);
        }
    }
}
