//! Block-wise quantized values on the wire (ZeRO++'s qwZ, torchao's float8 all-gather): a
//! buffer is cut into blocks of `block` values, each block sends one `f32` scale and its
//! values as 8-bit codes packed four to a 32-bit element, so that the lanes, whose buffers
//! are `f32` words, move about a quarter of the bytes of `f32` values.
//!
//! Layout of `n` values: one scale word per block, then `ceil(n / 4)` code words (code
//! `4i + j` in byte `j` of word `i`, little end first; the last word padded with zeros).
//! Blocks are `block` values from the start, or, cut into segments (the tensors of a flat
//! buffer, [`pack_cut`]), from each segment's start, so no block spans two segments.
//! The scale maps the block's largest magnitude `amax` onto the code's largest value: 127
//! for `int8` (symmetric, code `x / scale` rounded to nearest, ties to even), 448 for `fp8` e4m3 (code the e4m3 value
//! nearest `x / scale`). A block of zeros has scale 0 and decodes to zeros.
//!
//! A gather moves the packed words bit for bit, so every rank decodes the same values.
//!
//! Invariants:
//! - QUANT-1: [`words`] is the packed length; [`pack`] then [`unpack`] gives each value
//!   within half a code step of it: `|x - y| <= amax / 254` for `int8`, and for `fp8`
//!   within `2^-4` of `|x|` relative (e4m3's 3 significand bits, round to nearest) or
//!   `amax / 448 * 2^-10` absolute (its subnormals), whichever is larger.
//! - QUANT-2: [`e4m3_encode`] is round-to-nearest, ties to even, saturating at +-448 (as
//!   torch's `float8_e4m3fn` with saturation), and [`e4m3_decode`] is exact; every code but
//!   the two NaNs (`0x7f`, `0xff`) round-trips.
//! - QUANT-3: non-finite inputs are not quantizable: [`pack`] reports the first one's index
//!   instead of sending a value the others cannot decode.
//! - QUANT-4: packing is idempotent on its own output: packing the decoded values again
//!   gives the same words, so a rank that holds decoded values and one that holds the
//!   masters compute with the same values.

/// The 8-bit code of a quantized gather.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Symmetric 8-bit integers, `[-127, 127]`.
    Int8,
    /// OCP fp8 e4m3 (`float8_e4m3fn`): 4 exponent bits, 3 significand bits, max 448.
    Fp8,
}

impl Code {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Code::Int8 => "int8",
            Code::Fp8 => "fp8",
        }
    }

    /// The largest code value a block's `amax` maps to.
    fn max(self) -> f32 {
        match self {
            Code::Int8 => 127.0,
            Code::Fp8 => 448.0,
        }
    }

    #[inline]
    fn encode(self, x: f32) -> u8 {
        match self {
            // Round to nearest, ties to even, by adding and taking away 1.5 * 2^23 (exact
            // for |x| < 2^22; `x` is within +-127 here, a hair over at most): plain f32
            // arithmetic that vectorises, where `round` is a library call per element.
            Code::Int8 => (((x + ROUND) - ROUND).clamp(-127.0, 127.0) as i8) as u8,
            Code::Fp8 => e4m3_encode(x),
        }
    }

    #[inline]
    fn decode(self, c: u8) -> f32 {
        match self {
            Code::Int8 => f32::from(c as i8),
            Code::Fp8 => e4m3_decode(c),
        }
    }
}

/// 1.5 * 2^23: `(x + ROUND) - ROUND` is `x` rounded to an integer, ties to even, for
/// `|x| < 2^22`.
const ROUND: f32 = 12_582_912.0;

/// Words needed for `n` values in blocks of `block` (QUANT-1).
pub fn words(n: usize, block: usize) -> usize {
    words_cut(&[n], block)
}

/// Words needed for values cut into segments of `cuts` lengths, each in blocks of `block`
/// from its own start (QUANT-1).
pub fn words_cut(cuts: &[usize], block: usize) -> usize {
    let block = block.max(1);
    cuts.iter().map(|c| c.div_ceil(block)).sum::<usize>() + cuts.iter().sum::<usize>().div_ceil(4)
}

