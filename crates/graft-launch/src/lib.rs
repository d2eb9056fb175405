//! graft-launch: ranks as processes. A job's configuration ([`ProcessGroup`], from the
//! environment variables launchers set: graft's own, torchrun, Slurm's srun, MPI's; [`Launcher`]
//! says which), its TCP rendezvous ([`Rendezvous`]: rank 0 at the centre of a star, with a
//! broadcast from rank 0 and an all-gather through it, every wait bounded), a group's votes
//! carried over it ([`TcpBallotBox`]), a launcher of such a job on this host ([`launch_local`],
//! with a watchdog), and each rank's [`Watchdog`] on its peers. Pure std: what a device transport
//! needs first (NCCL's unique id travels by [`Rendezvous::broadcast`]) and what the simulator
//! uses in place of one.
//!
//! The vote itself (graft-core's `Member`, `Ballot`, `BallotBox`, `GroupError`) is
//! transport-free and stays in graft-core, which holds no socket; this crate only carries it.
#![forbid(unsafe_code)]

mod config;
mod error;
mod exchange;
mod launch;
mod launchers;
mod rendezvous;
mod tcp_box;
mod watchdog;
mod wire;

pub use config::{ENV_VARS, Launcher, ProcessGroup, ProcessGroupError};
pub use error::{ExchangeError, JoinError};
pub use launch::{LaunchError, RankExit, free_port, launch_local};
pub use launchers::LAUNCHER_VARS;
pub use rendezvous::Rendezvous;
pub use tcp_box::{TcpBallotBox, VOTE_TAG};
pub use watchdog::{Watchdog, WatchdogError};

#[cfg(test)]
mod tests;
