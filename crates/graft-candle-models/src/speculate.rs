//! Speculative decoding, greedy: a drafter proposes the next tokens of a sequence
//! ([`prompt_lookup`]: the tokens that followed the latest earlier occurrence of its last
//! n-gram), and one verify pass of the model over the last token and the drafts
//! ([`Decoder::verify_greedy_forward`]) writes their keys and values, picks the model's token
//! after each, and keeps the longest prefix of drafts the model agrees with, plus the model's
//! own next token: from 1 to k + 1 tokens for one pass. The acceptance and the rollback (the
//! sequence's position advanced by the accepted count only, so the rejected drafts' keys and
//! values are masked and overwritten later) happen on the device, inside the one recording of
//! [`Decoder::verify_greedy`] per draft count; the host reads the tokens after it.
//!
//! Greedy output equals plain greedy decoding's wherever the verify pass's logits pick the
//! same tokens as the decode step's: the pass runs the prefill's kernels over k + 1 rows, the
//! decode step those of one row, so at a near tie in the logits the two may part (see the
//! batch-invariance decision in docs/architecture.md).

use candle_core::{D, DType, Result, Tensor};

use graft_candle::{CandleGraft, Error, StepId};

use super::cache::KvCache;
use super::decoder::Decoder;

/// What one verify pass gives: the model's token after each position (`[k + 1]` u32) and how
/// many drafts it accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The model's greedy token after the last token and after each draft.
    pub targets: Vec<u32>,
    /// Leading drafts equal to the model's tokens (0 to k).
    pub accepted: usize,
}

impl Verified {
    /// The tokens the pass decoded: the accepted drafts, then the model's next token.
    pub fn tokens(&self) -> &[u32] {
        &self.targets[..=self.accepted]
    }
}

impl Decoder {
    /// One verify pass of sequence `row` of a serving cache: `tokens` (`[k + 1]` u32) holds the
    /// sequence's last token (the one at its position, not yet in the cache) and k drafts of
    /// the tokens after it. Writes the keys and values of all k + 1 at the sequence's next
    /// positions, takes the model's greedy token after each, accepts the longest prefix of
    /// drafts equal to them, and advances the sequence's position by the accepted drafts plus
    /// one (on the device; the cache's host copy after reading the count): the next pass starts
    /// from [`Verified::tokens`]' last. Needs room for k + 1 positions.
    pub fn verify_greedy_forward(
        &self,
        cache: &KvCache,
        row: usize,
        tokens: &Tensor,
    ) -> Result<Verified> {
        let n = tokens.dims1()?;
        if n == 0 {
            candle_core::bail!(
                "verify_greedy_forward: no tokens; pass the sequence's last token and its drafts"
            );
        }
        cache.check_prefill(row, n, n)?;
        let meta = Tensor::new(&[row as u32, n as u32], self.device())?;
        let (targets, accepted) = self.verify_greedy_next(cache, tokens, &meta)?;
        let accepted = accepted.to_vec1::<u32>()?[0] as usize;
        cache.advance_row(row, accepted + 1);
        Ok(Verified {
            targets: targets.to_vec1()?,
            accepted,
        })
    }

    /// [`Decoder::verify_greedy_forward`] under graft: `tokens` and `[row, k + 1]` (u32) are the
    /// step's inputs, the weights and `cache` its statics, `[k + 1, key]` its keys: one
    /// recording per draft count serves every sequence, position and acceptance. The host
    /// reads the pass's tokens and count after the replay (and advances the cache's host copy
    /// of the position by them).
    pub fn verify_greedy(
        &self,
        graft: &mut CandleGraft,
        step: StepId,
        cache: &KvCache,
        row: usize,
        tokens: &Tensor,
    ) -> std::result::Result<Verified, Error> {
        let model = |source| Error::Model { source };
        let n = tokens.dims1().map_err(model)?;
        if n == 0 {
            return Err(model(candle_core::Error::Msg(
                "verify_greedy: no tokens; pass the sequence's last token and its drafts".into(),
            )));
        }
        cache.check_prefill(row, n, n).map_err(model)?;
        let meta = Tensor::new(&[row as u32, n as u32], self.device()).map_err(model)?;
        let statics = self.statics(cache);
        let out = graft.call(
            step,
            &[tokens, &meta],
            &statics,
            &[n as u64, self.key()],
            |inputs| {
                let (targets, accepted) = self.verify_greedy_next(cache, &inputs[0], &inputs[1])?;
                Ok(vec![targets, accepted])
            },
        )?;
        let read = |t: &Tensor| t.to_vec1::<u32>().map_err(model);
        let accepted = read(&out.outputs[1])?[0] as usize;
        cache.advance_row(row, accepted + 1);
        Ok(Verified {
            targets: read(&out.outputs[0])?,
            accepted,
        })
    }

