//! The demo and the decoder benchmark on the simulator, and the command-line parsing. The
//! benchmarks run with graft-core's token (as graft-cli's `graft-baselines` bench does), so
//! they measure the raw-graph baselines too, except where a test checks what the `graft`
//! binary, without it, leaves out.

use clap::Parser;
use graft_cli::{BenchWhat, Cli, CliError, Command, DecoderBenchArgs, DemoArgs, bench, demo};
use graft_core::backend::CoreOnly;
use graft_sim::SimDevice;
use graft_tensor::DecoderConfig;

/// The token of the raw-graph baselines' sealed capture and launch calls.
const CORE: &CoreOnly = &CoreOnly::for_tests_and_benches();

fn demo_args(tokens: usize, batches: &[usize]) -> DemoArgs {
    DemoArgs {
        tokens,
        batches: batches.to_vec(),
        dot: None,
        sim: true,
        seed: 7,
    }
}

#[test]
fn demo_on_the_simulator_matches_tokens_and_reports_the_tree() {
    let dot = std::env::temp_dir().join(format!("graft-cli-demo-{}.dot", std::process::id()));
    let args = DemoArgs {
        dot: Some(dot.clone()),
        ..demo_args(6, &[1, 3])
    };
    let mut out = Vec::new();
    let report = demo::run_on(
        SimDevice::new(),
        DecoderConfig::tiny(),
        "tiny",
        &args,
        &mut out,
    )
    .expect("graft and eager tokens match");
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("device:  host simulator"), "{text}");
    assert!(text.contains("tiny config"), "{text}");
    assert!(text.contains("identical over 6 steps"), "{text}");
    assert_eq!(report.rows.len(), 2);
    assert_eq!(report.rows[1].bucket, 4);
    assert_eq!(report.rows[1].tokens.len(), 6);
    assert_eq!(
        report.rows[1].tokens[0].len(),
        3,
        "only the real rows are kept"
    );
    assert_eq!(report.roots, 2, "one root per bucket");
    assert!(report.stats.replays >= 4, "{:?}", report.stats);
    let dot_text = std::fs::read_to_string(&dot).unwrap();
    assert!(dot_text.starts_with("digraph"), "{dot_text}");
    let _ = std::fs::remove_file(dot);
}

#[test]
fn demo_run_picks_the_simulator_when_asked() {
    let mut out = Vec::new();
    let report = demo::run(&demo_args(4, &[2]), Some(CORE), &mut out).unwrap();
    assert_eq!(report.device, "host simulator");
    assert_eq!(report.config, DecoderConfig::tiny());
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("tensor parallel, 2 ranks"), "{text}");
    assert!(
        text.contains("graft = eager = raw graph on every rank"),
        "{text}"
    );
}

#[test]
fn demo_longer_than_the_context_starts_new_sequences() {
    let mut out = Vec::new();
    let report = demo::run_on(
        SimDevice::new(),
        DecoderConfig::tiny(),
        "tiny",
        &demo_args(70, &[1]),
        &mut out,
    )
    .unwrap();
    assert_eq!(report.rows[0].tokens.len(), 70);
    assert!(
        String::from_utf8(out)
            .unwrap()
            .contains("exceed the context of 64")
    );
}

#[test]
fn demo_rejects_bad_arguments() {
    let mut out = Vec::new();
    for args in [demo_args(0, &[1]), demo_args(4, &[33]), demo_args(4, &[])] {
        let r = demo::run_on(
            SimDevice::new(),
            DecoderConfig::tiny(),
            "tiny",
            &args,
            &mut out,
        );
        assert!(matches!(r, Err(CliError::BadArgument { .. })), "{r:?}");
    }
}

#[test]
fn bench_on_the_simulator_writes_json() {
    let json = std::env::temp_dir().join(format!("graft-cli-bench-{}.json", std::process::id()));
    let args = DecoderBenchArgs {
        batches: vec![1, 5],
        steps: 6,
        warmup: 2,
        json: Some(json.clone()),
        sim: true,
        seed: 7,
    };
    let mut out = Vec::new();
    let report = bench::run(&args, Some(CORE), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains("host simulator") && text.contains("tiny config"),
        "{text}"
    );
    assert!(report.simulator);
    assert_eq!(report.results.len(), 2);
    assert_eq!(report.results[1].bucket, 8);
    for r in &report.results {
        assert!(
            r.eager_us > 0.0 && r.graft_us > 0.0 && r.raw_us.is_some_and(|raw| raw > 0.0),
            "{r:?}"
        );
    }
    let parsed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(parsed["config"]["name"], "tiny");
    assert_eq!(parsed["results"][0]["batch"], 1);
    let _ = std::fs::remove_file(json);
}

