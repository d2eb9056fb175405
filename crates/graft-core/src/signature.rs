//! Registered functions and their signatures: finding a call's signature by its input sizes
//! and keys, and creating a new one (with its bucket check and its eager rules).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::ops::{Index, IndexMut};
use std::sync::Arc;

use foldhash::fast::FixedState;

use crate::bucket::Bucket;
use crate::buffer::Buffer;
use crate::config::{Config, FunctionSpec};
use crate::error::{CallError, FunctionId};
use crate::reason::EagerReason;

/// One signature of a function: input sizes and keys, and what graft learned about it.
pub(crate) struct Signature {
    pub(crate) sizes: Box<[usize]>,
    pub(crate) keys: Box<[u64]>,
    pub(crate) warmups_done: u32,
    pub(crate) eager: Option<EagerReason>,
    /// Copied inputs the body was found to write: recordings copy them back to the caller.
    pub(crate) mutated: Vec<usize>,
    /// Times the graph budget evicted this signature's recordings: each doubles the eager
    /// calls it needs before it records again (see [`Signature::warmups_needed`]).
    pub(crate) evictions: u32,
}

impl Signature {
    /// Warmups before the signature records: the configured count, and after evictions by
    /// the graph budget `max(count, 1) * 2^evictions` (at most 64 times): a signature the
    /// budget keeps evicting runs eagerly more often instead of evicting others in turn.
    pub(crate) fn warmups_needed(&self, configured: u32) -> u32 {
        match self.evictions {
            0 => configured,
            n => configured.max(1) << n.min(6),
        }
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

pub(crate) struct Function {
    pub(crate) name: Arc<str>,
    pub(crate) spec: FunctionSpec,
    pub(crate) sigs: Vec<Signature>,
    /// Signatures by [`shape_hash`] of their sizes and keys, so a call that switches between
    /// many shapes (buckets) finds its signature with one lookup.
    by_shape: HashMap<u64, Vec<usize>, FixedState>,
    /// Has been the first call of a generation.
    pub(crate) root_level: bool,
    warned_signatures: bool,
    last_sig: usize,
}

impl Function {
    pub(crate) fn new(name: &str, spec: FunctionSpec) -> Function {
        Function {
            name: Arc::from(name),
            spec,
            sigs: Vec::new(),
            by_shape: HashMap::default(),
            root_level: false,
            warned_signatures: false,
            last_sig: 0,
        }
    }

    /// The input sizes of the signature called last (empty before the first call): the usual
    /// signature in a loop, which a caller may compare while it reads the inputs anyway.
    pub(crate) fn last_sizes(&self) -> &[usize] {
        self.sigs
            .get(self.last_sig)
            .map_or(&[][..], |s| &s.sizes[..])
    }

    /// The signature of these inputs and keys, if the function has it. `same_sizes`: the
    /// inputs have [`Function::last_sizes`], so only the keys are left to compare.
    #[inline]
    fn find(&self, inputs: &[&Buffer], keys: &[u64], same_sizes: bool) -> Option<usize> {
        match self.sigs.get(self.last_sig) {
            Some(s) if same_sizes && same_keys(&s.keys, keys) => Some(self.last_sig),
            _ => {
                let hash = shape_hash(inputs.iter().map(|b| b.len()), keys);
                self.by_shape.get(&hash).and_then(|c| {
                    c.iter()
                        .copied()
                        .find(|&i| self.sigs[i].matches(inputs, keys))
                })
            }
        }
    }

    /// Adds a signature for these inputs and keys, checking the bucket of a function with
    /// buckets (the signature of a size above the largest bucket is eager).
    fn add<E>(
        &mut self,
        inputs: &[&Buffer],
        keys: &[u64],
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
        }
        let sizes: Box<[usize]> = inputs.iter().map(|b| b.len()).collect();
        let hash = shape_hash(sizes.iter().copied(), keys);
        self.sigs.push(Signature {
            sizes,
            keys: keys.into(),
            warmups_done: 0,
            eager,
            mutated: Vec::new(),
            evictions: 0,
        });
        // Buckets bound the signatures by design: no warning for them.
        let limit = match &self.spec.buckets {
            Some(b) => config.signature_warn_limit.max(b.sizes().len()),
            None => config.signature_warn_limit,
        };
        if self.sigs.len() > limit && !self.warned_signatures {
            self.warned_signatures = true;
            tracing::warn!(
                function = %self.name,
                signatures = self.sigs.len(),
                "function called with more distinct signatures than the warn limit; pad or bucket the inputs to fewer shapes"
            );
        }
        let sig = self.sigs.len() - 1;
        self.by_shape.entry(hash).or_default().push(sig);
        Ok(sig)
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
    /// added (see [`Function::find`]; `same_sizes` as there), and remembered as the last one.
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
        let found = match f.find(inputs, keys, same_sizes) {
            Some(sig) => Found {
                sig,
                new_eager: None,
            },
            None => {
                let sig = f.add(inputs, keys, config)?;
                Found {
                    sig,
                    new_eager: f.sigs[sig].eager.clone(),
                }
            }
        };
        f.last_sig = found.sig;
        Ok(found)
    }
}