/// The blocks of segments `cuts` as ranges of the values: every `block` values from each
/// segment's start, so that no block spans two segments.
fn blocks(cuts: &[usize], block: usize) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let block = block.max(1);
    cuts.iter()
        .scan(0usize, |at, &len| {
            let s = *at;
            *at += len;
            Some((s, len))
        })
        .flat_map(move |(s, len)| {
            (0..len.div_ceil(block)).map(move |b| s + b * block..s + ((b + 1) * block).min(len))
        })
}

/// Quantizes `src` into `dst` (`words(src.len(), block)` long), block by block (QUANT-1);
/// the index of the first non-finite value is the error (QUANT-3).
///
/// Panics when the lengths disagree (a caller's broken invariant).
pub fn pack(code: Code, block: usize, src: &[f32], dst: &mut [f32]) -> Result<(), usize> {
    pack_cut(code, block, &[src.len()], src, dst)
}

/// [`pack`] with the values cut into segments of `cuts` lengths (tensors of a flat buffer):
/// blocks restart at each segment, so a small tensor never shares a scale with a large one.
///
/// Panics when the lengths disagree (a caller's broken invariant).
pub fn pack_cut(
    code: Code,
    block: usize,
    cuts: &[usize],
    src: &[f32],
    dst: &mut [f32],
) -> Result<(), usize> {
    assert_eq!(cuts.iter().sum::<usize>(), src.len(), "pack: segments of {} values", src.len());
    assert_eq!(dst.len(), words_cut(cuts, block), "pack: {} values", src.len());
    if let Some(i) = src.iter().position(|x| !x.is_finite()) {
        return Err(i);
    }
    let nb = dst.len() - src.len().div_ceil(4);
    let (scales, codes) = dst.split_at_mut(nb);
    let mut bytes = vec![0u8; codes.len() * 4];
    for (r, scale) in blocks(cuts, block).zip(scales.iter_mut()) {
        let xs = &src[r.clone()];
        let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        // QUANT-4: the decoded block's largest value is `max * scale` rounded, and the
        // quotient `amax / max` rounded is what that gives back (checked over 20,000 scales).
        *scale = amax / code.max();
        if *scale > 0.0 {
            let inv = 1.0 / *scale;
            for (o, &x) in bytes[r].iter_mut().zip(xs) {
                *o = code.encode(x * inv);
            }
        }
    }
    for (w, q) in codes.iter_mut().zip(bytes.chunks_exact(4)) {
        *w = f32::from_bits(u32::from_le_bytes([q[0], q[1], q[2], q[3]]));
    }
    Ok(())
}

/// Decodes `n = dst.len()` values packed by [`pack`] with the same `code` and `block`.
///
/// Panics when the lengths disagree (a caller's broken invariant).
pub fn unpack(code: Code, block: usize, src: &[f32], dst: &mut [f32]) {
    let n = dst.len();
    unpack_cut(code, block, &[n], src, dst)
}

/// Decodes values packed by [`pack_cut`] with the same `code`, `block` and `cuts`.
///
/// Panics when the lengths disagree (a caller's broken invariant).
pub fn unpack_cut(code: Code, block: usize, cuts: &[usize], src: &[f32], dst: &mut [f32]) {
    assert_eq!(cuts.iter().sum::<usize>(), dst.len(), "unpack: segments of {} values", dst.len());
    assert_eq!(src.len(), words_cut(cuts, block), "unpack: {} values", dst.len());
    let nb = src.len() - dst.len().div_ceil(4);
    let (scales, codes) = src.split_at(nb);
    // Every code is a byte of `codes`, read little end first: the same on every host. A
    // table of the 256 codes' values keeps the loop free of branches; the bytes are laid
    // out once first (reading each from its word in the loop measured slower: 2.9 against
    // 2.3 ms of conversion per gpt step).
    let bytes: Vec<u8> = codes.iter().flat_map(|w| w.to_bits().to_le_bytes()).collect();
    let table: [f32; 256] = std::array::from_fn(|c| code.decode(c as u8));
    for (r, &sc) in blocks(cuts, block).zip(scales) {
        for (o, &c) in dst[r.clone()].iter_mut().zip(&bytes[r]) {
            *o = table[usize::from(c)] * sc;
        }
    }
}

