//! prefill_attention against decode_attention: queries in runs of sequences' consecutive
//! positions (several sequences, a padding query, runs across tiles) give decode_attention's
//! result within the rounding of its softmax weights to the dtype; each query's result is the
//! same alone as in its tile, and a paged cache gives the static cache's bits.

use candle_core::{DType, Device, Result, Tensor};
use graft_candle_kernels::{decode_attention, prefill_attention, prefill_attention_paged};
use proptest::prelude::*;

use super::{assert_close, bits, paginate, random, tables};

/// One prefill-attention case: `runs` sequences of (start position, queries) in rows 0, 1,
/// ... of a cache of `max_seq` positions, and a padding query at position 0 of the last row.
#[derive(Debug, Clone)]
pub struct PrefillCase {
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    pub max_seq: usize,
    pub runs: Vec<(usize, usize)>,
    pub window: Option<usize>,
    pub seed: u64,
}

pub fn prefill_cases() -> impl Strategy<Value = PrefillCase> {
    (
        1usize..=2,
        // 1 to 16 queries a tile; 12 does not divide the 64 rows (the decode kernel runs).
        prop_oneof![Just(1usize), Just(4), Just(8), Just(12), Just(16)],
        // 40: not a multiple of 16 (the decode kernel runs).
        prop_oneof![Just(16usize), Just(40), Just(64), Just(128)],
        prop::collection::vec((0usize..300, 1usize..=90), 1..=3),
        prop_oneof![Just(None), Just(Some(5usize)), Just(Some(70))],
        any::<u64>(),
    )
        .prop_map(|(kv_heads, group, head_dim, runs, window, seed)| {
            let max_seq = runs.iter().map(|(s, n)| s + n).max().unwrap_or(1) + 7;
            PrefillCase {
                kv_heads,
                group,
                head_dim,
                max_seq,
                runs,
                window,
                seed,
            }
        })
}

/// A case's queries and caches (`[n, heads, 1, hd]`, `[rows, kv, max_seq, hd]` twice), and
/// each query's position and row.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Vec<u32>,
    rows: Vec<u32>,
}

fn inputs(c: &PrefillCase, dtype: DType, device: &Device) -> Result<Inputs> {
    let mut positions = Vec::new();
    let mut rows = Vec::new();
    for (row, &(start, n)) in c.runs.iter().enumerate() {
        positions.extend((start..start + n).map(|p| p as u32));
        rows.extend(std::iter::repeat_n(row as u32, n));
    }
    // A padding query in a row of its own (a prefill's scratch row).
    let scratch = c.runs.len();
    positions.push(0);
    rows.push(scratch as u32);
    let heads = c.kv_heads * c.group;
    let q = random(
        c.seed,
        &[positions.len(), heads, 1, c.head_dim],
        2.0,
        dtype,
        device,
    )?;
    let shape = [scratch + 1, c.kv_heads, c.max_seq, c.head_dim];
    let k = random(c.seed ^ 1, &shape, 1.0, dtype, device)?;
    let v = random(c.seed ^ 2, &shape, 1.0, dtype, device)?;
    Ok(Inputs {
        q,
        k,
        v,
        positions,
        rows,
    })
}

/// The checks of one case in `dtype`.
pub fn check_prefill_attention(device: &Device, c: &PrefillCase, dtype: DType) -> Result<()> {
    let Inputs {
        q,
        k,
        v,
        positions,
        rows,
    } = inputs(c, dtype, device)?;
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let pos = Tensor::new(positions.as_slice(), device)?;
    let rows_t = Tensor::new(rows.as_slice(), device)?;
    let want = decode_attention(&q, &k, &v, &pos, Some(&rows_t), scale, c.window)?;
    let got = prefill_attention(&q, &k, &v, &pos, &rows_t, scale, c.window)?;
    // The softmax weights rounded to the dtype (about 3 significant digits in bf16).
    let tol = match dtype {
        DType::F32 => (1e-5, 1e-5),
        _ => (2e-2, 2e-2),
    };
    assert_close("prefill_attention", &got, &want, tol)?;

    // Each query alone gives its bits in the tile.
    let n = positions.len();
    for i in [0, n / 2, n - 1] {
        let one = |t: &Tensor| t.narrow(0, i, 1);
        let alone = prefill_attention(
            &one(&q)?,
            &k,
            &v,
            &one(&pos)?,
            &one(&rows_t)?,
            scale,
            c.window,
        )?;
        assert!(
            bits(&alone)? == bits(&one(&got)?)?,
            "query {i} alone differs from its result in the tile"
        );
    }

    // Paged: each row's positions in shuffled blocks of 16, NaN elsewhere.
    let block_size = 16;
    let per = c.max_seq.div_ceil(block_size);
    let sequences = c.runs.len() + 1;
    let blocks = sequences * per + 3;
    let table = tables(c.seed, sequences, per, blocks);
    let own: Vec<usize> = (0..sequences).collect();
    let paginate = |cache: &Tensor| paginate(cache, &own, &table, blocks, block_size);
    let query_tables: Vec<u32> = rows
        .iter()
        .flat_map(|&r| table[r as usize].iter().copied())
        .collect();
    let query_tables = Tensor::from_vec(query_tables, (n, per), device)?;
    let paged = prefill_attention_paged(
        &q,
        &paginate(&k)?,
        &paginate(&v)?,
        &pos,
        &query_tables,
        scale,
        c.window,
    )?;
    assert!(
        bits(&paged)? == bits(&got)?,
        "paged prefill attention differs from the static cache's"
    );
    Ok(())
}
