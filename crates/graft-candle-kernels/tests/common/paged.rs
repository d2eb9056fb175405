//! Paged caches against static ones: the same keys and values laid out in shuffled blocks give
//! the same attention and the same cache writes, bit for bit, on every backend.

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use graft_candle_kernels::{
    RopeStyle, decode_attention, decode_attention_paged, rope_store, rope_store_paged,
};

use super::{AttentionCase, attention_inputs, bits, case_rows, random, values};

/// Block tables for `batch` sequences of `per` blocks each, drawn without repeats from
/// `0..blocks` in an order shuffled by `seed` (so neighbours in a sequence are not neighbours
/// in the cache).
pub fn tables(seed: u64, batch: usize, per: usize, blocks: usize) -> Vec<Vec<u32>> {
    let mut ids: Vec<u32> = (0..blocks as u32).collect();
    let keys = values(seed, blocks, 1.0);
    ids.sort_by(|&a, &b| keys[a as usize].total_cmp(&keys[b as usize]));
    ids.chunks(per).take(batch).map(<[u32]>::to_vec).collect()
}

/// `cache` (`[rows, kv_heads, max_seq, head_dim]`) as `[blocks, kv_heads, block_size,
/// head_dim]` pages: positions `i * block_size..` of sequence b's row `rows[b]` in block
/// `table[b][i]`; every other place (blocks no table names, the end of a last block) NaN, so
/// that a read of one shows.
pub fn paginate(
    cache: &Tensor,
    rows: &[usize],
    table: &[Vec<u32>],
    blocks: usize,
    block_size: usize,
) -> Result<Tensor> {
    let (_, kv, max_seq, hd) = cache.dims4()?;
    let nan =
        Tensor::full(f32::NAN, (kv, block_size, hd), cache.device())?.to_dtype(cache.dtype())?;
    let mut pages = vec![nan.clone(); blocks];
    for (b, ids) in table.iter().enumerate() {
        for (i, &id) in ids.iter().enumerate() {
            let from = i * block_size;
            let len = block_size.min(max_seq.saturating_sub(from));
            if len == 0 {
                continue;
            }
            let part = cache.i(rows[b])?.narrow(1, from, len)?;
            pages[id as usize] = if len < block_size {
                Tensor::cat(&[&part, &nan.narrow(1, len, block_size - len)?], 1)?
            } else {
                part
            };
        }
    }
    Tensor::stack(&pages, 0)?.contiguous()
}

/// decode_attention_paged over a case's caches cut into blocks of `block_size` equals
/// decode_attention over the static caches, bit for bit.
pub fn check_paged_attention(
    device: &Device,
    case: &AttentionCase,
    dtype: DType,
    block_size: usize,
) -> Result<()> {
    let (q, k, v) = attention_inputs(case, dtype, device, false)?;
    let positions = Tensor::new(case.positions.as_slice(), device)?;
    let scale = 1.0 / (case.head_dim as f32).sqrt();
    let rows = case_rows(case);
    let rows_t = rows
        .as_ref()
        .map(|r| Tensor::new(r.as_slice(), device))
        .transpose()?;
    let want = decode_attention(&q, &k, &v, &positions, rows_t.as_ref(), scale, case.window)?;

    let per = case.max_seq.div_ceil(block_size);
    let blocks = case.batch * per + 3;
    let table = tables(case.seed, case.batch, per, blocks);
    let rows: Vec<usize> = match rows {
        Some(r) => r.iter().map(|&r| r as usize).collect(),
        None => (0..case.batch).collect(),
    };
    let k_pages = paginate(&k, &rows, &table, blocks, block_size)?;
    let v_pages = paginate(&v, &rows, &table, blocks, block_size)?;
    let flat: Vec<u32> = table.concat();
    let table = Tensor::from_vec(flat, (case.batch, per), device)?;
    let got = decode_attention_paged(
        &q,
        &k_pages,
        &v_pages,
        &positions,
        &table,
        scale,
        case.window,
    )?;
    assert!(
        bits(&got)? == bits(&want)?,
        "paged attention differs from the static cache's (block size {block_size})"
    );
    Ok(())
}

/// rope_store_paged writes each token's key and value where its block table says, and returns
/// the queries rope_store returns, bit for bit; nothing else in the pages changes.
pub fn check_paged_rope_store(device: &Device, dtype: DType) -> Result<()> {
    let (batch, kv, group, hd, max_seq, block_size) = (3, 2, 2, 16, 20, 8);
    let heads = kv * group;
    let qkv = random(11, &[batch, (heads + 2 * kv) * hd], 2.0, dtype, device)?;
    let cos = random(12, &[max_seq, hd / 2], 1.0, dtype, device)?;
    let sin = random(13, &[max_seq, hd / 2], 1.0, dtype, device)?;
    let positions = [0u32, 9, 19];
    let positions_t = Tensor::new(&positions[..], device)?;
    let zeros = |shape: (usize, usize, usize, usize)| Tensor::zeros(shape, dtype, device);
    let (k, v) = (
        zeros((batch, kv, max_seq, hd))?,
        zeros((batch, kv, max_seq, hd))?,
    );
    let want = rope_store(
        &qkv,
        &cos,
        &sin,
        &positions_t,
        None,
        (&k, &v),
        heads,
        RopeStyle::Half,
        None,
    )?;
    let per = max_seq.div_ceil(block_size);
    let blocks = batch * per + 3;
    let table = tables(5, batch, per, blocks);
    let (kp, vp) = (
        zeros((blocks, kv, block_size, hd))?,
        zeros((blocks, kv, block_size, hd))?,
    );
    let table_t = Tensor::from_vec(table.concat(), (batch, per), device)?;
    let got = rope_store_paged(
        &qkv,
        &cos,
        &sin,
        &positions_t,
        &table_t,
        (&kp, &vp),
        heads,
        RopeStyle::Half,
        None,
    )?;
    assert!(
        bits(&got)? == bits(&want)?,
        "paged rope_store's queries differ"
    );
    for (stat, paged, what) in [(&k, &kp, "keys"), (&v, &vp, "values")] {
        let mut written = 0;
        for (b, &p) in positions.iter().enumerate() {
            let p = p as usize;
            let want = stat.i((b, .., p))?;
            let got = paged.i((table[b][p / block_size] as usize, .., p % block_size))?;
            assert!(
                bits(&got)? == bits(&want)?,
                "{what} of token {b} are not where its table says"
            );
            written += bits(&want)?.iter().filter(|&&x| x != 0).count();
        }
        let nonzero = bits(paged)?.iter().filter(|&&x| x != 0).count();
        assert_eq!(
            nonzero, written,
            "{what}: the pages changed outside the tokens' places"
        );
    }
    Ok(())
}

/// The paged ops' refusals (CPU: the kernels clamp instead): a table naming a block past the
/// cache, a table of the wrong shape.
pub fn check_paged_refusals(device: &Device) -> Result<()> {
    let q = Tensor::zeros((2, 4, 1, 16), DType::F32, device)?;
    let pages = Tensor::zeros((3, 2, 8, 16), DType::F32, device)?;
    let positions = Tensor::new(&[3u32, 9], device)?;
    let past = Tensor::new(&[[0u32, 1], [2, 7]], device)?;
    let err = decode_attention_paged(&q, &pages, &pages, &positions, &past, 0.25, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("sequence 1's block table names block 7, but the cache has 3 blocks"),
        "{err}"
    );
    let flat = Tensor::new(&[0u32, 1], device)?;
    let err = decode_attention_paged(&q, &pages, &pages, &positions, &flat, 0.25, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("block table"), "{err}");
    Ok(())
}
