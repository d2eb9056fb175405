//! [`ProcessGroup`]: where one process stands in a job of one process per rank (its rank, the
//! number of ranks, its GPU on its host, and where rank 0 listens), from the environment
//! variables distributed launchers set (graft's own, torchrun, Slurm's srun, MPI's: see
//! launchers.rs), or from the API.

use std::fmt;

/// The environment variables graft's own launcher sets for each rank (with `GRAFT_PORT`, equal
/// to `MASTER_PORT`), as torchrun sets them too: what [`ProcessGroup::from_env`] reads when
/// `RANK` or `WORLD_SIZE` is set.
pub const ENV_VARS: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// The launcher whose variables placed a process ([`ProcessGroup::launcher`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[non_exhaustive]
pub enum Launcher {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` without torchrun's
    /// marks: graft's own launcher (`launch_local`, `graft bench tp --procs`), the variables
    /// set by hand, or a group built with [`ProcessGroup::new`].
    Env,
    /// torchrun (torch's elastic agent): the same variables, with `TORCHELASTIC_RUN_ID` or
    /// `GROUP_RANK`.
    Torchrun,
    /// Slurm's srun: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` and the host list.
    Slurm,
    /// An MPI launcher: Open MPI's mpirun (`OMPI_COMM_WORLD_*`), or MPICH's or Intel MPI's
    /// mpiexec (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`).
    Mpi,
}

impl Launcher {
    /// The command that starts ranks this way, for messages.
    pub fn command(self) -> &'static str {
        match self {
            Launcher::Env => "graft's launcher (`graft bench tp --procs`)",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "srun",
            Launcher::Mpi => "mpirun or mpiexec",
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Env => "env",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
            Launcher::Mpi => "mpi",
        })
    }
}

/// The port graft's rendezvous listens on, when set: it wins under every launcher.
pub(crate) const GRAFT_PORT: &str = "GRAFT_PORT";

/// One process's place in a job of one process per rank.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    local_rank: usize,
    master_addr: String,
    master_port: u16,
    launcher: Launcher,
}

/// Errors of [`ProcessGroup::new`] and [`ProcessGroup::from_env`].
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum ProcessGroupError {
    /// A variable the job needs is not set, where `RANK` or `WORLD_SIZE` is (the variables
    /// graft's launcher and torchrun set).
    #[error(
        "the environment variable {var} is not set; start every rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (torchrun and `graft bench tp --procs` set them), or build the group with ProcessGroup::new"
    )]
    Missing {
        /// The variable.
        var: &'static str,
    },
    /// A variable holds something else than what it must.
    #[error("{var}={value:?} is not {expected}; set it to {expected}")]
    BadValue {
        /// The variable.
        var: &'static str,
        /// Its value, as text (lossy where it is not UTF-8).
        value: String,
        /// What it must be, lowercase.
        expected: &'static str,
    },
    /// A job of no ranks.
    #[error("a process group needs at least one rank; set WORLD_SIZE to 1 or more")]
    EmptyWorld,
    /// A rank outside the job.
    #[error(
        "rank {rank} is not below the world size {world}: ranks are numbered 0..WORLD_SIZE; give each process its own rank in that range"
    )]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The number of ranks.
        world: usize,
    },
    /// No address for rank 0.
    #[error("MASTER_ADDR is empty; set it to rank 0's host name or address")]
    EmptyAddress,
    /// No launcher's variables are set: the process was not started as a rank of a job.
    #[error(
        "no launcher placed this process: none of {} is set (RANK or WORLD_SIZE from graft's launcher or torchrun, OMPI_COMM_WORLD_RANK from open mpi's mpirun, PMI_RANK from mpich's or intel mpi's mpiexec, SLURM_PROCID from slurm's srun); start every rank with one of these launchers, set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT by hand, or build the group with ProcessGroup::new",
        .looked_for.join(", ")
    )]
    NoLauncher {
        /// The variables looked for, in the order of precedence ([`LAUNCHER_VARS`]).
        ///
        /// [`LAUNCHER_VARS`]: crate::LAUNCHER_VARS
        looked_for: &'static [&'static str],
    },
    /// Slurm or an MPI launcher placed the process, but one of the variables it sets is not set.
    #[error(
        "{launcher} placed this process but {var} is not set; start every rank with {} (it sets {var}), or set {var} by hand",
        .launcher.command()
    )]
    Incomplete {
        /// The launcher found.
        launcher: Launcher,
        /// The variable it did not set.
        var: &'static str,
    },
    /// An MPI launcher placed the process, but rank 0's address or port is not given: MPI
    /// sets none.
    #[error(
        "an mpi launcher placed this process but {var} is not set, and mpi does not say where rank 0 listens; pass rank 0's host and a free port to every rank, e.g. `mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port> ...` (open mpi) or `mpiexec -genv MASTER_ADDR <rank 0's host> -genv MASTER_PORT <port> ...` (mpich, intel mpi)"
    )]
    MpiAddress {
        /// `MASTER_ADDR` or `MASTER_PORT`.
        var: &'static str,
    },
    /// A Slurm host list that cannot be read, so rank 0's host is not known.
    #[error(
        "{var}={value:?} is not a slurm host list (like node[01-04,07],gpu-a); set MASTER_ADDR to rank 0's host instead"
    )]
    BadHostList {
        /// The variable (`SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST` or `SLURM_NODELIST`).
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// Under torchrun graft listens on `MASTER_PORT + 1`, and `MASTER_PORT` is the last port.
    #[error(
        "under torchrun graft's rendezvous listens on MASTER_PORT + 1 (torchrun's own store holds MASTER_PORT), and MASTER_PORT is {master_port}; pass torchrun a lower --master-port, or set GRAFT_PORT to a free port"
    )]
    NoPortAfter {
        /// torchrun's `MASTER_PORT`.
        master_port: u16,
    },
}

