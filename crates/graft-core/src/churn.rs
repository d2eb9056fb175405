//! Naming the cause of a function that never replays: a key, an input size, or the address
//! of an input no recording follows (a static, an input overlapping another, an in-place
//! input of a function whose inputs are never copied), that changed on each of the last
//! [`CHURN_CALLS`] calls, each of which got a new signature (or re-recorded because the input
//! moved).
//!
//! The watch runs only on those calls, which are slow already (a new signature, a
//! re-recording). It learns that such calls follow each other through [`Last`], the function's
//! last signature tagged in its top bits: a tagged value is no index, so the call after a
//! churning one finds its signature by hash (not by the last-signature comparison of the fast
//! path) and rewrites it. The replay fast path therefore neither reads nor writes anything of
//! the watch.

use std::fmt;

/// Consecutive churning calls after which a component is named.
pub(crate) const CHURN_CALLS: u32 = 8;

/// A part of a function's signature that changed on every one of its last calls, each of which
/// was therefore a new signature (or, for a static input, a re-recording), so that none
/// replayed (see `Graft::churn`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Churn {
    /// `keys[index]` changed on each call: usually a host value (a position, a step counter)
    /// passed as a key.
    Key {
        /// The key's index.
        index: usize,
        /// Consecutive calls that changed it, each a new signature (at least 8).
        calls: u32,
    },
    /// The byte size of the input at `position` changed on each call.
    InputSize {
        /// The input's position.
        position: usize,
        /// Consecutive calls that changed it, each a new signature (at least 8).
        calls: u32,
    },
    /// The static input at `position` moved on each call, so each call re-recorded.
    StaticAddress {
        /// The input's position.
        position: usize,
        /// Consecutive calls that moved it, each a re-recording (at least 8).
        calls: u32,
    },
    /// The in-place input at `position` of a function whose body reads its inputs through
    /// handles of its own (`FunctionSpec::never_copy_inputs`) moved on each call where its
    /// graph cannot follow it, so each call re-recorded.
    InPlaceAddress {
        /// The input's position.
        position: usize,
        /// Consecutive calls that moved it, each a re-recording (at least 8).
        calls: u32,
    },
    /// The input at `position`, which overlaps another input at another offset (a tensor and
    /// a view into it), moved on each call, so each call re-recorded: such inputs are neither
    /// followed nor copied.
    OverlappingInput {
        /// The input's position.
        position: usize,
        /// Consecutive calls that moved it, each a re-recording (at least 8).
        calls: u32,
    },
}

impl Churn {
    /// The component, without the count: what a warning is given once for.
    fn cause(&self) -> (std::mem::Discriminant<Churn>, usize) {
        let at = match *self {
            Churn::Key { index, .. } => index,
            Churn::InputSize { position, .. }
            | Churn::StaticAddress { position, .. }
            | Churn::InPlaceAddress { position, .. }
            | Churn::OverlappingInput { position, .. } => position,
        };
        (std::mem::discriminant(self), at)
    }

    /// The text, naming `function` after the component when given (the warning's form).
    fn write(&self, f: &mut fmt::Formatter<'_>, function: Option<&str>) -> fmt::Result {
        let of = |f: &mut fmt::Formatter<'_>| match function {
            Some(name) => write!(f, " of `{name}`"),
            None => Ok(()),
        };
        match *self {
            Churn::Key { index, calls } => {
                write!(f, "keys[{index}]")?;
                of(f)?;
                write!(
                    f,
                    " changed on each of the last {calls} calls, so every call is a new signature and none replays: a host value (a position, a step counter) is passed as a key; keep it on the device (a tensor passed as a static) instead"
                )
            }
            Churn::InputSize { position, calls } => {
                write!(f, "input {position}")?;
                of(f)?;
                write!(
                    f,
                    " changed size on each of the last {calls} calls, so every call is a new signature and none replays: pad it to a few sizes and register them as buckets (FunctionSpec::buckets)"
                )
            }
            Churn::StaticAddress { position, calls } => {
                write!(f, "input {position} (static)")?;
                of(f)?;
                write!(
                    f,
                    " moved on each of the last {calls} calls, so each call re-records: keep a static at one address (a buffer allocated once and written in place)"
                )
            }
            Churn::InPlaceAddress { position, calls } => {
                write!(f, "input {position}")?;
                of(f)?;
                write!(
                    f,
                    " moved on each of the last {calls} calls where its graph cannot follow it (a copy or memset touches it, or a kernel whose parameters graft cannot read, such as NCCL's, or a device loop), so each call re-records: write each call's values into one buffer and pass that, or hold fewer of the old buffers so that their memory is reused"
                )
            }
            Churn::OverlappingInput { position, calls } => {
                write!(f, "input {position}")?;
                of(f)?;
                write!(
                    f,
                    " overlaps another input at another offset and moved on each of the last {calls} calls, so each call re-records and none replays (inputs that partly overlap are neither followed nor copied): pass them as one buffer (the same address and length), or keep them at stable addresses"
                )
            }
        }
    }
}

