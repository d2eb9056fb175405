//! Generation on the device: up to K tokens per launch (a CUDA conditional WHILE node around one decode step, sampling and the stopping rule), and the one-launch-per-token loop a server runs today, drawing the same tokens.
//!
//! Every value that changes between iterations lives in a device tensor of [`Generation`]
//! and is written in place: the current tokens, each sequence's "stopped" flag, the
//! iteration count, the loop's flag, and the `[K, batch]` tokens produced. Sampling draws
//! from a [`DeviceRng`] (seed and offset on the device) with the Gumbel-max trick over the
//! temperature-scaled, top-k-cut logits, so a replay, a loop iteration and an eager step
//! draw the same numbers.

use candle_core::{D, DType, Device, IndexOp, Result, Tensor, bail};

use super::{Decoder, KvCache};
use graft_candle::random::DeviceRng;
use graft_candle::{CandleGraft, Error, Step, StepId};
use graft_candle_kernels::argmax_last;

/// How the next token is picked from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token.
    Greedy,
    /// A draw from `softmax(logits / temperature)` over the `top_k` most likely tokens
    /// (all of them for 0).
    Sample {
        /// Above 0.
        temperature: f32,
        /// How many of the most likely tokens stay candidates; 0 keeps all.
        top_k: usize,
    },
}

/// What a generation stops on and how it picks tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenerateSpec {
    /// The most tokens one launch produces (K), at least 1.
    pub max_tokens: usize,
    /// A sequence stops after producing this token; later iterations write it again.
    pub eos: Option<u32>,
    /// How tokens are picked.
    pub sampling: Sampling,
}

/// The device state of a generation over sequences `0..batch` of a cache: pass
/// [`Generation::statics`] with the model's statics. Made once per batch and `max_tokens`,
/// reused across launches.
#[derive(Debug)]
pub struct Generation {
    spec: GenerateSpec,
    batch: usize,
    /// `[batch]` u32: each sequence's current token, the next step's input.
    tokens: Tensor,
    /// `[max_tokens, batch]` u32: token i of each sequence, in iteration order.
    out: Tensor,
    /// `[batch]` u32: 1 once a sequence produced `eos`.
    stopped: Tensor,
    /// `[1]` u32: iterations run.
    count: Tensor,
    /// `[1]` u32: 1 while the loop goes on.
    flag: Tensor,
    /// `[max_tokens, 1]` u32: 0, 1, ..., the output's row numbers.
    rows: Tensor,
}

impl Generation {
    /// The state for `batch` sequences on `device`.
    pub fn new(device: &Device, batch: usize, spec: GenerateSpec) -> Result<Generation> {
        if spec.max_tokens == 0 || batch == 0 {
            bail!(
                "a generation of {} tokens for {batch} sequences: ask for at least one of each",
                spec.max_tokens
            );
        }
        if let Sampling::Sample { temperature, .. } = spec.sampling
            && !(temperature > 0.0 && temperature.is_finite())
        {
            bail!(
                "sampling temperature {temperature}: use a finite temperature above 0, or greedy"
            );
        }
        Ok(Generation {
            spec,
            batch,
            tokens: Tensor::zeros(batch, DType::U32, device)?,
            out: Tensor::zeros((spec.max_tokens, batch), DType::U32, device)?,
            stopped: Tensor::zeros(batch, DType::U32, device)?,
            count: Tensor::zeros(1, DType::U32, device)?,
            flag: Tensor::zeros(1, DType::U32, device)?,
            rows: Tensor::arange(0u32, spec.max_tokens as u32, device)?
                .reshape((spec.max_tokens, 1))?,
        })
    }

    /// The tensors every launch reads and writes in place.
    pub fn statics(&self) -> [&Tensor; 5] {
        [
            &self.tokens,
            &self.out,
            &self.stopped,
            &self.count,
            &self.flag,
        ]
    }

    /// Starts a launch from `tokens` (`[batch]` u32): uploads between steps, never inside one.
    fn start(&self, tokens: &Tensor) -> Result<()> {
        let device = self.tokens.device();
        self.tokens.slice_set(&tokens.to_dtype(DType::U32)?, 0, 0)?;
        self.stopped
            .slice_set(&Tensor::zeros(self.batch, DType::U32, device)?, 0, 0)?;
        self.count
            .slice_set(&Tensor::zeros(1, DType::U32, device)?, 0, 0)?;
        self.flag
            .slice_set(&Tensor::ones(1, DType::U32, device)?, 0, 0)
    }

