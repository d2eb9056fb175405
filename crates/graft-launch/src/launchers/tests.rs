//! Tests of the launchers' mappings: each launcher's variables, the precedence, the ports,
//! Slurm's host lists and the errors.

use super::*;

/// An environment of these variables only, as `from_vars` reads one.
pub(crate) fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> + use<> {
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