impl fmt::Display for Churn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, None)
    }
}

/// A churn with its function's name: the warning's text.
struct Named<'a>(&'a Churn, &'a str);

impl fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.write(f, Some(self.1))
    }
}

/// The signature of a function's last call, with two tags in its top bits for the watch:
/// `CHURNED` (that call was a new signature or re-recorded for a moved input) and `FOLLOWS`
/// (that call came right after such a call). A tagged value is no index of any signature.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct Last(usize);

impl Last {
    const CHURNED: usize = 1 << (usize::BITS - 1);
    const FOLLOWS: usize = 1 << (usize::BITS - 2);

    /// The value as stored: the fast path looks the last signature up with it, which fails
    /// when it is tagged.
    #[inline]
    pub(crate) fn raw(self) -> usize {
        self.0
    }

    /// The signature of the last call, whatever its tags.
    pub(crate) fn index(self) -> usize {
        self.0 & !(Last::CHURNED | Last::FOLLOWS)
    }

    /// Whether the last call was a new signature or re-recorded for a moved input.
    pub(crate) fn churned(self) -> bool {
        self.0 & Last::CHURNED != 0
    }

    /// Whether the last call came right after a churning call.
    pub(crate) fn follows(self) -> bool {
        self.0 & Last::FOLLOWS != 0
    }

    /// A call of `sig` that churned.
    pub(crate) fn churning(sig: usize) -> Last {
        Last(sig | Last::CHURNED)
    }

    /// A call of a known `sig`, found by hash, after a call described by `previous`.
    pub(crate) fn after(previous: Last, sig: usize) -> Last {
        Last(if previous.churned() {
            sig | Last::FOLLOWS
        } else {
            sig
        })
    }
}

/// Which input moved where no recording follows it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Moved {
    /// A static input.
    Static,
    /// An in-place input the graph cannot follow, of a function whose inputs are never
    /// copied.
    InPlace,
    /// An in-place input overlapping another input at another offset.
    Overlapping,
}

/// A function's signature as the watch compares it: its input sizes and keys.
pub(crate) struct Shape<'a> {
    pub(crate) sizes: &'a [usize],
    pub(crate) keys: &'a [u64],
}

/// What a function's watch has seen of its churning calls.
#[derive(Default)]
pub(crate) struct Watch {
    /// Per key index: consecutive new signatures that changed it, ending at the last one.
    keys: Vec<u32>,
    /// Per input position: the same for its size.
    sizes: Vec<u32>,
    /// When the last churning call re-recorded for a moved input (a static, or one overlapping
    /// another): its position and run.
    moved: Option<(usize, u32)>,
    /// The cause named last.
    named: Option<Churn>,
    /// The causes warned about (each once).
    warned: Vec<Churn>,
}

impl Watch {
    /// The cause named last, if any.
    pub(crate) fn churn(&self) -> Option<&Churn> {
        self.named.as_ref()
    }

    /// Whether a changing key or input size was named: that, not the number of shapes the
    /// program has, explains the function's many signatures.
    pub(crate) fn explains_signatures(&self) -> bool {
        self.warned
            .iter()
            .any(|c| matches!(c, Churn::Key { .. } | Churn::InputSize { .. }))
    }

