//! The one-shot all-reduce on the host: what the kernel computes, bit for bit (every element
//! summed over ranks in rank order in f32, the first rank's value taken as it is, then
//! rounded once to the dtype: bf16 by round-to-nearest-even on the bits, f16 as PTX's
//! `cvt.rn.f16.f32`). The GPU tests' oracle; NaN payloads are not modelled.

use graft_core::DeviceError;

use super::super::NcclDtype;
use super::super::status::OP;

/// The sum over ranks of `parts` (each rank's message as little-endian bytes of `dtype`, all
/// of one length, a whole number of elements), in rank order, as the kernel writes it.
pub fn one_shot_sum(dtype: NcclDtype, parts: &[&[u8]]) -> Result<Vec<u8>, DeviceError> {
    let size = dtype.size();
    let Some(first) = parts.first() else {
        return Ok(Vec::new());
    };
    let len = first.len();
    if parts.iter().any(|p| p.len() != len) || !len.is_multiple_of(size) {
        return Err(DeviceError::InvalidArgument {
            op: OP,
            what: "the ranks' parts differ in length or are not whole elements; give every rank the same number of elements",
        });
    }
    let mut out = Vec::with_capacity(len);
    for at in (0..len).step_by(size) {
        let mut acc = 0.0f32;
        for (p, part) in parts.iter().enumerate() {
            let f = to_f32(dtype, &part[at..at + size]);
            acc = if p == 0 { f } else { acc + f };
        }
        from_f32(dtype, acc, &mut out);
    }
    Ok(out)
}

/// One element of `dtype` from its little-endian bytes, as f32 (exact).
fn to_f32(dtype: NcclDtype, b: &[u8]) -> f32 {
    match dtype {
        NcclDtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        NcclDtype::Bf16 => f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
        NcclDtype::F16 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
    }
}

/// `x` rounded once to `dtype`, appended as little-endian bytes.
fn from_f32(dtype: NcclDtype, x: f32, out: &mut Vec<u8>) {
    match dtype {
        NcclDtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
        NcclDtype::Bf16 => out.extend_from_slice(&bf16_bits(x).to_le_bytes()),
        NcclDtype::F16 => out.extend_from_slice(&f16_bits(x).to_le_bytes()),
    }
}

/// f32 to bf16 bits, round to nearest even (a NaN stays a quiet NaN), as the kernel's
/// `os_from<OsBf16>`.
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// f16 bits to f32 (exact).
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        // Subnormal: man * 2^-24.
        (0, _) => {
            let v = man as f32 * f32::powi(2.0, -24);
            return if sign == 0 { v } else { -v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// f32 to f16 bits, round to nearest even, overflow to infinity, subnormals kept (PTX's
/// `cvt.rn.f16.f32`).
pub(crate) fn f16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    let sign = ((u >> 16) & 0x8000) as u16;
    let abs = u & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return sign | 0x7e00;
    }
    if abs >= 0x4780_0000 {
        // 65,536 or more (or infinity): beyond the largest f16 even after rounding.
        return sign | 0x7c00;
    }
    let exp = (abs >> 23) as i32 - 127;
    if exp >= -14 {
        // Normal in f16: 10 of the 23 mantissa bits, rounded to nearest even; a carry may
        // step into the exponent (up to infinity), which the bit layout does by itself.
        let half = (((exp + 15) as u32) << 10) | ((abs >> 13) & 0x3ff);
        let rest = abs & 0x1fff;
        let up = rest > 0x1000 || (rest == 0x1000 && half & 1 == 1);
        return sign | (half + u32::from(up)) as u16;
    }
    if exp < -25 {
        // Below half the smallest subnormal (2^-25): zero.
        return sign;
    }
    // Subnormal in f16: the value in units of 2^-24, rounded to nearest even.
    let man = (abs & 0x7f_ffff) | 0x80_0000;
    let shift = (-exp - 1) as u32; // 14..=24: man * 2^(exp - 23) / 2^-24 = man >> (-1 - exp)
    let units = man >> shift;
    let rest = man & ((1 << shift) - 1);
    let halfway = 1 << (shift - 1);
    let up = rest > halfway || (rest == halfway && units & 1 == 1);
    sign | (units + u32::from(up)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn f32_sums_in_rank_order_starting_from_the_first_rank() {
        let a = bytes_f32(&[1.0, -0.0, 1e8, 0.1]);
        let b = bytes_f32(&[2.0, -0.0, 1.0, 0.2]);
        let c = bytes_f32(&[3.0, -0.0, -1e8, 0.3]);
        let sum = one_shot_sum(NcclDtype::F32, &[&a, &b, &c]).unwrap();
        let want = bytes_f32(&[6.0, -0.0, (1e8f32 + 1.0) - 1e8, (0.1f32 + 0.2) + 0.3]);
        assert_eq!(sum, want, "-0 + -0 stays -0; the order is 0, 1, 2");
    }

    #[test]
    fn bf16_rounds_once_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: even is 1.
        assert_eq!(bf16_bits(1.0 + f32::powi(2.0, -8)), 0x3f80);
        assert_eq!(bf16_bits(1.0 + 3.0 * f32::powi(2.0, -8)), 0x3f82);
        assert_eq!(bf16_bits(-2.5), 0xc020);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
        // Two bf16 values summed in f32, then rounded once.
        let p = |v: f32| bf16_bits(v).to_le_bytes().to_vec();
        let sum = one_shot_sum(NcclDtype::Bf16, &[&p(1.0), &p(f32::powi(2.0, -8))]).unwrap();
        assert_eq!(sum, p(1.0));
    }

    #[test]
    fn f16_converts_as_ptx_does() {
        assert_eq!(f16_bits(1.0), 0x3c00);
        assert_eq!(f16_bits(-2.0), 0xc000);
        assert_eq!(f16_bits(65504.0), 0x7bff);
        assert_eq!(
            f16_bits(65520.0),
            0x7c00,
            "halfway to 65,536 rounds to even: infinity"
        );
        assert_eq!(f16_bits(65519.0), 0x7bff);
        assert_eq!(
            f16_bits(f32::powi(2.0, -24)),
            0x0001,
            "the smallest subnormal"
        );
        assert_eq!(
            f16_bits(f32::powi(2.0, -25)),
            0x0000,
            "halfway to it rounds to even: 0"
        );
        assert_eq!(
            f16_bits(1.5 * f32::powi(2.0, -24)),
            0x0002,
            "1.5 units rounds to even: 2"
        );
        assert_eq!(f16_bits(f32::powi(2.0, -14)), 0x0400, "the smallest normal");
        assert_eq!(
            f16_bits(1.0 + f32::powi(2.0, -11)),
            0x3c00,
            "halfway rounds to even"
        );
        assert_eq!(f16_bits(1.0 + 3.0 * f32::powi(2.0, -11)), 0x3c02);
        assert_eq!(f16_bits(-0.0), 0x8000);
        assert_eq!(f16_bits(f32::NEG_INFINITY), 0xfc00);
        // Every f16 converts to f32 and back unchanged.
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if !f.is_nan() {
                assert_eq!(f16_bits(f), h, "{h:#06x} -> {f}");
            }
        }
    }

    #[test]
    fn parts_of_different_lengths_are_refused() {
        let a = [0u8; 4];
        let b = [0u8; 8];
        assert!(one_shot_sum(NcclDtype::F32, &[&a, &b]).is_err());
        assert!(one_shot_sum(NcclDtype::Bf16, &[&a[..3]]).is_err());
        assert_eq!(one_shot_sum(NcclDtype::F16, &[]), Ok(Vec::new()));
    }
}