impl ProcessGroup {
    /// A place in a job: rank `rank` of `world` ranks, on its host's GPU `local_rank`, with
    /// rank 0 listening at `master_addr:master_port` (its [`launcher`](Self::launcher) is
    /// [`Launcher::Env`]).
    pub fn new(
        rank: usize,
        world: usize,
        local_rank: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Result<ProcessGroup, ProcessGroupError> {
        let master_addr = master_addr.into();
        if world == 0 {
            return Err(ProcessGroupError::EmptyWorld);
        }
        if rank >= world {
            return Err(ProcessGroupError::RankOutOfRange { rank, world });
        }
        if master_addr.is_empty() {
            return Err(ProcessGroupError::EmptyAddress);
        }
        Ok(ProcessGroup {
            rank,
            world,
            local_rank,
            master_addr,
            master_port,
            launcher: Launcher::Env,
        })
    }

    /// The same place, found by `launcher`.
    pub(crate) fn placed_by(self, launcher: Launcher) -> ProcessGroup {
        ProcessGroup { launcher, ..self }
    }

    /// The same place with rank 0 listening on `port` instead.
    pub(crate) fn with_port(&self, port: u16) -> ProcessGroup {
        ProcessGroup {
            master_port: port,
            ..self.clone()
        }
    }

    /// The environment variables that place a process at `rank` of this job, on its host's
    /// GPU `local_rank`: what a launcher sets for each process it starts. `GRAFT_PORT` (equal
    /// to `MASTER_PORT`) keeps the port where it is when the launcher itself runs under
    /// torchrun, whose variables its processes inherit.
    pub fn env_for(&self, rank: usize, local_rank: usize) -> [(&'static str, String); 6] {
        [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", self.world.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            (GRAFT_PORT, self.master_port.to_string()),
        ]
    }

    /// This process's rank, `0..world`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks (processes) in the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// This process's GPU among its host's (the device ordinal to open).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Rank 0's host name or address.
    pub fn master_addr(&self) -> &str {
        &self.master_addr
    }

    /// The port rank 0 listens on for the rendezvous (not always `MASTER_PORT`: see
    /// [`ProcessGroup::from_env`]).
    pub fn master_port(&self) -> u16 {
        self.master_port
    }

    /// The launcher whose variables placed this process ([`Launcher::Env`] for a group built
    /// with [`ProcessGroup::new`]).
    pub fn launcher(&self) -> Launcher {
        self.launcher
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launchers::tests::vars;

    const GOOD: [(&str, &str); 5] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    /// [`GOOD`] with `var` set to `value`, or unset when `None`.
    fn with(var: &str, value: Option<&str>) -> Vec<(&'static str, String)> {
        GOOD.iter()
            .filter_map(|&(k, v)| match (k == var, value) {
                (false, _) => Some((k, v.to_owned())),
                (true, Some(value)) => Some((k, value.to_owned())),
                (true, None) => None,
            })
            .collect()
    }

    fn parse(pairs: &[(&'static str, String)]) -> Result<ProcessGroup, ProcessGroupError> {
        let borrowed: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        ProcessGroup::from_vars(vars(&borrowed))
    }

    #[test]
    fn the_launchers_variables_place_the_process() {
        let g = ProcessGroup::from_vars(vars(&GOOD)).unwrap();
        assert_eq!(g, ProcessGroup::new(1, 2, 1, "127.0.0.1", 29500).unwrap());
        assert_eq!(g.launcher(), Launcher::Env);
        assert_eq!(
            g.env_for(0, 0).map(|(_, v)| v),
            ["0", "2", "0", "127.0.0.1", "29500", "29500"].map(str::to_owned)
        );
    }

    #[test]
    fn what_graft_launcher_sets_places_each_rank_back() {
        let job = ProcessGroup::new(0, 3, 0, "127.0.0.1", 41000).unwrap();
        let pairs = job.env_for(2, 1);
        let borrowed: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            ProcessGroup::from_vars(vars(&borrowed)),
            ProcessGroup::new(2, 3, 1, "127.0.0.1", 41000)
        );
        // Under torchrun (whose variables the launched ranks inherit) the port stays.
        let mut inherited = borrowed;
        inherited.push(("TORCHELASTIC_RUN_ID", "none"));
        let g = ProcessGroup::from_vars(vars(&inherited)).unwrap();
        assert_eq!((g.launcher(), g.master_port()), (Launcher::Torchrun, 41000));
    }

    #[test]
    fn the_first_missing_variable_is_named() {
        assert_eq!(
            ProcessGroup::from_vars(vars(&[("WORLD_SIZE", "2")])),
            Err(ProcessGroupError::Missing { var: "RANK" })
        );
        assert_eq!(
            ProcessGroup::from_vars(vars(&[("RANK", "0")])),
            Err(ProcessGroupError::Missing { var: "WORLD_SIZE" })
        );
    }

    #[test]
    fn every_variable_is_required() {
        for var in ENV_VARS {
            assert_eq!(
                parse(&with(var, None)),
                Err(ProcessGroupError::Missing { var }),
                "{var}"
            );
        }
    }

    #[test]
    fn bad_values_are_named() {
        assert_eq!(
            parse(&with("RANK", Some("one"))),
            Err(ProcessGroupError::BadValue {
                var: "RANK",
                value: "one".into(),
                expected: "a whole number"
            })
        );
        assert!(matches!(
            parse(&with("MASTER_PORT", Some("70000"))),
            Err(ProcessGroupError::BadValue {
                var: "MASTER_PORT",
                ..
            })
        ));
        assert_eq!(
            parse(&with("RANK", Some("2"))),
            Err(ProcessGroupError::RankOutOfRange { rank: 2, world: 2 })
        );
        assert_eq!(
            parse(&with("WORLD_SIZE", Some("0"))),
            Err(ProcessGroupError::EmptyWorld)
        );
        assert_eq!(
            parse(&with("MASTER_ADDR", Some(" "))),
            Err(ProcessGroupError::EmptyAddress)
        );
    }
}