    /// A call of `function` got a new signature, `now`. `previous` is the last call's
    /// signature (none before the first call), `last` that call's tags. With `bucketed`,
    /// `keys[0]` is the bucket: never named, and sizes that change with it are the bucket's.
    pub(crate) fn new_signature(
        &mut self,
        function: &str,
        previous: Option<Shape<'_>>,
        last: Last,
        now: Shape<'_>,
        bucketed: bool,
    ) {
        let after_static = self.moved.take().is_some();
        if !last.churned() || after_static {
            self.keys.clear();
            self.sizes.clear();
        }
        let Some(previous) = previous else {
            return;
        };
        count(&mut self.keys, previous.keys, now.keys);
        count(&mut self.sizes, previous.sizes, now.sizes);
        if bucketed && let Some(run) = self.keys.first_mut() {
            *run = 0;
        }
        if bucketed && previous.keys.first() != now.keys.first() {
            self.sizes.iter_mut().for_each(|run| *run = 0);
        }
        let keys = (self.keys.iter().enumerate())
            .filter(|&(_, &calls)| calls >= CHURN_CALLS)
            .map(|(index, &calls)| Churn::Key { index, calls });
        let sizes = (self.sizes.iter().enumerate())
            .filter(|&(_, &calls)| calls >= CHURN_CALLS)
            .map(|(position, &calls)| Churn::InputSize { position, calls });
        let found: Vec<Churn> = keys.chain(sizes).collect();
        self.name(function, &found);
    }

    /// A call of `function` re-records because the input at `position` moved where no
    /// recording follows it (`moved` says which kind of input); `last` tags that call
    /// (whether it came right after a churning one).
    pub(crate) fn moved(&mut self, function: &str, moved: Moved, position: usize, last: Last) {
        let calls = match self.moved {
            Some((p, run)) if p == position && last.follows() => run.saturating_add(1),
            _ => 1,
        };
        self.moved = Some((position, calls));
        if calls >= CHURN_CALLS {
            let churn = match moved {
                Moved::Static => Churn::StaticAddress { position, calls },
                Moved::InPlace => Churn::InPlaceAddress { position, calls },
                Moved::Overlapping => Churn::OverlappingInput { position, calls },
            };
            self.name(function, &[churn]);
        }
    }

    /// Names the first of `found` (the latest cause), and warns once per new cause.
    fn name(&mut self, function: &str, found: &[Churn]) {
        let Some(&first) = found.first() else {
            return;
        };
        self.named = Some(first);
        for churn in found {
            if !self.warned.iter().any(|w| w.cause() == churn.cause()) {
                self.warned.push(*churn);
                tracing::warn!(function, "{}", Named(churn, function));
            }
        }
    }
}

/// Extends the run of each component (by index) that differs between `before` and `now` and
/// ends the others; `runs` covers the longer of the two lists.
fn count<T: PartialEq>(runs: &mut Vec<u32>, before: &[T], now: &[T]) {
    runs.resize(before.len().max(now.len()), 0);
    for (i, run) in runs.iter_mut().enumerate() {
        *run = if before.get(i) == now.get(i) {
            0
        } else {
            run.saturating_add(1)
        };
    }
}

#[cfg(test)]
mod tests {
    //! The watch on its own: sequences of calls described by their shapes and tags.

    use super::*;

    /// Shows `watch` new signatures with one input of `sizes[i]` bytes and keys `keys[i]`,
    /// each call right after the one before, and returns what it named.
    fn run(watch: &mut Watch, bucketed: bool, calls: &[(usize, &[u64])]) -> Option<Churn> {
        for pair in calls.windows(2) {
            let ((s0, k0), (s1, k1)) = (pair[0], pair[1]);
            let previous = Shape {
                sizes: &[s0],
                keys: k0,
            };
            let now = Shape {
                sizes: &[s1],
                keys: k1,
            };
            watch.new_signature("f", Some(previous), Last::churning(0), now, bucketed);
        }
        watch.churn().copied()
    }

    #[test]
    fn a_key_is_named_on_the_eighth_consecutive_change_not_before() {
        let keys: Vec<[u64; 2]> = (0..10).map(|i| [7, i]).collect();
        let calls: Vec<(usize, &[u64])> = keys.iter().map(|k| (4, &k[..])).collect();
        assert_eq!(run(&mut Watch::default(), false, &calls[..8]), None);
        let named = run(&mut Watch::default(), false, &calls[..9]);
        assert_eq!(named, Some(Churn::Key { index: 1, calls: 8 }));
        let named = run(&mut Watch::default(), false, &calls);
        assert_eq!(named, Some(Churn::Key { index: 1, calls: 9 }));
    }