    /// The verify pass itself (no host read: capturable): the model's token after each of
    /// `tokens` (`[k + 1]` u32) and the accepted count (`[1]` u32), the row's position advanced
    /// by it plus one. `meta` is `[row, k + 1]` u32.
    fn verify_greedy_next(
        &self,
        cache: &KvCache,
        tokens: &Tensor,
        meta: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let n = tokens.dims1()?;
        let plan = cache.prefill_plan(meta, n)?;
        let h = self.prefill_hidden(cache, tokens, &plan)?;
        let targets = self
            .lm_head
            .decode(&h)?
            .squeeze(1)?
            .to_dtype(DType::F32)?
            .argmax(D::Minus1)?;
        // Draft i (tokens[i + 1]) is accepted when it and every draft before it equal the
        // model's token after the position before it: the count of leading ones.
        let agree = tokens
            .narrow(0, 1, n - 1)?
            .eq(&targets.narrow(0, 0, n - 1)?)?
            .to_dtype(DType::U32)?;
        let accepted = leading_ones(&agree)?;
        cache.step_row(&plan, &(&accepted + 1.0)?)?;
        Ok((targets, accepted))
    }
}

/// The number of leading ones of `flags` (`[k]` u32 of 0 and 1), as `[1]` u32, on the device:
/// the sum of the running product, one element at a time (k is a few drafts), so that nothing
/// is uploaded from the host inside a recording.
fn leading_ones(flags: &Tensor) -> Result<Tensor> {
    let k = flags.dim(0)?;
    if k == 0 {
        return Tensor::zeros(1, DType::U32, flags.device());
    }
    let mut run = flags.narrow(0, 0, 1)?;
    let mut count = run.clone();
    for i in 1..k {
        run = (run * flags.narrow(0, i, 1)?)?;
        count = (count + &run)?;
    }
    Ok(count)
}

/// Up to `k` drafts for a sequence whose tokens so far are `history`: the tokens that followed
/// the latest earlier occurrence of its last `n`-gram, trying `n` from `max_ngram` down to 1
/// (prompt-lookup decoding). Empty when no n-gram recurs.
pub fn prompt_lookup(history: &[u32], max_ngram: usize, k: usize) -> Vec<u32> {
    for n in (1..=max_ngram.min(history.len().saturating_sub(1))).rev() {
        let tail = &history[history.len() - n..];
        // Latest start of an earlier occurrence, with at least one token after it.
        let found = (0..history.len() - n)
            .rev()
            .find(|&i| &history[i..i + n] == tail);
        if let Some(i) = found {
            let from = i + n;
            return history[from..(from + k).min(history.len())].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_follows_the_latest_longest_match() {
        // The last 2-gram (3, 4) occurred at 2 and at 6; the latest, at 6, is followed by 9.
        let h = [1, 2, 3, 4, 5, 6, 3, 4, 9, 3, 4];
        assert_eq!(prompt_lookup(&h, 3, 2), [9, 3]);
        // Only a 1-gram recurs: 7 followed by 8.
        assert_eq!(prompt_lookup(&[7, 8, 1, 7], 3, 4), [8, 1, 7]);
        assert!(prompt_lookup(&[1, 2, 3], 2, 4).is_empty());
        assert!(prompt_lookup(&[], 2, 4).is_empty());
        assert!(prompt_lookup(&[5], 2, 4).is_empty());
    }

    #[test]
    fn leading_ones_counts_the_prefix() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        for (flags, want) in [
            (vec![1u32, 1, 0, 1], 2u32),
            (vec![0, 1, 1], 0),
            (vec![1, 1, 1], 3),
            (vec![], 0),
        ] {
            let t = Tensor::from_vec(flags.clone(), flags.len(), &dev)?;
            assert_eq!(leading_ones(&t)?.to_vec1::<u32>()?, [want], "{flags:?}");
        }
        Ok(())
    }
}
