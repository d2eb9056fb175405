//! Which launcher started this process (graft's own or variables set by hand, torchrun,
//! Slurm's srun, an MPI launcher), and its variables mapped onto a [`ProcessGroup`]; with a
//! reader of Slurm's compressed host lists for rank 0's host. The rules (precedence, address,
//! port) are documented on [`ProcessGroup::from_env`].

use std::ffi::OsString;
use std::str::FromStr;

use crate::config::{GRAFT_PORT, Launcher, ProcessGroup, ProcessGroupError};

/// The variables whose presence picks the launcher, in the order of precedence (see
/// [`ProcessGroup::from_env`]).
pub const LAUNCHER_VARS: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
];

/// Set by torchrun (and by no other launcher) beside `RANK` & co.
const TORCHRUN_MARKS: [&str; 2] = ["TORCHELASTIC_RUN_ID", "GROUP_RANK"];

/// An MPI process's local rank, under MPICH's or Intel MPI's mpiexec (hydra), which srun's
/// own PMI does not set.
const PMI_LOCAL: [&str; 2] = ["MPI_LOCALRANKID", "PMI_LOCAL_RANK"];

/// Where Slurm lists the hosts, the step's first (rank 0 runs on its first host).
const SLURM_NODELISTS: [&str; 3] = [
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
];

/// The first port of the range Slurm jobs' ports are derived in ([`slurm_port`]).
const SLURM_PORT_BASE: u64 = 10_000;
/// The ports a Slurm job gets, one per step ([`slurm_port`]).
const SLURM_PORTS_PER_JOB: u64 = 16;
/// The number of Slurm jobs before their ports repeat: 1250 × 16 ports = 10000..=29999.
const SLURM_JOBS: u64 = 1_250;

/// The port a Slurm step's rank 0 listens on when neither `GRAFT_PORT` nor `MASTER_PORT` is
/// set: `10000 + 16 × (job mod 1250) + (step mod 16)`, in 10000..=29999.
fn slurm_port(job: u64, step: u64) -> u16 {
    let port =
        SLURM_PORT_BASE + SLURM_PORTS_PER_JOB * (job % SLURM_JOBS) + step % SLURM_PORTS_PER_JOB;
    u16::try_from(port).expect("10000 + 16 × 1249 + 15 is below 65536")
}

/// The variables, read through `get`, each parsed as it is needed.
struct Vars<G> {
    get: G,
}

impl<G: Fn(&str) -> Option<OsString>> Vars<G> {
    fn is_set(&self, var: &str) -> bool {
        (self.get)(var).is_some()
    }

    /// `var`'s value, `None` when unset.
    fn text(&self, var: &'static str) -> Result<Option<String>, ProcessGroupError> {
        (self.get)(var)
            .map(|value| {
                value
                    .into_string()
                    .map_err(|v| ProcessGroupError::BadValue {
                        var,
                        value: v.to_string_lossy().into_owned(),
                        expected: "text",
                    })
            })
            .transpose()
    }

    /// `var`'s value parsed as a `T` (`expected` saying what that is), `None` when unset.
    fn parsed<T: FromStr>(
        &self,
        var: &'static str,
        expected: &'static str,
    ) -> Result<Option<T>, ProcessGroupError> {
        self.text(var)?
            .map(|value| {
                value
                    .trim()
                    .parse()
                    .map_err(|_| ProcessGroupError::BadValue {
                        var,
                        value,
                        expected,
                    })
            })
            .transpose()
    }

    fn number(&self, var: &'static str) -> Result<Option<usize>, ProcessGroupError> {
        self.parsed(var, "a whole number")
    }

    fn port(&self, var: &'static str) -> Result<Option<u16>, ProcessGroupError> {
        self.parsed(var, "a port number (0 to 65535)")
    }
}

