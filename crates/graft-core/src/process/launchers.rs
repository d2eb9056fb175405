//! Which launcher started this process (graft's own or variables set by hand, torchrun,
//! Slurm's srun, an MPI launcher), and its variables mapped onto a [`ProcessGroup`]; with a
//! reader of Slurm's compressed host lists for rank 0's host. The rules (precedence, address,
//! port) are documented on [`ProcessGroup::from_env`].

use std::ffi::OsString;
use std::fmt;
use std::str::FromStr;

use super::config::{ProcessGroup, ProcessGroupError};

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

/// The variables whose presence picks the launcher, in the order of precedence (see
/// [`ProcessGroup::from_env`]).
pub const LAUNCHER_VARS: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
];

/// The port graft's rendezvous listens on, when set: it wins under every launcher.
pub(super) const GRAFT_PORT: &str = "GRAFT_PORT";

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

/// This process's place from the variables `get` reads: [`ProcessGroup::from_env`].
pub(super) fn place(
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

/// graft's own launcher, the variables set by hand, or torchrun: [`super::ENV_VARS`].
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
pub(super) fn first_host(list: &str) -> Option<String> {
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

    fn parse(pairs: &[(&str, &str)]) -> Result<ProcessGroup, ProcessGroupError> {
        place(vars(pairs))
    }

    /// `pairs` with `more` added (replacing those of the same name) and `less` removed.
    fn edit<'a>(
        pairs: &[(&'a str, &'a str)],
        more: &[(&'a str, &'a str)],
        less: &[&str],
    ) -> Vec<(&'a str, &'a str)> {
        let mut out: Vec<(&str, &str)> = pairs
            .iter()
            .filter(|(k, _)| !less.contains(k) && !more.iter().any(|(m, _)| m == k))
            .copied()
            .collect();
        out.extend_from_slice(more);
        out
    }

    fn group(
        rank: usize,
        world: usize,
        local: usize,
        addr: &str,
        port: u16,
        launcher: Launcher,
    ) -> ProcessGroup {
        ProcessGroup::new(rank, world, local, addr, port)
            .unwrap()
            .placed_by(launcher)
    }

    /// What torchrun sets for its second worker (two nodes of two, `--master-port 29533`).
    const TORCHRUN: [(&str, &str); 10] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("GROUP_RANK", "1"),
        ("GROUP_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node01"),
        ("MASTER_PORT", "29533"),
        ("TORCHELASTIC_RUN_ID", "none"),
        ("TORCHELASTIC_RESTART_COUNT", "0"),
    ];

    /// What srun sets for task 5 of `srun -N 2 --ntasks-per-node 4` in step 3 of job 123456.
    const SLURM: [(&str, &str); 7] = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_JOB_ID", "123456"),
        ("SLURM_STEP_ID", "3"),
        ("SLURM_JOB_NODELIST", "gpu[007-009],cpu1"),
        ("SLURM_STEP_NODELIST", "gpu[008-009]"),
    ];

    const OPEN_MPI: [(&str, &str); 5] = [
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29600"),
    ];

    const HYDRA: [(&str, &str); 5] = [
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("MPI_LOCALRANKID", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29600"),
    ];

    #[test]
    fn torchrun_gets_the_port_after_its_own() {
        assert_eq!(
            parse(&TORCHRUN),
            Ok(group(3, 4, 1, "node01", 29534, Launcher::Torchrun))
        );
        // GROUP_RANK alone marks torchrun too.
        let marked = edit(&TORCHRUN, &[], &["TORCHELASTIC_RUN_ID"]);
        assert_eq!(parse(&marked).unwrap().launcher(), Launcher::Torchrun);
        // GRAFT_PORT wins.
        let chosen = edit(&TORCHRUN, &[("GRAFT_PORT", "40000")], &[]);
        assert_eq!(parse(&chosen).unwrap().master_port(), 40000);
        assert_eq!(
            parse(&edit(&TORCHRUN, &[("MASTER_PORT", "65535")], &[])),
            Err(ProcessGroupError::NoPortAfter { master_port: 65535 })
        );
        assert_eq!(
            parse(&edit(&TORCHRUN, &[], &["LOCAL_RANK"])),
            Err(ProcessGroupError::Missing { var: "LOCAL_RANK" })
        );
    }

    #[test]
    fn the_plain_variables_are_env_and_graft_port_wins_there_too() {
        let plain = edit(&TORCHRUN, &[], &["GROUP_RANK", "TORCHELASTIC_RUN_ID"]);
        assert_eq!(
            parse(&plain),
            Ok(group(3, 4, 1, "node01", 29533, Launcher::Env))
        );
        let chosen = edit(&plain, &[("GRAFT_PORT", "40000")], &["MASTER_PORT"]);
        assert_eq!(parse(&chosen).unwrap().master_port(), 40000);
        assert!(matches!(
            parse(&edit(&plain, &[("GRAFT_PORT", "x")], &[])),
            Err(ProcessGroupError::BadValue {
                var: "GRAFT_PORT",
                ..
            })
        ));
    }

    #[test]
    fn slurm_places_rank_0_on_the_steps_first_host_and_the_jobs_port() {
        // 10000 + 16 × (123456 mod 1250) + 3 = 10000 + 16 × 956 + 3.
        assert_eq!(
            parse(&SLURM),
            Ok(group(5, 8, 1, "gpu008", 25299, Launcher::Slurm))
        );
        // Without the step's list, the job's; without either, the old name.
        let job = edit(&SLURM, &[], &["SLURM_STEP_NODELIST"]);
        assert_eq!(parse(&job).unwrap().master_addr(), "gpu007");
        let old = edit(&job, &[("SLURM_NODELIST", "a-1")], &["SLURM_JOB_NODELIST"]);
        assert_eq!(parse(&old).unwrap().master_addr(), "a-1");
        // MASTER_ADDR, MASTER_PORT and GRAFT_PORT, when set, win.
        let given = edit(
            &SLURM,
            &[("MASTER_ADDR", "10.1.1.1"), ("MASTER_PORT", "29500")],
            &[],
        );
        assert_eq!(
            parse(&given),
            Ok(group(5, 8, 1, "10.1.1.1", 29500, Launcher::Slurm))
        );
        let graft = edit(&given, &[("GRAFT_PORT", "29700")], &[]);
        assert_eq!(parse(&graft).unwrap().master_port(), 29700);
        // No step: step 0.
        let batch = edit(&SLURM, &[], &["SLURM_STEP_ID"]);
        assert_eq!(parse(&batch).unwrap().master_port(), 25296);
    }

    #[test]
    fn slurm_ports_differ_by_step_and_by_neighbouring_job_and_stay_in_range() {
        let mut seen = std::collections::HashSet::new();
        for job in 5000..5000 + SLURM_JOBS {
            for step in 0..SLURM_PORTS_PER_JOB {
                let port = slurm_port(job, step);
                assert!((10_000..=29_999).contains(&port), "{job}.{step}: {port}");
                assert!(seen.insert(port), "{job}.{step}: {port} twice");
            }
        }
        assert_eq!(
            slurm_port(u64::MAX, u64::MAX),
            slurm_port(u64::MAX % 1250, 15)
        );
    }

    #[test]
    fn slurm_names_what_it_lacks() {
        for var in ["SLURM_NTASKS", "SLURM_LOCALID"] {
            assert_eq!(
                parse(&edit(&SLURM, &[], &[var])),
                Err(ProcessGroupError::Incomplete {
                    launcher: Launcher::Slurm,
                    var
                })
            );
        }
        let no_list = edit(&SLURM, &[], &["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"]);
        assert_eq!(
            parse(&no_list),
            Err(ProcessGroupError::Incomplete {
                launcher: Launcher::Slurm,
                var: "SLURM_JOB_NODELIST"
            })
        );
        assert_eq!(
            parse(&edit(&SLURM, &[], &["SLURM_JOB_ID"])),
            Err(ProcessGroupError::Incomplete {
                launcher: Launcher::Slurm,
                var: "SLURM_JOB_ID"
            })
        );
        // With a port given, the job id is not needed.
        let given = edit(&SLURM, &[("GRAFT_PORT", "29700")], &["SLURM_JOB_ID"]);
        assert_eq!(parse(&given).unwrap().master_port(), 29700);
        assert_eq!(
            parse(&edit(&SLURM, &[("SLURM_STEP_NODELIST", "gpu[08")], &[])),
            Err(ProcessGroupError::BadHostList {
                var: "SLURM_STEP_NODELIST",
                value: "gpu[08".into()
            })
        );
        assert_eq!(
            parse(&edit(&SLURM, &[("SLURM_PROCID", "8")], &[])),
            Err(ProcessGroupError::RankOutOfRange { rank: 8, world: 8 })
        );
        assert!(matches!(
            parse(&edit(&SLURM, &[("SLURM_JOB_ID", "12_3")], &[])),
            Err(ProcessGroupError::BadValue {
                var: "SLURM_JOB_ID",
                ..
            })
        ));
    }

    #[test]
    fn open_mpi_and_hydra_are_mpi() {
        assert_eq!(
            parse(&OPEN_MPI),
            Ok(group(2, 4, 0, "10.0.0.1", 29600, Launcher::Mpi))
        );
        assert_eq!(
            parse(&HYDRA),
            Ok(group(1, 2, 1, "10.0.0.1", 29600, Launcher::Mpi))
        );
        let pmi_local = edit(
            &HYDRA,
            &[("PMI_LOCAL_RANK", "0"), ("GRAFT_PORT", "29601")],
            &["MPI_LOCALRANKID"],
        );
        assert_eq!(
            parse(&pmi_local),
            Ok(group(1, 2, 0, "10.0.0.1", 29601, Launcher::Mpi))
        );
    }

    #[test]
    fn mpi_needs_the_address_and_port_passed() {
        for (mpi, pairs) in [("open mpi", &OPEN_MPI), ("hydra", &HYDRA)] {
            for var in ["MASTER_ADDR", "MASTER_PORT"] {
                let err = parse(&edit(pairs, &[], &[var])).unwrap_err();
                assert_eq!(err, ProcessGroupError::MpiAddress { var }, "{mpi}");
                let text = err.to_string();
                assert!(text.contains("mpirun -x MASTER_ADDR="), "{text}");
            }
        }
        assert_eq!(
            parse(&edit(&OPEN_MPI, &[], &["OMPI_COMM_WORLD_LOCAL_RANK"])),
            Err(ProcessGroupError::Incomplete {
                launcher: Launcher::Mpi,
                var: "OMPI_COMM_WORLD_LOCAL_RANK"
            })
        );
        assert_eq!(
            parse(&edit(&HYDRA, &[], &["PMI_SIZE"])),
            Err(ProcessGroupError::Incomplete {
                launcher: Launcher::Mpi,
                var: "PMI_SIZE"
            })
        );
        assert_eq!(
            parse(&edit(&HYDRA, &[], &["MPI_LOCALRANKID"])),
            Err(ProcessGroupError::Incomplete {
                launcher: Launcher::Mpi,
                var: "MPI_LOCALRANKID"
            })
        );
    }

    #[test]
    fn explicit_rank_variables_win_over_every_launcher() {
        let everything: Vec<(&str, &str)> = [&TORCHRUN[..], &SLURM, &OPEN_MPI, &HYDRA]
            .concat()
            .into_iter()
            .filter(|(k, _)| !k.starts_with("MASTER_"))
            .chain([("MASTER_ADDR", "node01"), ("MASTER_PORT", "29533")])
            .collect();
        assert_eq!(
            parse(&everything),
            Ok(group(3, 4, 1, "node01", 29534, Launcher::Torchrun))
        );
        // `srun torchrun ...`: torchrun's ranks, not Slurm's tasks.
        let under_srun = [&TORCHRUN[..], &SLURM].concat();
        assert_eq!(parse(&under_srun).unwrap().launcher(), Launcher::Torchrun);
        // WORLD_SIZE alone is enough to pick the plain variables, and then all are needed.
        let half = edit(&SLURM, &[("WORLD_SIZE", "8")], &[]);
        assert_eq!(
            parse(&half),
            Err(ProcessGroupError::Missing { var: "RANK" })
        );
    }

    #[test]
    fn mpi_wins_over_slurm_but_not_over_sruns_own_pmi() {
        // mpirun in an allocation: its ranks inherit the Slurm step of its daemons.
        let mpirun_in_slurm = [&OPEN_MPI[..], &SLURM].concat();
        assert_eq!(
            parse(&mpirun_in_slurm),
            Ok(group(2, 4, 0, "10.0.0.1", 29600, Launcher::Mpi))
        );
        let hydra_in_slurm = [&HYDRA[..], &SLURM].concat();
        assert_eq!(parse(&hydra_in_slurm).unwrap().launcher(), Launcher::Mpi);
        // Open MPI first where both kinds are set.
        let both = [&OPEN_MPI[..], &HYDRA[..1]].concat();
        assert_eq!(parse(&both).unwrap().rank(), 2);
        // srun with its pmi2 plugin sets PMI_RANK and PMI_SIZE, no local rank: Slurm's task.
        let srun_pmi2 = [&SLURM[..], &[("PMI_RANK", "5"), ("PMI_SIZE", "8")]].concat();
        assert_eq!(
            parse(&srun_pmi2),
            Ok(group(5, 8, 1, "gpu008", 25299, Launcher::Slurm))
        );
    }

    #[test]
    fn no_launcher_names_every_launchers_variables() {
        let err = parse(&[
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
            ("LOCAL_RANK", "0"),
        ])
        .unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::NoLauncher {
                looked_for: &LAUNCHER_VARS
            }
        );
        let text = err.to_string();
        assert!(
            text.starts_with("no launcher placed this process"),
            "{text}"
        );
        for var in LAUNCHER_VARS {
            assert!(text.contains(var), "{var}: {text}");
        }
        for launcher in ["torchrun", "srun", "mpirun", "mpiexec"] {
            assert!(text.contains(launcher), "{launcher}: {text}");
        }
    }

    #[test]
    fn launchers_print_lowercase() {
        let names = [
            Launcher::Env,
            Launcher::Torchrun,
            Launcher::Slurm,
            Launcher::Mpi,
        ]
        .map(|l| l.to_string());
        assert_eq!(names, ["env", "torchrun", "slurm", "mpi"]);
    }

    #[test]
    fn the_first_host_of_a_host_list() {
        for (list, first) in [
            ("node[01-04,07],gpu-a", "node01"),
            ("gpu-a,node[01-04]", "gpu-a"),
            ("node[07,01-04]", "node07"),
            ("n[007]", "n007"),
            ("rack[1-2]-node[08-09]", "rack1-node08"),
            ("node[1-2].cluster", "node1.cluster"),
            ("[3-4]x", "3x"),
            ("single", "single"),
            (" node1,node2 ", "node1"),
        ] {
            assert_eq!(first_host(list).as_deref(), Some(first), "{list}");
        }
    }

    #[test]
    fn what_is_not_a_host_list() {
        for list in [
            "",
            " ",
            "node[",
            "node]",
            "node[]",
            "node[1-]",
            "node[-1]",
            "node[a-b]",
            "node[3-1]",
            "node[[1]]",
            "node[1,]",
            "a,,b",
            "a,",
            "a b",
            "a,b[1",
        ] {
            assert_eq!(first_host(list), None, "{list:?}");
        }
    }

    proptest::proptest! {
        /// A host list as Slurm compresses it: the first host is the prefix and the first
        /// range's low end, padded as written.
        #[test]
        fn the_first_host_keeps_the_padding(
            prefix in "[a-z][a-z0-9-]{0,8}",
            width in 1usize..5,
            ranges in proptest::collection::vec((0u32..500, 0u32..20), 1..4),
            more in proptest::collection::vec("[a-z][a-z0-9]{0,5}", 0..3),
        ) {
            let items: Vec<String> = ranges
                .iter()
                .map(|&(lo, len)| format!("{lo:0width$}-{:0width$}", lo + len))
                .collect();
            let mut list = format!("{prefix}[{}]", items.join(","));
            for m in &more {
                list.push(',');
                list.push_str(m);
            }
            let expected = format!("{prefix}{:0width$}", ranges[0].0);
            proptest::prop_assert_eq!(first_host(&list), Some(expected));
        }
    }
}