    /// Iterations the last launch ran and the tokens it produced (`[iterations, batch]`),
    /// read to the host.
    fn read(&self) -> Result<(usize, Vec<Vec<u32>>)> {
        let n = self.count.to_vec1::<u32>()?[0] as usize;
        let n = n.min(self.spec.max_tokens);
        Ok((n, self.out.i(..n)?.to_vec2::<u32>()?))
    }
}

/// Picks each row's next token from `logits` (`[batch, vocab]`).
fn sample(logits: &Tensor, sampling: Sampling, rng: Option<&DeviceRng>) -> Result<Tensor> {
    let (temperature, top_k) = match sampling {
        Sampling::Greedy => return argmax_last(logits),
        Sampling::Sample { temperature, top_k } => (temperature, top_k),
    };
    let Some(rng) = rng else {
        bail!("sampling needs a DeviceRng: pass one to generate, or sample greedily");
    };
    let scaled = (logits.to_dtype(DType::F32)? / f64::from(temperature))?;
    let vocab = scaled.dim(D::Minus1)?;
    let scaled = if top_k > 0 && top_k < vocab {
        let floor = Tensor::full(f32::NEG_INFINITY, scaled.shape(), scaled.device())?;
        // The k-th largest per row: drop the largest k - 1 times.
        let mut rest = scaled.clone();
        for _ in 1..top_k {
            let largest = rest.max_keepdim(D::Minus1)?;
            rest = rest.broadcast_ge(&largest)?.where_cond(&floor, &rest)?;
        }
        let kth = rest.max_keepdim(D::Minus1)?;
        scaled.broadcast_lt(&kth)?.where_cond(&floor, &scaled)?
    } else {
        scaled
    };
    // Gumbel-max: argmax(l + g), g = -ln(-ln u), draws from softmax(l).
    let u = rng.uniform(scaled.shape())?;
    let gumbel = u.log()?.neg()?.log()?.neg()?;
    argmax_last(&(scaled + gumbel)?)
}

impl Decoder {
    /// One iteration of a generation: a decode step of the current tokens, the next tokens
    /// picked, stopped sequences kept at `eos`, the tokens written at row `count` of the
    /// output, `count` advanced and the loop's flag set (0 once every sequence stopped or
    /// `max_tokens` ran). Everything in place, on the device.
    fn generate_step(
        &self,
        cache: &KvCache,
        g: &Generation,
        rng: Option<&DeviceRng>,
    ) -> Result<()> {
        let logits = self.logits(cache, &g.tokens)?;
        let mut next = sample(&logits, g.spec.sampling, rng)?;
        if let Some(eos) = g.spec.eos {
            let eos = Tensor::full(eos, g.batch, next.device())?;
            next = g.stopped.where_cond(&eos, &next)?;
            let stopped = next.eq(&eos)?.to_dtype(DType::U32)?.maximum(&g.stopped)?;
            g.stopped.slice_set(&stopped, 0, 0)?;
        }
        g.tokens.slice_set(&next, 0, 0)?;
        // Row `count` of the output takes the tokens (constants are made on the device:
        // a host scalar would be an upload, which a capture refuses).
        let k = g.spec.max_tokens;
        let here = g.rows.broadcast_eq(&g.count.reshape((1, 1))?)?;
        let out = here
            .broadcast_as((k, g.batch))?
            .where_cond(&next.unsqueeze(0)?.broadcast_as((k, g.batch))?, &g.out)?;
        g.out.slice_set(&out, 0, 0)?;
        let device = next.device();
        let count = (&g.count + Tensor::ones(1, DType::U32, device)?)?;
        g.count.slice_set(&count, 0, 0)?;
        let room = count
            .lt(&Tensor::full(k as u32, 1, device)?)?
            .to_dtype(DType::U32)?;
        let running = g
            .stopped
            .min_keepdim(0)?
            .eq(&Tensor::zeros(1, DType::U32, device)?)?
            .to_dtype(DType::U32)?;
        g.flag.slice_set(&(room * running)?, 0, 0)
    }

