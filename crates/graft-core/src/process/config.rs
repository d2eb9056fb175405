//! [`ProcessGroup`]: where one process stands in a job of one process per rank (its rank, the
//! number of ranks, its GPU on its host, and where rank 0 listens), from the environment
//! variables distributed launchers set, or from the API.

use std::ffi::OsString;

/// The environment variables [`ProcessGroup::from_env`] reads, as torchrun and most launchers
/// set them.
pub const ENV_VARS: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// One process's place in a job of one process per rank.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    local_rank: usize,
    master_addr: String,
    master_port: u16,
}

/// Errors of [`ProcessGroup::new`] and [`ProcessGroup::from_env`].
#[derive(thiserror::Error, Clone, PartialEq, Eq, Debug)]
pub enum ProcessGroupError {
    /// A variable the job needs is not set.
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
}

impl ProcessGroup {
    /// A place in a job: rank `rank` of `world` ranks, on its host's GPU `local_rank`, with
    /// rank 0 listening at `master_addr:master_port`.
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
        })
    }

    /// The same place with rank 0 listening on `port` instead.
    pub(super) fn with_port(&self, port: u16) -> ProcessGroup {
        ProcessGroup {
            master_port: port,
            ..self.clone()
        }
    }

    /// This process's place, from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
    /// `MASTER_PORT` ([`ENV_VARS`]).
    pub fn from_env() -> Result<ProcessGroup, ProcessGroupError> {
        ProcessGroup::from_vars(|var| std::env::var_os(var))
    }

    /// As [`ProcessGroup::from_env`], reading the variables through `get`.
    fn from_vars(
        get: impl Fn(&str) -> Option<OsString>,
    ) -> Result<ProcessGroup, ProcessGroupError> {
        let text = |var: &'static str| -> Result<String, ProcessGroupError> {
            let value = get(var).ok_or(ProcessGroupError::Missing { var })?;
            value
                .into_string()
                .map_err(|v| ProcessGroupError::BadValue {
                    var,
                    value: v.to_string_lossy().into_owned(),
                    expected: "text",
                })
        };
        let number = |var: &'static str| -> Result<usize, ProcessGroupError> {
            let value = text(var)?;
            value
                .trim()
                .parse()
                .map_err(|_| ProcessGroupError::BadValue {
                    var,
                    value,
                    expected: "a whole number",
                })
        };
        // In the order of ENV_VARS, so that the first missing one is named first.
        let (rank, world, local_rank) = (
            number("RANK")?,
            number("WORLD_SIZE")?,
            number("LOCAL_RANK")?,
        );
        let master_addr = text("MASTER_ADDR")?;
        let port = text("MASTER_PORT")?;
        let master_port = port
            .trim()
            .parse()
            .map_err(|_| ProcessGroupError::BadValue {
                var: "MASTER_PORT",
                value: port,
                expected: "a port number (0 to 65535)",
            })?;
        ProcessGroup::new(rank, world, local_rank, master_addr.trim(), master_port)
    }

    /// The environment variables that place a process at `rank` of this job, on its host's
    /// GPU `local_rank`: what a launcher sets for each process it starts.
    pub fn env_for(&self, rank: usize, local_rank: usize) -> [(&'static str, String); 5] {
        [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", self.world.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
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

    /// The port rank 0 listens on for the rendezvous.
    pub fn master_port(&self) -> u16 {
        self.master_port
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |var| {
            pairs
                .iter()
                .find(|(k, _)| k == var)
                .map(|(_, v)| OsString::from(v))
        }
    }

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
        assert_eq!(
            g.env_for(0, 0).map(|(_, v)| v),
            ["0", "2", "0", "127.0.0.1", "29500"].map(str::to_owned)
        );
    }

    #[test]
    fn the_first_missing_variable_is_named() {
        assert_eq!(
            ProcessGroup::from_vars(|_| None),
            Err(ProcessGroupError::Missing { var: "RANK" })
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
