//! The replay fast path allocates nothing: counted with a global allocator, in steady state
//! of an autoregressive loop (the previous output held as the next input).

mod common;
#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use common::*;
use counting_alloc::allocations;
use graft::sim::SimDevice;
use graft::{Config, FunctionSpec, Outcome};

/// Runs an autoregressive loop of `y = w + x` (the previous output held as the next input):
/// 8 calls to reach the steady state, then 1,000 replays. Returns the allocations of those.
fn allocations_of_1000_replays(g: &mut G<SimDevice>) -> u64 {
    let f = g.register("step", FunctionSpec::inference([0]));
    let w = input(g, &[0.5; 64]);
    let mut x = input(g, &[1.0; 64]);
    let runs = Runs::default();
    let mut body = add::<SimDevice>(&runs);
    let mut out = Vec::with_capacity(1);
    for _ in 0..8 {
        g.call_into(f, &[&w, &x], &[], &mut body, &mut out).unwrap();
        x = out.pop().unwrap().buffer;
    }
    let before = allocations();
    for _ in 0..1000 {
        let outcome = g.call_into(f, &[&w, &x], &[], &mut body, &mut out).unwrap();
        assert!(matches!(outcome, Outcome::Replayed(_)));
        x = out.pop().unwrap().buffer;
    }
    allocations() - before
}

#[test]
fn replay_fast_path_does_not_allocate() {
    let mut g: G<SimDevice> = graft(SimDevice::new(), unguarded());
    let per_call = allocations_of_1000_replays(&mut g) as f64 / 1000.0;
    assert_eq!(
        per_call, 0.0,
        "the replay path allocated {per_call} times per call"
    );
}

/// At serving scale: 64 static inputs per call, a tree of 1,000 recorded nodes (one per
/// bucket key), and calls that switch bucket every time, so the signature is found by hash
/// and the candidates by their (parent, function, signature) slot: still no allocation.
#[test]
fn switching_buckets_in_a_large_tree_does_not_allocate() {
    let mut g: G<SimDevice> = graft(SimDevice::new(), unguarded());
    let statics: Vec<usize> = (1..64).collect();
    let buckets = graft::Buckets::new(1..=1000).unwrap();
    let f = g.register(
        "step",
        FunctionSpec::inference(statics).buckets(buckets).warmups(0),
    );
    let x = input(&mut g, &[1.0; 16]);
    let ws: Vec<graft::Buffer> = (0..63).map(|_| input(&mut g, &[0.5; 4])).collect();
    let inputs: Vec<&graft::Buffer> = std::iter::once(&x).chain(&ws).collect();
    let runs = Runs::default();
    let mut body = affine::<SimDevice>(2.0, 0.0, &runs);
    let mut out = Vec::with_capacity(1);
    for key in 1..=1000u64 {
        g.call_into(f, &inputs, &[key], &mut body, &mut out)
            .unwrap();
        g.mark_step_begin();
    }
    assert_eq!(g.stats().nodes, 1000);
    let keys = [17u64, 503, 999, 1, 250];
    for &key in &keys {
        g.call_into(f, &inputs, &[key], &mut body, &mut out)
            .unwrap();
    }
    let before = allocations();
    for i in 0..1000 {
        let key = keys[i % keys.len()];
        let outcome = g
            .call_into(f, &inputs, &[key], &mut body, &mut out)
            .unwrap();
        assert!(matches!(outcome, Outcome::Replayed(_)), "{outcome:?}");
    }
    let per_call = (allocations() - before) as f64 / 1000.0;
    assert_eq!(
        per_call, 0.0,
        "the replay path allocated {per_call} times per call"
    );
}

/// With guards on (the default), the calls between two scheduled guards are plain replays
/// and allocate nothing either: calls 513 to 1023 after the recording (guards at 512 and 1024).
#[test]
fn replays_between_guards_do_not_allocate() {
    let mut g: G<SimDevice> = graft(SimDevice::new(), Config::default());
    let f = g.register("step", FunctionSpec::inference([0]));
    let w = input(&mut g, &[0.5; 64]);
    let mut x = input(&mut g, &[1.0; 64]);
    let runs = Runs::default();
    let mut body = add::<SimDevice>(&runs);
    let mut out = Vec::with_capacity(1);
    // A warmup, the recording, then calls 1 to 512 after it (the last one guarded).
    for _ in 0..514 {
        g.call_into(f, &[&w, &x], &[], &mut body, &mut out).unwrap();
        x = out.pop().unwrap().buffer;
    }
    assert_eq!(g.stats().guards, 10, "guards at calls 1, 2, 4, ..., 512");
    let before = allocations();
    for _ in 513..1024 {
        let outcome = g.call_into(f, &[&w, &x], &[], &mut body, &mut out).unwrap();
        assert!(matches!(outcome, Outcome::Replayed(_)));
        x = out.pop().unwrap().buffer;
    }
    let allocated = allocations() - before;
    assert_eq!(g.stats().guards, 10, "no guard between 512 and 1024");
    assert_eq!(
        allocated, 0,
        "replays between guards allocated {allocated} times"
    );
}

/// A rank of a tensor-parallel group: its recording was agreed with the group (here of one
/// rank, so the vote completes at once), and its replays take no vote and allocate nothing.
#[test]
fn replays_of_a_rank_in_a_group_do_not_allocate() {
    let mut g: G<SimDevice> = graft(SimDevice::new(), Config::default());
    let member = graft::Member::group(1, std::time::Duration::from_secs(5))
        .unwrap()
        .remove(0);
    g.join(member);
    let replays = allocations_of_1000_replays(&mut g);
    assert_eq!(g.stats().agreements, 1, "the one recording was voted on");
    assert_eq!(replays, 0, "a rank's replays allocated");
}
