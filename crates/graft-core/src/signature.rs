//! Registered functions and their signatures: finding a call's signature by its input sizes
//! and keys, and creating a new one (with its bucket check and its eager rules) in a new slot
//! or in the slot of one that never recorded (see [`Function::place`]).

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::ops::{Index, IndexMut};
use std::sync::Arc;

use foldhash::fast::FixedState;

use crate::bucket::Bucket;
use crate::buffer::Buffer;
use crate::churn::{Churn, Last, Moved, Shape, Watch};
use crate::config::{Config, FunctionSpec};
use crate::device::DevicePtr;
use crate::error::{CallError, FunctionId};
use crate::reason::EagerReason;
use crate::uses::Uses;

/// One signature of a function: input sizes and keys, and what graft learned about it.
pub(crate) struct Signature {
    pub(crate) sizes: Box<[usize]>,
    pub(crate) keys: Box<[u64]>,
    pub(crate) warmups_done: u32,
    pub(crate) eager: Option<EagerReason>,
    /// Copied inputs the body was found to write: recordings copy them back to the caller.
    pub(crate) mutated: Vec<usize>,
    /// In-place inputs found at a new address where a recording could not follow them:
    /// recordings copy them into a placeholder instead (see `RecordReason::InPlaceInputMoved`).
    pub(crate) copy_in_place: Vec<usize>,
    /// A node of this signature was attached to the tree once: it is never recycled.
    pub(crate) recorded: bool,
    /// When a call last used it, by [`Function::touch`]: orders recycling.
    used: u64,
    /// Calls that did not replay (warmups, recordings, eager runs), by [`Function::touch`]:
    /// the raw count of [`Signature::uses`].
    calls: u64,
    /// How often it was called recently without replaying, aged, plus the calls of its
    /// evicted graphs: what the graph budget admits a new graph by (see `admit.rs`).
    pub(crate) uses: Uses,
}

impl Signature {
    /// A signature that nothing has been learned about yet.
    pub(crate) fn new(sizes: Box<[usize]>, keys: Box<[u64]>, eager: Option<EagerReason>) -> Self {
        Signature {
            sizes,
            keys,
            warmups_done: 0,
            eager,
            mutated: Vec::new(),
            copy_in_place: Vec::new(),
            recorded: false,
            used: 0,
            calls: 0,
            uses: Uses::default(),
        }
    }

    /// Whether its slot may take another signature: it never recorded (so no node refers to
    /// it, and it learned nothing: written inputs are learned by recording),
    /// and it is eager, if at all, only by the rules [`Function::add`] derives from the spec.
    /// A capture failure is learned, and kept.
    fn recyclable(&self) -> bool {
        !self.recorded
            && self.eager.as_ref().is_none_or(|why| {
                matches!(
                    why,
                    EagerReason::AboveLargestBucket { .. }
                        | EagerReason::Registered
                        | EagerReason::NotAllowListed
                )
            })
    }

    /// How often it was called recently without replaying (see [`Uses`]), once aged by
    /// `windows` windows (none: now).
    pub(crate) fn uses_aged(&self, windows: u64) -> u64 {
        self.uses.estimate_aged(self.calls, windows)
    }

    /// Ages [`Signature::uses`] by `windows` windows.
    pub(crate) fn age(&mut self, windows: u64) {
        self.uses.age(self.calls, windows);
    }

    /// Whether `inputs` and `keys` are this signature's.
    #[inline]
    pub(crate) fn matches(&self, inputs: &[&Buffer], keys: &[u64]) -> bool {
        // Element loops, not slice equality: that calls memcmp, which costs more than the
        // handful of integers compared here.
        same_keys(&self.keys, keys)
            && self.sizes.len() == inputs.len()
            && self.sizes.iter().zip(inputs).all(|(&s, b)| s == b.len())
    }
}

