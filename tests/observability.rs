//! Tracing: spans for warmup, record, replay, divergence, restore and fallback; nothing above
//! trace level while the tree only replays.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use graft::sim::SimDevice;
use graft::{Ctx, FunctionSpec, Output};
use tracing_subscriber::layer::{Context, SubscriberExt};

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(String, tracing::Level)>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Seen {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: Context<'_, S>,
    ) {
        let m = attrs.metadata();
        self.0
            .lock()
            .unwrap()
            .push((m.name().to_string(), *m.level()));
    }
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let m = event.metadata();
        self.0
            .lock()
            .unwrap()
            .push(("event".to_string(), *m.level()));
    }
}

impl Seen {
    fn take(&self) -> Vec<(String, tracing::Level)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

#[test]
fn spans_name_every_decision_and_replays_stay_at_trace() {
    let seen = Seen::default();
    let subscriber = tracing_subscriber::registry().with(seen.clone());
    tracing::subscriber::with_default(subscriber, || {
        let mut g: G<SimDevice> = graft(SimDevice::new(), unguarded());
        let fs = ["f1", "f2", "f3"].map(|n| g.register(n, FunctionSpec::default()));
        let x = input(&mut g, &[1.0; 4]);
        let runs = Runs::default();
        let step = |g: &mut G<SimDevice>, second: usize| {
            g.call(fs[0], &[&x], &[], affine(1.0, 1.0, &runs)).unwrap();
            g.call(fs[second], &[&x], &[], affine(2.0, 0.0, &runs))
                .unwrap();
            g.mark_step_begin();
        };
        for _ in 0..3 {
            step(&mut g, 1);
        }
        // Steady state: only replays.
        seen.take();
        for _ in 0..5 {
            step(&mut g, 1);
        }
        let replaying = seen.take();
        assert!(
            replaying.iter().any(|(n, _)| n == "replay"),
            "{replaying:?}"
        );
        assert!(
            replaying
                .iter()
                .all(|(_, level)| *level == tracing::Level::TRACE),
            "the replay path emits only trace-level spans and events: {replaying:?}"
        );
        // Divergence, warmup, record, and a fallback.
        step(&mut g, 2);
        step(&mut g, 2);
        let syncing = |ctx: &mut Ctx<'_, SimDevice>| {
            let out = ctx.alloc(16)?;
            ctx.queue().synchronize()?;
            Ok(vec![Output::new(out, 0)])
        };
        let f4 = g.register(
            "f4",
            FunctionSpec {
                warmups: Some(0),
                ..FunctionSpec::default()
            },
        );
        g.call(f4, &[&x], &[], syncing).unwrap();
    });
    let names: Vec<String> = seen.take().into_iter().map(|(n, _)| n).collect();
    for expected in ["divergence", "restore", "warmup", "record", "fallback"] {
        assert!(
            names.iter().any(|n| n == expected),
            "no {expected} span in {names:?}"
        );
    }
}