    #[test]
    fn a_call_that_found_its_signature_restarts_the_count() {
        let keys: Vec<[u64; 1]> = (0..16).map(|i| [i]).collect();
        let calls: Vec<(usize, &[u64])> = keys.iter().map(|k| (4, &k[..])).collect();
        let mut watch = Watch::default();
        // Seven changes in a row; then a call finds its signature (the watch does not see
        // it, but the next new signature's tags say so), and seven more changes follow.
        run(&mut watch, false, &calls[..8]);
        let previous = Shape {
            sizes: &[4],
            keys: &keys[7],
        };
        let now = Shape {
            sizes: &[4],
            keys: &keys[8],
        };
        let found = Last::after(Last::churning(0), 0);
        watch.new_signature("f", Some(previous), found, now, false);
        assert_eq!(run(&mut watch, false, &calls[8..14]), None);
        // Without the break, the same changes are eight in a row.
        assert_eq!(
            run(&mut Watch::default(), false, &calls[..9]),
            Some(Churn::Key { index: 0, calls: 8 })
        );
    }

    #[test]
    fn a_bucket_and_the_sizes_that_follow_it_are_not_named() {
        let keys: Vec<[u64; 1]> = (1..20).map(|b| [b]).collect();
        let buckets: Vec<(usize, &[u64])> =
            keys.iter().map(|k| (4 * k[0] as usize, &k[..])).collect();
        assert_eq!(run(&mut Watch::default(), true, &buckets), None);
        // Without buckets, both the key and the size are named: the key first.
        let named = run(&mut Watch::default(), false, &buckets);
        assert_eq!(
            named,
            Some(Churn::Key {
                index: 0,
                calls: 18
            })
        );
        // Within one bucket, a size that changes on every call is named.
        let sizes: Vec<(usize, &[u64])> = (1..20).map(|n| (n, &[8u64][..])).collect();
        let named = run(&mut Watch::default(), true, &sizes);
        assert_eq!(
            named,
            Some(Churn::InputSize {
                position: 0,
                calls: 18
            })
        );
    }

    #[test]
    fn a_static_is_named_when_it_moves_on_consecutive_calls() {
        let mut watch = Watch::default();
        watch.moved("f", Moved::Static, 3, Last::default());
        for _ in 0..6 {
            watch.moved("f", Moved::Static, 3, Last::after(Last::churning(0), 0));
        }
        assert_eq!(watch.churn(), None, "seven moves");
        // A call in between (a replay) leaves no follows tag: the count starts over.
        watch.moved("f", Moved::Static, 3, Last::default());
        for _ in 0..6 {
            watch.moved("f", Moved::Static, 3, Last::after(Last::churning(0), 0));
        }
        assert_eq!(watch.churn(), None);
        watch.moved("f", Moved::Static, 3, Last::after(Last::churning(0), 0));
        let named = Churn::StaticAddress {
            position: 3,
            calls: 8,
        };
        assert_eq!(watch.churn(), Some(&named));
        assert!(
            !watch.explains_signatures(),
            "a moving static adds no signature"
        );
        assert_eq!(
            Named(&named, "decode").to_string(),
            "input 3 (static) of `decode` moved on each of the last 8 calls, so each call re-records: keep a static at one address (a buffer allocated once and written in place)"
        );
    }

    #[test]
    fn the_warnings_name_the_component_the_function_and_the_remedy() {
        let key = Churn::Key { index: 0, calls: 8 };
        assert_eq!(
            Named(&key, "decode").to_string(),
            "keys[0] of `decode` changed on each of the last 8 calls, so every call is a new signature and none replays: a host value (a position, a step counter) is passed as a key; keep it on the device (a tensor passed as a static) instead"
        );
        let size = Churn::InputSize {
            position: 2,
            calls: 9,
        };
        assert_eq!(
            size.to_string(),
            "input 2 changed size on each of the last 9 calls, so every call is a new signature and none replays: pad it to a few sizes and register them as buckets (FunctionSpec::buckets)"
        );
    }
}
