//! What the fault campaigns share (`faults`, in one process, and `faults --live`, under
//! `shardline launch`): the seeded draw, medians, the check of committed checkpoints and the
//! bitwise fingerprint of a run's final state.

use shardline_runtime::checkpoint::Checkpoint;
use std::path::Path;

/// splitmix64: the campaigns' seeded draws.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 for n = 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The median (the upper one of an even count); `None` for no values.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}

/// Verifies every committed checkpoint under `dir` (a directory with a manifest, not one
/// still being written, `.tmp-step-N`); returns the first that fails, and why.
pub fn torn(dir: &Path) -> Option<String> {
    let rd = std::fs::read_dir(dir).ok()?;
    for e in rd.flatten() {
        let p = e.path();
        let writing = e.file_name().to_string_lossy().starts_with(".tmp");
        if !writing && p.join("manifest.json").is_file() {
            if let Err(e) = Checkpoint::open(&p).and_then(|c| c.verify()) {
                return Some(format!("{}: {e}", p.display()));
            }
        }
    }
    None
}

/// FNV-1a over the bit patterns of every parameter and buffer.
pub fn hash_bits(units: &[Vec<f32>], bufs: &[Vec<f32>]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in units.iter().chain(bufs) {
        for x in v {
            for b in x.to_bits().to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_flipped_bit_changes_the_fingerprint() {
        let a = vec![vec![1.0f32, -0.0, 3.5]];
        let mut b = a.clone();
        assert_eq!(hash_bits(&a, &[]), hash_bits(&b, &[]));
        b[0][1] = 0.0;
        assert_ne!(hash_bits(&a, &[]), hash_bits(&b, &[]));
        // Where a value sits counts, not only the values.
        assert_ne!(hash_bits(&[vec![1.0], vec![]], &[]), hash_bits(&[vec![], vec![1.0]], &[]));
    }

    #[test]
    fn median_takes_the_upper_middle() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(3.0));
    }
}