/// `x` as the nearest e4m3 code, ties to even, saturating at +-448 (QUANT-2). `x` is finite.
#[inline]
pub fn e4m3_encode(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs().min(448.0);
    if a < 2f32.powi(-6) {
        // Subnormals: `m * 2^-9`, `m` in 0..=8 (8 is the smallest normal, code 0x08); the
        // scaling by 2^9 is exact.
        return sign | ((a * 512.0 + ROUND) - ROUND) as u8;
    }
    // Normal: round f32's 23 significand bits to 3, ties to even; a carry moves into the
    // exponent, as it should. `a <= 448` keeps the result at most 0x7e.
    let b = a.to_bits();
    let r = (b + 0x7_ffff + ((b >> 20) & 1)) >> 20;
    // f32's exponent bias 127 against e4m3's 7.
    sign | (r - (120 << 3)) as u8
}

/// The value of e4m3 code `c` (exact; the NaN codes `0x7f`, `0xff` decode to NaN).
#[inline]
pub fn e4m3_decode(c: u8) -> f32 {
    let (e, m) = (u32::from((c >> 3) & 0x0f), u32::from(c & 0x07));
    let v = if e == 0x0f && m == 0x07 {
        f32::NAN
    } else if e == 0 {
        m as f32 * 2f32.powi(-9)
    } else {
        f32::from_bits(((e + 120) << 23) | (m << 20))
    };
    if c & 0x80 != 0 {
        -v
    } else {
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        // A spread of magnitudes and signs, deterministic.
        (0..n)
            .map(|i| {
                let t = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) as f32 / 4.3e9;
                (t - 0.5) * 10f32.powi((i % 5) as i32 - 2)
            })
            .collect()
    }

    #[test]
    fn packed_values_are_within_half_a_step_quant_1() {
        for code in [Code::Int8, Code::Fp8] {
            for (n, block) in [(0, 256), (1, 256), (5, 4), (257, 256), (1000, 64), (999, 1)] {
                let x = values(n, n as u32 + block as u32);
                let mut packed = vec![0.0; words(n, block)];
                pack(code, block, &x, &mut packed).unwrap();
                let mut y = vec![f32::NAN; n];
                unpack(code, block, &packed, &mut y);
                for (b, (xs, ys)) in x.chunks(block).zip(y.chunks(block)).enumerate() {
                    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    for (xv, yv) in xs.iter().zip(ys) {
                        let err = (xv - yv).abs();
                        let bound = match code {
                            Code::Int8 => amax / 254.0 * (1.0 + 1e-5),
                            Code::Fp8 => (xv.abs() / 16.0).max(amax / 448.0 / 1024.0) * 1.0001,
                        };
                        assert!(err <= bound, "{code:?} n {n} block {b}: {xv} -> {yv}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_block_amax_is_exact_and_zero_blocks_stay_zero_quant_1() {
        let x = [0.0, 0.0, 0.0, 3.0, -1.5, 0.25];
        for code in [Code::Int8, Code::Fp8] {
            let mut p = vec![0.0; words(6, 3)];
            pack(code, 3, &x, &mut p).unwrap();
            let mut y = [9.0f32; 6];
            unpack(code, 3, &p, &mut y);
            assert_eq!(&y[..3], &[0.0; 3], "{code:?}");
            assert_eq!(y[3], 3.0, "{code:?}: amax maps to the largest code exactly");
        }
    }

    #[test]
    fn packing_decoded_values_gives_the_same_words_quant_4() {
        for code in [Code::Int8, Code::Fp8] {
            for seed in 0..200u32 {
                let n = 1 + (seed as usize * 37) % 700;
                let block = [1, 3, 64, 256][seed as usize % 4];
                let x: Vec<f32> =
                    values(n, seed).iter().map(|v| v * (1.0 + seed as f32 * 0.37)).collect();
                let mut p = vec![0.0; words(n, block)];
                pack(code, block, &x, &mut p).unwrap();
                let mut y = vec![0.0; n];
                unpack(code, block, &p, &mut y);
                let mut again = vec![0.0; p.len()];
                pack(code, block, &y, &mut again).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&again), bits(&p), "{code:?} seed {seed}");
            }
            // Blocks of every scale, amax from 2^-63 to 2^33.
            let mut state = 0x9e37_79b9_u32;
            for _ in 0..20_000 {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let amax = f32::from_bits(0x2000_0000 + state % 0x3000_0000);
                let x = [amax, -amax / 3.0, amax / 7.0];
                let mut p = vec![0.0; words(3, 3)];
                pack(code, 3, &x, &mut p).unwrap();
                let mut y = [0.0; 3];
                unpack(code, 3, &p, &mut y);
                let mut again = vec![0.0; p.len()];
                pack(code, 3, &y, &mut again).unwrap();
                assert_eq!(again[0].to_bits(), p[0].to_bits(), "{code:?} amax {amax}");
                assert_eq!(again[1].to_bits(), p[1].to_bits(), "{code:?} amax {amax}");
            }
        }
    }

    /// QUANT-1 with segments: each segment's blocks have their own scales, so a segment of
    /// small values next to one of large values keeps its relative accuracy.
    #[test]
    fn segments_get_their_own_blocks_quant_1() {
        let mut x = vec![1.0f32; 100];
        x.extend((0..28).map(|i| 0.01 * (i as f32 - 14.0) / 14.0));
        for code in [Code::Int8, Code::Fp8] {
            for (cuts, small_ok) in [(vec![100, 28], true), (vec![128], false)] {
                let mut p = vec![0.0; words_cut(&cuts, 256)];
                pack_cut(code, 256, &cuts, &x, &mut p).unwrap();
                let mut y = vec![0.0; 128];
                unpack_cut(code, 256, &cuts, &p, &mut y);
                let worst = x[100..]
                    .iter()
                    .zip(&y[100..])
                    .map(|(a, b)| (a - b).abs() / 0.01)
                    .fold(0.0f32, f32::max);
                // fp8's exponent keeps small values' relative accuracy in a shared block
                // (down to its subnormals, 2^-9 of the block's largest code); int8's
                // uniform steps do not.
                let want = small_ok || code == Code::Fp8;
                assert_eq!(worst < 0.07, want, "{code:?} {cuts:?}: worst {worst}");
            }
        }
        assert_eq!(words_cut(&[100, 28], 64), 2 + 1 + 32);
        assert_eq!(words_cut(&[0, 5], 64), 1 + 2);
    }

    #[test]
    fn non_finite_values_are_refused_by_index_quant_3() {
        let mut p = vec![0.0; words(3, 2)];
        assert_eq!(pack(Code::Int8, 2, &[1.0, f32::INFINITY, 0.0], &mut p), Err(1));
        assert_eq!(pack(Code::Fp8, 2, &[f32::NAN, 1.0, 0.0], &mut p), Err(0));
    }

    /// QUANT-2: every non-NaN code decodes and re-encodes to itself; each value between two
    /// neighbours goes to the nearer, ties to the even code; past 448 saturates.
    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates_quant_2() {
        let mut finite: Vec<(f32, u8)> = Vec::new();
        for c in 0..=255u8 {
            let v = e4m3_decode(c);
            if c & 0x7f == 0x7f {
                assert!(v.is_nan());
                continue;
            }
            assert_eq!(e4m3_encode(v), if v == 0.0 { c & 0x80 } else { c }, "code {c:#x}");
            if c & 0x80 == 0 {
                finite.push((v, c));
            }
        }
        assert_eq!(e4m3_decode(0x7e), 448.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        finite.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in finite.windows(2) {
            let ((lo, cl), (hi, ch)) = (w[0], w[1]);
            let mid = (lo + hi) / 2.0;
            let even = if cl % 2 == 0 { cl } else { ch };
            assert_eq!(e4m3_encode(mid), even, "tie between {lo} and {hi}");
            assert_eq!(e4m3_encode(lo + (hi - lo) * 0.25), cl);
            assert_eq!(e4m3_encode(lo + (hi - lo) * 0.75), ch);
            assert_eq!(e4m3_encode(-(lo + (hi - lo) * 0.75)), ch | 0x80);
        }
        assert_eq!(e4m3_encode(1e6), 0x7e);
        assert_eq!(e4m3_encode(-500.0), 0xfe);
    }
}