    /// Starts a launch from `tokens` (after checking that it fits in the cache) and returns
    /// its statics (the model's, the generation's, the generator's) and keys.
    fn launch<'a>(
        &'a self,
        cache: &'a KvCache,
        g: &'a Generation,
        rng: Option<&'a DeviceRng>,
        tokens: &Tensor,
    ) -> Result<(Vec<&'a Tensor>, [u64; 3])> {
        self.check_generation(cache, g)?;
        g.start(tokens)?;
        let mut statics = self.statics(cache);
        statics.extend(g.statics());
        statics.extend(rng.map(DeviceRng::state));
        Ok((
            statics,
            [g.batch as u64, self.key(), g.spec.max_tokens as u64],
        ))
    }

    /// Checks that every sequence of the batch has `max_tokens` positions left.
    fn check_generation(&self, cache: &KvCache, g: &Generation) -> Result<()> {
        cache.check_room(g.batch)?;
        let max_seq = cache.max_seq();
        if let Some(row) = cache.positions()[..g.batch]
            .iter()
            .position(|&p| p as usize + g.spec.max_tokens > max_seq)
        {
            bail!(
                "sequence {row} has fewer than {} positions left of {max_seq}: generate fewer tokens per launch, or make the cache longer",
                g.spec.max_tokens
            );
        }
        Ok(())
    }

    /// Generates up to `max_tokens` tokens per sequence in **one launch**: the decode step,
    /// sampling and the stopping rule run in a device loop (a CUDA conditional WHILE node)
    /// that ends when every sequence produced `eos` or `max_tokens` ran. `tokens` (`[batch]`
    /// u32) is each sequence's last token; `g` holds the device state (`g.statics()` are
    /// statics of the step, with the model's and, when sampling, `rng`'s). Returns the
    /// tokens of each iteration (`[iterations][batch]`; a stopped sequence repeats `eos`)
    /// and the step's outcome. One host read per launch.
    pub fn generate(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        g: &Generation,
        rng: Option<&DeviceRng>,
        tokens: &Tensor,
    ) -> std::result::Result<(Vec<Vec<u32>>, Step), Error> {
        let model = |source| Error::Model { source };
        let (statics, keys) = self.launch(cache, g, rng, tokens).map_err(model)?;
        let ran = graft.call_looping(step, &[], &statics, &keys, |_, loops| {
            loops.while_loop(&g.flag, || self.generate_step(cache, g, rng))?;
            Ok(Vec::new())
        })?;
        let (n, out) = g.read().map_err(model)?;
        (0..n).for_each(|_| cache.advance(g.batch));
        Ok((out, ran))
    }

    /// What a server runs today, for comparison with [`Decoder::generate`]: one launch per
    /// token (the same iteration as a step of its own), and a host read of the tokens and
    /// the flag after each. Draws the same tokens as `generate` from the same state.
    pub fn generate_per_step(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        g: &Generation,
        rng: Option<&DeviceRng>,
        tokens: &Tensor,
    ) -> std::result::Result<Vec<Vec<u32>>, Error> {
        let model = |source| Error::Model { source };
        let (statics, keys) = self.launch(cache, g, rng, tokens).map_err(model)?;
        let mut out = Vec::new();
        loop {
            graft.call(step, &[], &statics, &keys, |_| {
                self.generate_step(cache, g, rng)?;
                Ok(Vec::new())
            })?;
            cache.advance(g.batch);
            out.push(g.tokens.to_vec1::<u32>().map_err(model)?);
            if g.flag.to_vec1::<u32>().map_err(model)?[0] == 0 {
                return Ok(out);
            }
        }
    }
}

impl Decoder {
    /// `max_tokens` launches of one token each, with no host read between them: the device
    /// time of the steps (and their launches), the floor a device loop approaches. For
    /// benchmarks; nothing stops early and the tokens are not returned.
    pub fn generate_steps_unread(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        g: &Generation,
        rng: Option<&DeviceRng>,
        tokens: &Tensor,
    ) -> std::result::Result<(), Error> {
        let model = |source| Error::Model { source };
        let (statics, keys) = self.launch(cache, g, rng, tokens).map_err(model)?;
        for _ in 0..g.spec.max_tokens {
            graft.call(step, &[], &statics, &keys, |_| {
                self.generate_step(cache, g, rng)?;
                Ok(Vec::new())
            })?;
            cache.advance(g.batch);
        }
        Ok(())
    }
}