impl ProcessGroup {
    /// This process's place, from the variables of the launcher that started it.
    ///
    /// The launcher is the first of these whose variables are set:
    ///
    /// 1. `RANK` or `WORLD_SIZE`: [`Launcher::Torchrun`] when torchrun's `TORCHELASTIC_RUN_ID`
    ///    or `GROUP_RANK` is set too, else [`Launcher::Env`] (graft's own launcher, or the
    ///    variables set by hand). Both read [`ENV_VARS`](crate::ENV_VARS): `RANK`, `WORLD_SIZE`,
    ///    `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`. Set explicitly, they win over any
    ///    launcher's.
    /// 2. `OMPI_COMM_WORLD_RANK` ([`Launcher::Mpi`], Open MPI's mpirun): with
    ///    `OMPI_COMM_WORLD_SIZE` and `OMPI_COMM_WORLD_LOCAL_RANK`.
    /// 3. `PMI_RANK` ([`Launcher::Mpi`], MPICH's and Intel MPI's mpiexec): with `PMI_SIZE` and
    ///    `MPI_LOCALRANKID` (or `PMI_LOCAL_RANK`). Not where `SLURM_PROCID` is set and neither
    ///    local rank is: that is srun's own PMI (its pmi2 plugin sets `PMI_RANK` and `PMI_SIZE`
    ///    for every task it starts), and the process is Slurm's task.
    /// 4. `SLURM_PROCID` ([`Launcher::Slurm`], srun): with `SLURM_NTASKS` and `SLURM_LOCALID`.
    ///
    /// MPI's variables win over Slurm's because mpirun inside a Slurm allocation starts its
    /// ranks through a Slurm step of its own (one task per host), whose `SLURM_PROCID` is not
    /// the rank. None found is [`ProcessGroupError::NoLauncher`].
    ///
    /// Rank 0's address: `MASTER_ADDR`. Under Slurm, where srun sets none, the first host of
    /// `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`, else `SLURM_NODELIST`) unless
    /// `MASTER_ADDR` is set; an MPI launcher sets none, so it must be passed
    /// ([`ProcessGroupError::MpiAddress`]).
    ///
    /// The port graft's rendezvous listens on: `GRAFT_PORT` when set, under every launcher.
    /// Else:
    ///
    /// - env, MPI: `MASTER_PORT`;
    /// - torchrun: `MASTER_PORT + 1`. torchrun's agent holds `MASTER_PORT` itself (its TCP
    ///   store: with the static rendezvous, the store at `--master-port` that its workers
    ///   share; with c10d, the store server it shares or a free port it picked), so graft
    ///   cannot listen there; torchrun opens no other fixed port beside it (c10d's rendezvous
    ///   endpoint, when used, is a port of its own, 29400 by default);
    /// - Slurm: `MASTER_PORT` if set, else `10000 + 16 × (SLURM_JOB_ID mod 1250) +
    ///   (SLURM_STEP_ID mod 16)`: every task of a step computes the same, each job gets a
    ///   block of 16 ports and each of its steps one of them (steps running at once differ),
    ///   and all stay within 10000..=29999, below the range Linux hands out to outgoing
    ///   connections (32768..=60999), so no connection of the host holds it by chance.
    pub fn from_env() -> Result<ProcessGroup, ProcessGroupError> {
        ProcessGroup::from_vars(|var| std::env::var_os(var))
    }

    /// As [`ProcessGroup::from_env`], reading the variables through `get`.
    pub(crate) fn from_vars(
        get: impl Fn(&str) -> Option<OsString>,
    ) -> Result<ProcessGroup, ProcessGroupError> {
        place(get)
    }
}

/// This process's place from the variables `get` reads: [`ProcessGroup::from_env`].
pub(crate) fn place(
    get: impl Fn(&str) -> Option<OsString>,
) -> Result<ProcessGroup, ProcessGroupError> {
    let v = Vars { get };
    if v.is_set("RANK") || v.is_set("WORLD_SIZE") {
        let torchrun = TORCHRUN_MARKS.iter().any(|m| v.is_set(m));
        return from_rank_vars(&v, torchrun);
    }
    if v.is_set("OMPI_COMM_WORLD_RANK") {
        return from_mpi(
            &v,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            &["OMPI_COMM_WORLD_LOCAL_RANK"],
        );
    }
    let srun_pmi = v.is_set("SLURM_PROCID") && !PMI_LOCAL.iter().any(|l| v.is_set(l));
    if v.is_set("PMI_RANK") && !srun_pmi {
        return from_mpi(&v, "PMI_RANK", "PMI_SIZE", &PMI_LOCAL);
    }
    if v.is_set("SLURM_PROCID") {
        return from_slurm(&v);
    }
    Err(ProcessGroupError::NoLauncher {
        looked_for: &LAUNCHER_VARS,
    })
}

/// graft's own launcher, the variables set by hand, or torchrun: [`ENV_VARS`](crate::ENV_VARS).
fn from_rank_vars<G: Fn(&str) -> Option<OsString>>(
    v: &Vars<G>,
    torchrun: bool,
) -> Result<ProcessGroup, ProcessGroupError> {
    let need = |var| ProcessGroupError::Missing { var };
    // In the order of ENV_VARS, so that the first missing one is named first.
    let rank = v.number("RANK")?.ok_or(need("RANK"))?;
    let world = v.number("WORLD_SIZE")?.ok_or(need("WORLD_SIZE"))?;
    let local_rank = v.number("LOCAL_RANK")?.ok_or(need("LOCAL_RANK"))?;
    let master_addr = v.text("MASTER_ADDR")?.ok_or(need("MASTER_ADDR"))?;
    let port = match v.port(GRAFT_PORT)? {
        Some(port) => port,
        None => {
            let master = v.port("MASTER_PORT")?.ok_or(need("MASTER_PORT"))?;
            if torchrun {
                master
                    .checked_add(1)
                    .ok_or(ProcessGroupError::NoPortAfter {
                        master_port: master,
                    })?
            } else {
                master
            }
        }
    };
    let launcher = if torchrun {
        Launcher::Torchrun
    } else {
        Launcher::Env
    };
    Ok(ProcessGroup::new(rank, world, local_rank, master_addr.trim(), port)?.placed_by(launcher))
}

