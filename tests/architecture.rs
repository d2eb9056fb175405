//! docs/architecture.md's crate diagram names exactly the workspace's crates, as `cargo
//! metadata` lists them: a crate added, renamed or removed must be drawn.

use std::collections::BTreeSet;
use std::process::Command;

/// The workspace members' names, from `cargo metadata`.
fn members() -> BTreeSet<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    meta["packages"]
        .as_array()
        .expect("a package list")
        .iter()
        .map(|p| p["name"].as_str().expect("a name").to_owned())
        .collect()
}

/// The crates the diagram draws: every word `graft` or `graft-...` of the first `text` block
/// after "The crates, from the bottom up" (the root crate is written `graft (root)`).
fn drawn() -> BTreeSet<String> {
    let doc = include_str!("../docs/architecture.md");
    let from = doc
        .find("The crates, from the bottom up")
        .expect("the crate diagram's heading");
    let block = doc[from..]
        .split("```text\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a text block after the heading");
    block
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '-'))
        .filter(|w| {
            w.strip_prefix("graft")
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_crate_diagram_names_every_workspace_crate() {
    assert_eq!(drawn(), members());
}