/// Whether two key lists are equal (an element loop: slice equality calls memcmp, which costs
/// more than the handful of integers compared here).
#[inline]
fn same_keys(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// A hash of a call's input sizes and keys (the signature's identity). Fixed-seeded, so the
/// ranks of a group hash one signature alike.
pub(crate) fn shape_hash(sizes: impl ExactSizeIterator<Item = usize>, keys: &[u64]) -> u64 {
    let mut h = FixedState::default().build_hasher();
    h.write_usize(sizes.len());
    sizes.for_each(|n| h.write_usize(n));
    keys.iter().for_each(|&k| h.write_u64(k));
    h.finish()
}

/// A function's warmups of one generation, each as the [`call_hash`] of its signature and
/// static inputs (off the replay path: warmups only).
#[derive(Default)]
pub(crate) struct Warmed {
    generation: u64,
    calls: HashSet<u64, FixedState>,
}

impl Warmed {
    /// Notes a warmup of `generation` (forgetting those of earlier generations).
    pub(crate) fn note(&mut self, generation: u64, call: u64) {
        if self.generation != generation {
            self.generation = generation;
            self.calls.clear();
        }
        self.calls.insert(call);
    }

    /// Whether a warmup of `generation` had this [`call_hash`].
    pub(crate) fn holds(&self, generation: u64, call: u64) -> bool {
        self.generation == generation && self.calls.contains(&call)
    }

    /// Forgets every warmup.
    pub(crate) fn clear(&mut self) {
        self.calls.clear();
    }
}

/// A hash of a call's signature and static input addresses: what the loop rule compares.
pub(crate) fn call_hash(f: &Function, sig: usize, addrs: &[DevicePtr]) -> u64 {
    let mut h = FixedState::default().build_hasher();
    h.write_usize(sig);
    for &p in &f.spec.static_inputs {
        h.write_u64(addrs.get(p).map_or(u64::MAX, |a| a.0));
    }
    h.finish()
}

pub(crate) struct Function {
    pub(crate) name: Arc<str>,
    pub(crate) spec: FunctionSpec,
    pub(crate) sigs: Vec<Signature>,
    /// Signatures by [`shape_hash`] of their sizes and keys, so a call that switches between
    /// many shapes (buckets) finds its signature with one lookup.
    by_shape: HashMap<u64, Vec<usize>, FixedState>,
    /// Has been the first call of a generation.
    pub(crate) root_level: bool,
    /// The calls that warmed up in the current generation: what the loop rule compares a
    /// call with while the path warms up (see `plan::repeats`).
    pub(crate) warmed: Warmed,
    warned_signatures: bool,
    /// Warned that the graph budget is smaller than the current path (see `graft.rs`).
    pub(crate) warned_budget: bool,
    /// Warned that a call was above the largest bucket.
    warned_above_buckets: bool,
    /// The signature of the last call, tagged for the watch (see [`Last`]).
    last: Last,
    /// Churning calls (see `churn.rs`).
    watch: Watch,
    /// Counts calls that did not replay: the stamps of [`Function::touch`].
    tick: u64,
}

impl Function {
    pub(crate) fn new(name: &str, spec: FunctionSpec) -> Function {
        Function {
            name: Arc::from(name),
            spec,
            sigs: Vec::new(),
            by_shape: HashMap::default(),
            root_level: false,
            warmed: Warmed::default(),
            warned_signatures: false,
            warned_budget: false,
            warned_above_buckets: false,
            last: Last::default(),
            watch: Watch::default(),
            tick: 0,
        }
    }

    /// The input sizes of the signature called last (empty before the first call, and right
    /// after a churning call: see [`Last`]): the usual signature in a loop, which a caller may
    /// compare while it reads the inputs anyway.
    pub(crate) fn last_sizes(&self) -> &[usize] {
        self.sigs
            .get(self.last.raw())
            .map_or(&[][..], |s| &s.sizes[..])
    }

    /// The cause the watch named last for this function's calls never replaying.
    pub(crate) fn churn(&self) -> Option<&Churn> {
        self.watch.churn()
    }

    /// Stamps `sig` as used by a call that does not replay, and counts the call. A signature
    /// that never recorded never replays, so its stamps order exactly the signatures that may
    /// be recycled.
    pub(crate) fn touch(&mut self, sig: usize) {
        self.tick += 1;
        let s = &mut self.sigs[sig];
        s.used = self.tick;
        s.calls += 1;
    }

    /// This call of `sig` re-records because the input at `position` moved where no recording
    /// follows it: the watch counts it (see `Watch::moved`).
    pub(crate) fn moved(&mut self, sig: usize, moved: Moved, position: usize) {
        self.watch.moved(&self.name, moved, position, self.last);
        self.last = Last::churning(sig);
    }

    /// The signature of a call that is not the last one called again: found by its shape's
    /// hash, or added. Remembered as the last one, tagged for the watch.
    fn look_up<E>(
        &mut self,
        inputs: &[&Buffer],
        keys: &[u64],
        config: &Config,
    ) -> Result<Found, CallError<E>> {
        let hash = shape_hash(inputs.iter().map(|b| b.len()), keys);
        let known = self.by_shape.get(&hash).and_then(|c| {
            c.iter()
                .copied()
                .find(|&i| self.sigs[i].matches(inputs, keys))
        });
        if let Some(sig) = known {
            self.last = Last::after(self.last, sig);
            return Ok(Found {
                sig,
                new_eager: None,
            });
        }
        let sig = self.add(inputs, keys, hash, config)?;
        self.last = Last::churning(sig);
        Ok(Found {
            sig,
            new_eager: self.sigs[sig].eager.clone(),
        })
    }

    /// Adds a signature for these inputs and keys (`hash`: their [`shape_hash`]), checking the
    /// bucket of a function with buckets (the signature of a size above the largest bucket is
    /// eager), and shows it to the watch.
    fn add<E>(
        &mut self,
        inputs: &[&Buffer],
        keys: &[u64],
        hash: u64,
        config: &Config,
    ) -> Result<usize, CallError<E>> {
        let above = match (&self.spec.buckets, keys.first()) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(CallError::MissingBucket {
                    function: self.name.clone(),
                });
            }
            (Some(b), Some(&size)) => match usize::try_from(size).map(|s| b.pick(s)) {
                Ok(Bucket::Padded(bucket)) if bucket as u64 == size => None,
                Ok(Bucket::Padded(bucket)) => {
                    return Err(CallError::NotABucket {
                        function: self.name.clone(),
                        size,
                        bucket,
                    });
                }
                Ok(Bucket::Above { .. }) | Err(_) => Some(EagerReason::AboveLargestBucket {
                    size,
                    largest: b.largest(),
                }),
            },
        };
        let eager = if above.is_some() {
            above
        } else if self.spec.eager_only {
            Some(EagerReason::Registered)
        } else if let Some(allow) = &config.allow_list {
            let listed = allow.iter().any(|e| {
                *e.function == *self.name && e.keys.as_ref().is_none_or(|k| k.as_slice() == keys)
            });
            (!listed).then_some(EagerReason::NotAllowListed)
        } else {
            None
        };
        if let Some(why) = &eager {
            tracing::debug!(function = %self.name, reason = %why, "a new signature runs eagerly");
            // A serving batch past the largest bucket runs eagerly on every call: say so once.
            if let EagerReason::AboveLargestBucket { size, largest } = why
                && !self.warned_above_buckets
            {
                self.warned_above_buckets = true;
                tracing::warn!(
                    function = %self.name, size, largest,
                    "a call's size is above the function's largest bucket, so calls of that size run eagerly (every one, without a graph): add a larger bucket to graph them"
                );
            }
        }
        let sizes: Box<[usize]> = inputs.iter().map(|b| b.len()).collect();
        let previous = self.sigs.get(self.last.index()).map(|s| Shape {
            sizes: &s.sizes,
            keys: &s.keys,
        });
        let now = Shape {
            sizes: &sizes,
            keys,
        };
        let bucketed = self.spec.buckets.is_some();
        self.watch
            .new_signature(&self.name, previous, self.last, now, bucketed);
        // Buckets bound the signatures by design: every bucket may keep its signature, and
        // none warns.
        let buckets = self.spec.buckets.as_ref().map_or(0, |b| b.sizes().len());
        let sig = Signature::new(sizes, keys.into(), eager);
        let sig = self.place(sig, hash, config.max_unrecorded_signatures.max(buckets));
        let limit = config.signature_warn_limit.max(buckets);
        if self.sigs.len() > limit && !self.warned_signatures {
            self.warned_signatures = true;
            // A key or size that changes on every call was named already: that is the cause.
            if !self.watch.explains_signatures() {
                tracing::warn!(
                    function = %self.name,
                    signatures = self.sigs.len(),
                    "function called with more distinct signatures than the warn limit; pad or bucket the inputs to fewer shapes"
                );
            }
        }
        Ok(sig)
    }

    /// Stores a new signature (`hash`: its [`shape_hash`]) and returns its index. When
    /// `bound` signatures that may be recycled exist already (see [`Signature::recyclable`]),
    /// it takes the slot of the least recently used of them, other than the last call's; else
    /// a new slot. Indices stay stable: a recycled index leaves `by_shape` under its old hash
    /// and joins it under the new one, and no node refers to it.
    fn place(&mut self, sig: Signature, hash: u64, bound: usize) -> usize {
        let last = self.last.index();
        let mut recyclable = 0;
        let mut victim: Option<usize> = None;
        for (i, s) in self.sigs.iter().enumerate() {
            if s.recyclable() {
                recyclable += 1;
                if i != last && victim.is_none_or(|v| s.used < self.sigs[v].used) {
                    victim = Some(i);
                }
            }
        }
        let index = match victim.filter(|_| recyclable >= bound) {
            Some(v) => {
                let old = &self.sigs[v];
                let old_hash = shape_hash(old.sizes.iter().copied(), &old.keys);
                if let Some(list) = self.by_shape.get_mut(&old_hash) {
                    list.retain(|&i| i != v);
                    if list.is_empty() {
                        self.by_shape.remove(&old_hash);
                    }
                }
                tracing::trace!(function = %self.name, signature = v, "recycled a signature that never recorded");
                self.sigs[v] = sig;
                v
            }
            None => {
                self.sigs.push(sig);
                self.sigs.len() - 1
            }
        };
        self.by_shape.entry(hash).or_default().push(index);
        index
    }
}