#[test]
fn command_line_parses() {
    let cli = Cli::try_parse_from([
        "graft",
        "demo",
        "--tokens",
        "5",
        "--batches",
        "1,2",
        "--sim",
    ])
    .unwrap();
    match cli.command {
        Command::Demo(a) => {
            assert_eq!((a.tokens, a.batches, a.sim), (5, vec![1, 2], true));
        }
        other => panic!("{other:?}"),
    }
    let cli =
        Cli::try_parse_from(["graft", "bench", "--batches", "1,8", "--json", "x.json"]).unwrap();
    match cli.command {
        Command::Bench(b) => {
            assert!(b.what.is_none());
            assert_eq!(b.decoder.batches, vec![1, 8]);
            assert_eq!(b.decoder.steps, 100);
        }
        other => panic!("{other:?}"),
    }
    let cli = Cli::try_parse_from(["graft", "bench", "decoder", "--steps", "3"]).unwrap();
    match cli.command {
        Command::Bench(b) => match b.what {
            Some(BenchWhat::Decoder(d)) => assert_eq!(d.steps, 3),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    let defaults = Cli::try_parse_from(["graft", "demo"]).unwrap();
    match defaults.command {
        Command::Demo(a) => assert_eq!((a.tokens, a.batches), (32, vec![1, 4, 8])),
        other => panic!("{other:?}"),
    }
    assert!(Cli::try_parse_from(["graft", "demo", "--tokens", "x"]).is_err());
    assert!(Cli::try_parse_from(["graft", "bench", "--steps", "3", "decoder"]).is_err());
}

/// Without graft-core's token (the `graft` binary) the decoder benchmark and the micro
/// benchmark leave the raw graph out and say how to measure it.
#[test]
fn without_the_token_the_raw_graphs_are_left_out() {
    let args = DecoderBenchArgs {
        batches: vec![1],
        steps: 2,
        warmup: 0,
        json: None,
        sim: true,
        seed: 7,
    };
    let mut out = Vec::new();
    let report = bench::run(&args, None, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(report.results.iter().all(|r| r.raw_us.is_none()), "{text}");
    assert!(text.contains("identical across eager and graft"), "{text}");
    assert!(text.contains("--bench graft-baselines"), "{text}");
    let line = "graft bench micro --sim --repeats 1 --calls 2";
    let cli = Cli::try_parse_from(line.split_whitespace()).unwrap();
    let mut out = Vec::new();
    graft_cli::run(cli, &mut out).unwrap_or_else(|e| panic!("{line}: {e}"));
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("raw graph: not measured"), "{text}");
}

/// The shapes benchmarks run end to end on the simulator, small, and report what they measure.
#[test]
fn shapes_benchmarks_run_on_the_simulator() {
    let run = |line: &str| -> String {
        let cli = Cli::try_parse_from(line.split_whitespace()).expect("the command line parses");
        let mut out = Vec::new();
        graft_cli::run_with(cli, Some(CORE), &mut out).unwrap_or_else(|e| panic!("{line}: {e}"));
        String::from_utf8(out).unwrap()
    };
    let capture = run("graft bench capture --sim --buckets 4 --max 16");
    assert!(capture.contains("recorded 4 of 4 buckets"), "{capture}");
    assert!(capture.contains("1.000x"), "{capture}");
    assert!(capture.contains("4 of 4 buckets replay"), "{capture}");
    let serve = run("graft bench serve --sim --steps 60 --max 16 --budget 2");
    assert!(serve.contains("graft, budget 2"), "{serve}");
    assert!(serve.contains("graft, best fixed 2"), "{serve}");
    assert!(
        serve.contains("budget 2 against best fixed 2, mean: "),
        "{serve}"
    );
    assert!(serve.contains("budget 2 ends holding buckets "), "{serve}");
    let update = run("graft bench update --sim --repeats 3");
    assert!(update.contains("0 refusals"), "{update}");
    assert!(update.contains("3 updated in place"), "{update}");
    let inputs = run("graft bench inputs --sim --steps 3");
    assert!(inputs.contains("64 KiB moving"), "{inputs}");
    assert!(!inputs.contains("refused"), "{inputs}");
}

/// The loop benchmark runs on the simulator, checks the loop's tokens against one launch per
/// token, reports the four figures per batch size and K, and refuses what cannot run.
#[test]
fn loop_benchmark_runs_on_the_simulator() {
    let json = std::env::temp_dir().join(format!("graft-cli-loop-{}.json", std::process::id()));
    let line = format!(
        "graft bench loop --sim --batches 1,3 --tokens 4,32 --repeats 1 --temperature 0.9 --top-k 8 --json {}",
        json.display()
    );
    let cli = Cli::try_parse_from(line.split_whitespace()).expect("the command line parses");
    let mut out = Vec::new();
    graft_cli::run(cli, &mut out).unwrap_or_else(|e| panic!("{line}: {e}"));
    let report = String::from_utf8(out).unwrap();
    assert!(
        report.contains("sampling: temperature 0.9, top-k 8"),
        "{report}"
    );
    assert!(report.contains("tokens:   identical"), "{report}");
    assert!(report.contains("headline: batch 3, K = 32"), "{report}");
    assert!(!report.contains("ran eagerly"), "{report}");
    let parsed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = parsed["results"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(
        (rows[3]["batch"].as_u64(), rows[3]["bucket"].as_u64()),
        (Some(3), Some(4))
    );
    for r in rows {
        assert_eq!(r["loop_replayed"], true, "{r}");
        for f in ["per_step_us", "loop_us", "floor_us", "speedup"] {
            assert!(r[f].as_f64().unwrap() > 0.0, "{f}: {r}");
        }
    }
    let _ = std::fs::remove_file(json);
    for bad in [
        "graft bench loop --sim --tokens 0",
        "graft bench loop --sim --tokens 100000",
        "graft bench loop --sim --temperature=-1",
        "graft bench loop --sim --repeats 0",
        "graft bench loop --sim --batches 33",
    ] {
        let cli = Cli::try_parse_from(bad.split_whitespace()).unwrap();
        let r = graft_cli::run(cli, &mut Vec::new());
        assert!(
            matches!(r, Err(CliError::BadArgument { .. })),
            "{bad}: {r:?}"
        );
    }
}

/// The guard benchmark on the simulator: tokens agree, the default schedule guards calls
/// 1, 2, 4, ..., 512 of the 1,000 after a recording, and every figure is measured.
#[test]
fn guard_benchmark_runs_on_the_simulator() {
    let line = "graft bench guard --sim --steps 3";
    let cli = Cli::try_parse_from(line.split_whitespace()).expect("the command line parses");
    let Command::Bench(cmd) = cli.command else {
        panic!("{line}: not a bench");
    };
    let Some(BenchWhat::Guard(args)) = cmd.what else {
        panic!("{line}: not the guard bench");
    };
    let mut out = Vec::new();
    let r = graft_cli::guard_bench::run(&args, &mut out).unwrap_or_else(|e| panic!("{line}: {e}"));
    let report = String::from_utf8(out).unwrap();
    assert!(report.contains("tokens:  identical"), "{report}");
    assert_eq!(r.guards, 10, "{report}");
    for v in [
        r.eager_us,
        r.replay_us,
        r.guarded_us,
        r.amortised_us,
        r.unguarded_us,
    ] {
        assert!(v > 0.0, "{r:?}");
    }
    let cli = Cli::try_parse_from("graft bench guard --sim --calls 2".split_whitespace()).unwrap();
    let r = graft_cli::run(cli, &mut Vec::new());
    assert!(matches!(r, Err(CliError::BadArgument { .. })), "{r:?}");
}

/// The tensor-parallel benchmark runs on simulated devices: graft, eager and the raw graph
/// agree on every rank, and the table has a row per batch size and timing.
#[test]
fn tensor_parallel_benchmark_runs_on_simulated_devices() {
    let line = "graft bench tp --sim --batches 1,8 --check 8 --steps 3 --rounds 1";
    let cli = Cli::try_parse_from(line.split_whitespace()).expect("the command line parses");
    let mut out = Vec::new();
    graft_cli::run_with(cli, Some(CORE), &mut out).unwrap_or_else(|e| panic!("{line}: {e}"));
    let report = String::from_utf8(out).unwrap();
    assert!(report.contains("on 2 ranks"), "{report}");
    assert!(
        report.contains("graft = eager = raw graph on every rank"),
        "{report}"
    );
    assert!(report.contains("| 8 | pipelined |"), "{report}");
    let one = Cli::try_parse_from(["graft", "bench", "tp", "--sim", "--world", "1"]).unwrap();
    assert!(matches!(
        graft_cli::run(one, &mut Vec::new()),
        Err(CliError::BadArgument {
            flag: "--world",
            ..
        })
    ));
}

/// The `graft` binary: cargo's build of it, or, for a staged test executable run on another
/// machine (`scripts/stage.sh`: `stage/tests/` beside `stage/bin/`), the staged one.
fn graft_binary() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_graft"));
    if built.exists() {
        return built;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bin").join("graft")))
        .unwrap_or(built)
}

/// `graft bench tp --procs 2 --sim` with short runs and `extra` flags, through the real binary.
fn tp_procs_on_the_simulator(extra: &[&str]) -> std::process::Output {
    std::process::Command::new(graft_binary())
        .args(["bench", "tp", "--procs", "2", "--sim"])
        .args(["--check", "6", "--steps", "2", "--rounds", "1"])
        .args(["--procs-timeout", "120"])
        .args(extra)
        .output()
        .expect("the graft binary runs")
}

/// `graft bench tp --procs 2 --sim`: the real binary starts two copies of itself as the ranks
/// of a job (votes and all-reduces over TCP), gathers their reports, and checks their tokens
/// against the same ranks as threads. The binary has no token: the raw graphs are left out
/// (tests/procs_baselines.rs runs the job with them).
#[test]
fn tensor_parallel_benchmark_runs_as_processes_on_simulated_devices() {
    let out = tp_procs_on_the_simulator(&["--batches", "1,8"]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        report.contains("as 2 processes, one per simulated device, voting over TCP"),
        "{report}"
    );
    assert!(
        report.contains("tokens: every process = every thread = eager, over"),
        "{report}"
    );
    assert!(report.contains("raw graph: not measured"), "{report}");
    assert!(report.contains("| 8 | pipelined |"), "{report}");
    let one = Cli::try_parse_from(["graft", "bench", "tp", "--sim", "--procs", "1"]).unwrap();
    assert!(matches!(
        graft_cli::run(one, &mut Vec::new()),
        Err(CliError::BadArgument {
            flag: "--procs",
            ..
        })
    ));
    assert!(Cli::try_parse_from(["graft", "bench", "tp", "--procs", "2", "--world", "2"]).is_err());
}

/// A rank started outside a job (no RANK in its environment) says which variable is missing.
/// `--kill-rank 1 --at-step 4 --max-restarts 1`: rank 1 kills itself (SIGKILL) in the first
/// start of the job; rank 0's watchdog finds it gone and rank 0 returns with an error on its
/// own (the launcher does not kill it); the job starts again and finishes with the tokens of an
/// uninterrupted run (checked against the ranks as threads).
#[test]
fn a_killed_rank_restarts_the_job_which_then_finishes() {
    let out = tp_procs_on_the_simulator(&[
        "--batches",
        "1",
        "--kill-rank",
        "1",
        "--at-step",
        "4",
        "--max-restarts",
        "1",
    ]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        report.contains("rank 1 killed itself; rank 0 returned"),
        "{report}"
    );
    assert!(report.contains("restart 1 of 1"), "{report}");
    assert!(
        report.contains("tokens: every process = every thread = eager, over 6 steps"),
        "{report}"
    );
}

/// Without restarts, the killed rank's job fails with the survivor's error.
#[test]
fn a_killed_rank_without_restarts_fails_the_job() {
    let out = tp_procs_on_the_simulator(&["--batches", "1", "--kill-rank", "1", "--at-step", "4"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("rank 0 of the job failed"), "{stderr}");
    // Whichever notices first: the simulated all-reduce, or rank 0's watchdog.
    assert!(
        stderr.contains("lost rank 1") || stderr.contains("found rank 1 gone"),
        "{stderr}"
    );
}

#[test]
fn a_rank_outside_a_job_names_the_launchers_variables() {
    let mut command = std::process::Command::new(graft_binary());
    command.args(["bench", "tp", "--as-rank", "--sim"]);
    // Whatever launcher runs the tests (Slurm, say) is no launcher of this rank.
    for var in graft_launch::LAUNCHER_VARS {
        command.env_remove(var);
    }
    let out = command.output().expect("the graft binary runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no launcher placed this process"), "{err}");
    for var in graft_launch::LAUNCHER_VARS {
        assert!(err.contains(var), "{var}: {err}");
    }
}
