//! `combine`: the verdict of a complete round, the same on every rank and for every transport.

use super::{Ballot, GroupError, Verdict};

/// The verdict of a complete round (one ballot per rank, in rank order, at least one): an
/// error if the ranks record different things, else the worst vote with the lowest rank that
/// cast it.
pub(super) fn combine(ballots: &[Ballot]) -> Result<Verdict, GroupError> {
    let first = ballots[0].subject;
    if let Some(other) = ballots.iter().position(|b| b.subject != first) {
        let theirs = ballots[other].subject;
        return Err(GroupError::Diverged {
            rank: 0,
            function: first.0,
            shape: first.1,
            other,
            other_function: theirs.0,
            other_shape: theirs.1,
        });
    }
    let (rank, worst) = ballots
        .iter()
        .enumerate()
        .max_by(|(ra, a), (rb, b)| a.vote.cmp(&b.vote).then(rb.cmp(ra)))
        .expect("a complete round has one ballot per rank, and a group at least one rank");
    Ok(Verdict {
        vote: worst.vote,
        rank,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::Vote;
    use proptest::prelude::*;

    fn vote_of(i: u8) -> Vote {
        [Vote::Recorded, Vote::FellBack, Vote::Failed][usize::from(i % 3)]
    }

    proptest! {
        // Against the obvious oracle: the worst vote, first rank to cast it; any differing
        // subject is a divergence naming the first rank that differs.
        #[test]
        fn combine_matches_the_oracle(votes in proptest::collection::vec((0u8..3, 0u64..2), 1..8)) {
            let ballots: Vec<Ballot> = votes
                .iter()
                .map(|&(v, s)| Ballot { vote: vote_of(v), subject: (0, s) })
                .collect();
            let got = combine(&ballots);
            match ballots.iter().position(|b| b.subject != ballots[0].subject) {
                Some(other) => {
                    let named = matches!(got, Err(GroupError::Diverged { other: o, .. }) if o == other);
                    prop_assert!(named, "{:?}", got);
                }
                None => {
                    let worst = ballots.iter().map(|b| b.vote).max().unwrap();
                    let rank = ballots.iter().position(|b| b.vote == worst).unwrap();
                    prop_assert_eq!(got, Ok(Verdict { vote: worst, rank }));
                }
            }
        }
    }
}
