//! Quantized reduction across shard groups (`--cross-node-reduce-dtype int8|fp8`, ZeRO++'s
//! qgZ idea): the pure core of packing a reduced gradient shard for its replica group and
//! summing the replicas' packed shards.
//!
//! A replica all-reduce in f32 moves about `2 (R - 1) / R` of the shard's f32 bytes per
//! rank around a ring of `R` replicas, and each hop would have to quantize again if the ring
//! carried 8-bit values (error compounding over the hops). Here each replica quantizes its
//! shard **once**, block by block with one `f32` scale per block, the packed shards are
//! all-gathered (`(R - 1)` packed shards received per rank: about a quarter of an f32 shard
//! each), and every replica decodes all `R` of them and sums them in f32 in replica order.
//! Inside the shard group the reduce-scatter stays in the reduce dtype; only the hop across
//! groups (across nodes with `--shard-group node`) is quantized.
//!
//! Invariants:
//! - QREDUCE-1: every replica computes the same sum, bitwise: it decodes every replica's
//!   packed shard, its own included (never its exact values), and adds them in replica
//!   order starting from replica 0's.
//! - QREDUCE-2: each replica's contribution is quantized exactly once, so an element's
//!   error is at most the sum over replicas of its block's bound (QUANT-1), whatever the
//!   number of replicas; a non-finite gradient is refused naming its index (QUANT-3).

use shardline_collectives::quant::{self, Code};

/// Words of one replica's packed shard of `len` values in blocks of `block`.
pub(crate) fn packed_words(len: usize, block: usize) -> usize {
    quant::words(len, block)
}

/// Packs `shard` for the all-gather across the replica group (QREDUCE-2); the error is the
/// index of its first non-finite value.
pub(crate) fn pack_shard(code: Code, block: usize, shard: &[f32]) -> Result<Vec<f32>, usize> {
    let mut out = vec![0.0f32; packed_words(shard.len(), block)];
    quant::pack(code, block, shard, &mut out)?;
    Ok(out)
}

/// Sums the `replicas` packed shards of `len` values laid side by side in `gathered` (the
/// all-gather's output), decoded, in replica order (QREDUCE-1).
///
/// Panics when `gathered` is not `replicas` packed shards long (a caller's broken invariant).
pub(crate) fn sum_packed(
    code: Code,
    block: usize,
    len: usize,
    replicas: usize,
    gathered: &[f32],
) -> Vec<f32> {
    let w = packed_words(len, block);
    assert_eq!(gathered.len(), w * replicas, "gathered {} words", gathered.len());
    let mut sum = vec![0.0f32; len];
    let mut one = vec![0.0f32; len];
    for (r, words) in gathered.chunks_exact(w.max(1)).take(replicas).enumerate() {
        if r == 0 {
            quant::unpack(code, block, words, &mut sum);
        } else {
            quant::unpack(code, block, words, &mut one);
            sum.iter_mut().zip(&one).for_each(|(s, &x)| *s += x);
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(seed: u32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed * 97) % 2001;
                (x as f32 - 1000.0) / 997.0 * (1.0 + (i % 7) as f32)
            })
            .collect()
    }

    /// Every replica's view of the sum is the same bits, whichever replica computes it: the
    /// gathered words are identical everywhere, and the sum decodes them all (its own too).
    #[test]
    fn every_replica_sums_the_same_bits_qreduce_1() {
        for code in [Code::Int8, Code::Fp8] {
            let (len, block, replicas) = (1000, 64, 3);
            let shards: Vec<Vec<f32>> = (0..replicas).map(|r| shard(r as u32, len)).collect();
            let gathered: Vec<f32> =
                shards.iter().flat_map(|s| pack_shard(code, block, s).unwrap()).collect();
            let a = sum_packed(code, block, len, replicas, &gathered);
            // Decoding and adding in replica order by hand gives the same bits.
            let mut b = vec![0.0f32; len];
            for s in &shards {
                let mut d = vec![0.0f32; len];
                quant::unpack(code, block, &pack_shard(code, block, s).unwrap(), &mut d);
                b.iter_mut().zip(&d).for_each(|(x, &y)| *x += y);
            }
            assert_eq!(a, b, "{code:?}");
            // A sum that took its own exact values would differ: the check can fail.
            let mut own_exact = shards[0].clone();
            for s in &shards[1..] {
                let mut d = vec![0.0f32; len];
                quant::unpack(code, block, &pack_shard(code, block, s).unwrap(), &mut d);
                own_exact.iter_mut().zip(&d).for_each(|(x, &y)| *x += y);
            }
            assert_ne!(a, own_exact, "{code:?}");
        }
    }

    /// The error per element stays within the sum of the replicas' block bounds (int8: half
    /// a step of `amax / 127` per block), one quantization per replica; and a non-finite
    /// value is refused with its index.
    #[test]
    fn the_error_is_one_quantization_per_replica_qreduce_2() {
        let (len, block) = (777, 32);
        for replicas in [2usize, 4, 8] {
            let shards: Vec<Vec<f32>> = (0..replicas).map(|r| shard(r as u32 + 5, len)).collect();
            let gathered: Vec<f32> =
                shards.iter().flat_map(|s| pack_shard(Code::Int8, block, s).unwrap()).collect();
            let got = sum_packed(Code::Int8, block, len, replicas, &gathered);
            for i in 0..len {
                let b = i / block * block..((i / block + 1) * block).min(len);
                let bound: f32 = shards
                    .iter()
                    .map(|s| s[b.clone()].iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0 * 0.5)
                    .sum();
                let exact: f32 = shards.iter().map(|s| s[i]).sum();
                assert!(
                    (got[i] - exact).abs() <= bound * 1.0001 + 1e-6,
                    "replicas {replicas}, element {i}: {} vs {exact}, bound {bound}",
                    got[i]
                );
            }
        }
        let mut bad = shard(1, 100);
        bad[42] = f32::NAN;
        assert_eq!(pack_shard(Code::Int8, 16, &bad), Err(42));
    }
}