/// An MPI launcher: rank and size from `rank_var` and `size_var`, the local rank from the
/// first of `local_vars` set; the address and port must be given.
fn from_mpi<G: Fn(&str) -> Option<OsString>>(
    v: &Vars<G>,
    rank_var: &'static str,
    size_var: &'static str,
    local_vars: &[&'static str],
) -> Result<ProcessGroup, ProcessGroupError> {
    let need = |var| ProcessGroupError::Incomplete {
        launcher: Launcher::Mpi,
        var,
    };
    let rank = v.number(rank_var)?.ok_or(need(rank_var))?;
    let world = v.number(size_var)?.ok_or(need(size_var))?;
    let mut local_rank = None;
    for &var in local_vars {
        local_rank = v.number(var)?;
        if local_rank.is_some() {
            break;
        }
    }
    let local_rank = local_rank.ok_or(need(local_vars[0]))?;
    let master_addr = v
        .text("MASTER_ADDR")?
        .ok_or(ProcessGroupError::MpiAddress { var: "MASTER_ADDR" })?;
    let port = match v.port(GRAFT_PORT)? {
        Some(port) => port,
        None => v
            .port("MASTER_PORT")?
            .ok_or(ProcessGroupError::MpiAddress { var: "MASTER_PORT" })?,
    };
    Ok(
        ProcessGroup::new(rank, world, local_rank, master_addr.trim(), port)?
            .placed_by(Launcher::Mpi),
    )
}

/// Slurm's srun: rank 0 on the first host of the step, on the job's port.
fn from_slurm<G: Fn(&str) -> Option<OsString>>(
    v: &Vars<G>,
) -> Result<ProcessGroup, ProcessGroupError> {
    let need = |var| ProcessGroupError::Incomplete {
        launcher: Launcher::Slurm,
        var,
    };
    let rank = v.number("SLURM_PROCID")?.ok_or(need("SLURM_PROCID"))?;
    let world = v.number("SLURM_NTASKS")?.ok_or(need("SLURM_NTASKS"))?;
    let local_rank = v.number("SLURM_LOCALID")?.ok_or(need("SLURM_LOCALID"))?;
    let master_addr = match v.text("MASTER_ADDR")? {
        Some(addr) => addr,
        None => {
            let mut first = None;
            for var in SLURM_NODELISTS {
                if let Some(list) = v.text(var)? {
                    first = Some(
                        first_host(&list)
                            .ok_or(ProcessGroupError::BadHostList { var, value: list })?,
                    );
                    break;
                }
            }
            first.ok_or(need("SLURM_JOB_NODELIST"))?
        }
    };
    let port = match (v.port(GRAFT_PORT)?, v.port("MASTER_PORT")?) {
        (Some(port), _) | (None, Some(port)) => port,
        (None, None) => {
            let job = v
                .parsed("SLURM_JOB_ID", "a whole number")?
                .ok_or(need("SLURM_JOB_ID"))?;
            let step = v.parsed("SLURM_STEP_ID", "a whole number")?.unwrap_or(0);
            slurm_port(job, step)
        }
    };
    Ok(
        ProcessGroup::new(rank, world, local_rank, master_addr.trim(), port)?
            .placed_by(Launcher::Slurm),
    )
}

/// The first host of a Slurm host list, as Slurm expands it: `node[01-04,07],gpu-a` is
/// `node01`, zero padding kept; `rack[1-2]-node[08-09]` is `rack1-node08`. `None` when `list`
/// is not a host list: empty, an empty name, unbalanced or nested brackets, or a bracket
/// holding other than numbers and ranges of them (`lo-hi`, `lo <= hi`).
pub(crate) fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let mut first = None;
    for name in split_outside_brackets(list)? {
        let host = first_of(name)?;
        first.get_or_insert(host);
    }
    first
}

/// `list` split at the commas outside brackets; `None` when its brackets are unbalanced or
/// nested.
fn split_outside_brackets(list: &str) -> Option<Vec<&str>> {
    let mut names = Vec::new();
    let (mut start, mut open) = (0, false);
    for (i, c) in list.char_indices() {
        match c {
            '[' if !open => open = true,
            ']' if open => open = false,
            '[' | ']' => return None,
            ',' if !open => {
                names.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if open {
        return None;
    }
    names.push(&list[start..]);
    Some(names)
}

/// The first host one name of a host list expands to (each bracket replaced by its first
/// number as written); `None` when the name is not valid.
fn first_of(name: &str) -> Option<String> {
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    let mut host = String::with_capacity(name.len());
    let mut rest = name;
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']')?;
        host.push_str(&rest[..open]);
        host.push_str(first_number(&rest[open + 1..close])?);
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    Some(host)
}

/// The first number of a bracket's ranges (`01-04,07` is `01`), as written; `None` unless
/// every item is a number or a range `lo-hi` with `lo <= hi`.
fn first_number(ranges: &str) -> Option<&str> {
    let mut first = None;
    for item in ranges.split(',') {
        let (lo, hi) = item.split_once('-').unwrap_or((item, item));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) || lo.parse::<u128>().ok()? > hi.parse::<u128>().ok()? {
            return None;
        }
        first.get_or_insert(lo);
    }
    first
}

#[cfg(test)]
pub(crate) mod tests;