/// A signature found for a call.
pub(crate) struct Found {
    pub(crate) sig: usize,
    /// The signature is new and runs eagerly, for this reason (the caller logs it).
    pub(crate) new_eager: Option<EagerReason>,
}

/// The registered functions, indexed by [`FunctionId`].
#[derive(Default)]
pub(crate) struct Functions(Vec<Function>);

impl Index<FunctionId> for Functions {
    type Output = Function;

    #[inline]
    fn index(&self, id: FunctionId) -> &Function {
        &self.0[id.0]
    }
}

impl IndexMut<FunctionId> for Functions {
    #[inline]
    fn index_mut(&mut self, id: FunctionId) -> &mut Function {
        &mut self.0[id.0]
    }
}

impl Functions {
    /// Registers a function and returns its id.
    pub(crate) fn register(&mut self, name: &str, spec: FunctionSpec) -> FunctionId {
        self.0.push(Function::new(name, spec));
        FunctionId(self.0.len() - 1)
    }

    /// The function `id`, if it is registered.
    #[inline]
    pub(crate) fn get(&self, id: FunctionId) -> Option<&Function> {
        self.0.get(id.0)
    }

    /// Every function, in registration order.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Function> {
        self.0.iter_mut()
    }

    /// The signature of a call of `function` (registered) with these inputs and keys, found or
    /// added, and remembered as the last one. `same_sizes`: the inputs have
    /// [`Function::last_sizes`], so when the keys are the last call's too, it is the last
    /// signature called again (the fast path, which leaves everything as it is); otherwise
    /// see [`Function::look_up`].
    #[inline]
    pub(crate) fn signature<E>(
        &mut self,
        function: FunctionId,
        inputs: &[&Buffer],
        keys: &[u64],
        same_sizes: bool,
        config: &Config,
    ) -> Result<Found, CallError<E>> {
        let f = &mut self[function];
        let last = f.last.raw();
        match f.sigs.get(last) {
            Some(s) if same_sizes && same_keys(&s.keys, keys) => Ok(Found {
                sig: last,
                new_eager: None,
            }),
            _ => f.look_up(inputs, keys, config),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Finding, adding and recycling signatures, without a device.

    use super::*;
    use crate::device::{DeviceId, DevicePtr};

    const F: FunctionId = FunctionId(0);

    fn functions(spec: FunctionSpec) -> Functions {
        let mut fs = Functions::default();
        fs.register("f", spec);
        fs
    }

    /// A call with one input of `len` bytes, found as `Graft::validate` finds it, and stamped
    /// as the executor stamps a call that does not replay. Returns its signature.
    fn call(fs: &mut Functions, len: usize, keys: &[u64], config: &Config) -> usize {
        let b = Buffer::external(DeviceId::fresh(), DevicePtr(0x1000), len, None);
        let same_sizes = fs[F].last_sizes() == [len];
        let sig = fs
            .signature::<AnyErr>(F, &[&b], keys, same_sizes, config)
            .unwrap()
            .sig;
        fs[F].touch(sig);
        sig
    }

    type AnyErr = crate::error::AnyError;

    /// Every signature is listed once in `by_shape`, under its own hash, and nothing else is.
    fn assert_lookup_exact(f: &Function) {
        let listed: usize = f.by_shape.values().map(Vec::len).sum();
        assert_eq!(listed, f.sigs.len(), "stale or missing entries");
        for (i, s) in f.sigs.iter().enumerate() {
            let hash = shape_hash(s.sizes.iter().copied(), &s.keys);
            assert_eq!(f.by_shape[&hash].iter().filter(|&&j| j == i).count(), 1);
        }
    }

    #[test]
    fn a_key_changing_on_every_call_recycles_unrecorded_slots_only() {
        let config = Config {
            max_unrecorded_signatures: 8,
            ..Config::default()
        };
        let mut fs = functions(FunctionSpec::default());
        let recorded = call(&mut fs, 4, &[1_000_000], &config);
        fs[F].sigs[recorded].recorded = true;
        let failed = call(&mut fs, 4, &[1_000_001], &config);
        fs[F].sigs[failed].eager = Some(EagerReason::PeerCaptureFailed { rank: 1 });
        for key in 0..1000 {
            call(&mut fs, 4, &[key], &config);
            assert!(fs[F].sigs.len() <= 2 + 8, "{} signatures", fs[F].sigs.len());
        }
        assert_lookup_exact(&fs[F]);
        assert_eq!(call(&mut fs, 4, &[1_000_000], &config), recorded);
        assert_eq!(call(&mut fs, 4, &[1_000_001], &config), failed);
        // The 8 kept are the 8 used last: 992..1000, least recently used recycled first.
        let mut kept: Vec<u64> = fs[F]
            .sigs
            .iter()
            .filter(|s| s.recyclable())
            .map(|s| s.keys[0])
            .collect();
        kept.sort_unstable();
        assert_eq!(kept, (992..1000).collect::<Vec<u64>>());
        // A signature used again is recent again: the next new ones recycle the others.
        let again = call(&mut fs, 4, &[992], &config);
        for key in 2000..2007 {
            call(&mut fs, 4, &[key], &config);
        }
        assert_eq!(fs[F].sigs[again].keys[..], [992]);
    }

    #[test]
    fn the_last_call_is_never_recycled_so_the_bound_is_at_least_two() {
        let config = Config {
            max_unrecorded_signatures: 0,
            ..Config::default()
        };
        let mut fs = functions(FunctionSpec::default());
        for key in 0..10 {
            let sig = call(&mut fs, 4, &[key], &config);
            assert_eq!(fs[F].sigs[sig].keys[..], [key]);
            assert!(fs[F].sigs.len() <= 2);
        }
        assert_lookup_exact(&fs[F]);
    }

    #[test]
    fn eager_by_the_spec_is_recycled_eager_by_experience_is_not() {
        let sig = |eager| Signature::new(Box::new([4]), Box::new([]), eager);
        let above = EagerReason::AboveLargestBucket {
            size: 9,
            largest: 8,
        };
        for derived in [above, EagerReason::Registered, EagerReason::NotAllowListed] {
            assert!(sig(Some(derived)).recyclable());
        }
        assert!(!sig(Some(EagerReason::PeerCaptureFailed { rank: 0 })).recyclable());
        let mut recorded = sig(None);
        recorded.recorded = true;
        assert!(!recorded.recyclable());
    }

    #[test]
    fn only_the_call_after_a_churning_one_leaves_the_fast_path() {
        let config = Config::default();
        let mut fs = functions(FunctionSpec::default());
        let sig = call(&mut fs, 4, &[1], &config);
        assert_eq!(fs[F].last, Last::churning(sig), "a new signature churned");
        assert!(
            fs[F].last_sizes().is_empty(),
            "so the next call looks it up"
        );
        call(&mut fs, 4, &[1], &config);
        assert!(fs[F].last.follows() && !fs[F].last.churned());
        call(&mut fs, 4, &[1], &config);
        assert_eq!(fs[F].last.raw(), sig, "untagged: the fast path from now on");
        assert_eq!(fs[F].last_sizes(), [4]);
        fs[F].moved(sig, Moved::Static, 0);
        assert_eq!(fs[F].last, Last::churning(sig), "a moved static churned");
    }
}
