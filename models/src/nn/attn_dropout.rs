//! Dropout of the attention probabilities (nanoGPT's `attn_dropout`), keyed by where a
//! probability is, so the blocked attention's forward and backward draw the same mask
//! without storing it.
//!
//! nanoGPT applies `attn_dropout` to the softmax of the scores, before the product with `v`:
//! `O = (P * Z) V` with `P = softmax(S)` and `Z = mask / (1 - p)`. The softmax normaliser is
//! that of the undropped `P`. [`crate::nn::attention`] applies it block by block: whether the
//! probability of query `i` for key `j` in head `h` of global sample `b` is kept is a pure
//! function of ([`DropoutKey`], `b`, `h`, `i`, `j`), recomputed where it is needed, so
//! nothing of size `seq x seq` is saved (ATTN-1).
//!
//! The backward follows from the chain rule through `P~ = P * Z`: `dV = P~^T dO`,
//! `dP~ = dO V^T`, `dP = Z * dP~`, and the softmax Jacobian takes the undropped `P`:
//! `dS = P * (dP - rowsum(P * dP))`. The row sum needs no mask:
//! `rowsum(P * Z * dP~) = rowsum(P~ * (dO V^T)) = dO . (P~ V) = dO . O`, the `D` of the
//! undropped backward. So `dS = P~ * dP~ - P * D`.
//!
//! Invariants:
//! - `ADROP-1`: whether a probability is kept depends only on (seed, step, layer, global
//!   sample, head, query, key): the same batch computed whole or in slices at their global
//!   offsets, with any block size, draws the same mask.
//! - `ADROP-2`: kept probabilities are scaled by `1 / (1 - p)`, as torch's dropout does; the
//!   fraction kept is `1 - p` up to sampling error; `p = 0` draws no mask at all.
//! - `ADROP-3`: the blocked attention with dropout equals a plain attention that builds the
//!   explicit `seq x seq` mask from the same key function, forward and every gradient, and
//!   its backward is the exact derivative of its forward (f64 finite differences); a
//!   backward keyed differently from its forward fails both checks.

use super::dropout::{absorb, keep_threshold, kept, DropoutKey};
use crate::error::ModelError;

/// The dropout of one attention call: drop probability `p`, the layer's key, and the global
/// index of the call's first sample (batch row `b` is global sample `first_sample + b`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDropout {
    p: f64,
    threshold: u64,
    key: DropoutKey,
    first_sample: u64,
}

impl AttnDropout {
    /// Dropout of the attention probabilities at `p` in `(0, 1)`; `p = 0` is `None` (no
    /// mask is drawn), and `p` outside `[0, 1)` is an error (`p = 1` would drop every
    /// probability, leaving no output).
    pub fn new(p: f64, key: DropoutKey, first_sample: u64) -> Result<Option<Self>, ModelError> {
        if !(0.0..1.0).contains(&p) {
            return Err(ModelError::shape("attention dropout", "p in [0, 1)", p));
        }
        if p == 0.0 {
            return Ok(None);
        }
        Ok(Some(AttnDropout { p, threshold: keep_threshold(p), key, first_sample }))
    }

    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// The key the mask is drawn from.
    pub fn key(&self) -> DropoutKey {
        self.key
    }

    /// The same dropout with another key (a test's negative control, or another layer).
    pub fn with_key(self, key: DropoutKey) -> Self {
        AttnDropout { key, ..self }
    }

    /// `1 / (1 - p)`, the scale of a kept probability (ADROP-2).
    pub fn scale(&self) -> f64 {
        1.0 / (1.0 - self.p)
    }

    /// The mask of query row `query` of head `head` of batch row `batch` (ADROP-1): the
    /// fields up to the query are hashed once, each key costs one more mix.
    pub fn row(&self, batch: usize, head: usize, query: usize) -> RowMask {
        let mut h = absorb(self.key.state(), self.first_sample + batch as u64);
        h = absorb(absorb(h, head as u64), query as u64);
        RowMask { state: h, threshold: self.threshold }
    }
}

/// The mask of one query row: [`RowMask::keep`] of a key index.
#[derive(Clone, Copy, Debug)]
pub struct RowMask {
    state: u64,
    threshold: u64,
}

impl RowMask {
    /// Whether the probability of key `key` is kept.
    #[inline]
    pub fn keep(&self, key: usize) -> bool {
        kept(absorb(self.state, key as u64), self.threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::attention::{
        attention_backward, attention_forward, merge_heads, merge_heads_backward, split_qkv,
        split_qkv_backward, AttnGrads, AttnShape, Qkv,
    };
    use crate::nn::gradcheck::{
        assert_f32_close, assert_grads, compare, numeric_grads, randn, to_f32, to_f64,
    };

    const KEY: DropoutKey = DropoutKey { seed: 11, step: 4, layer: 3 };

    fn drop(p: f64, first_sample: u64) -> AttnDropout {
        AttnDropout::new(p, KEY, first_sample).unwrap().unwrap()
    }

    fn rand_qkv(s: AttnShape, seed: u64) -> Qkv<f64> {
        let n = s.numel();
        Qkv { q: randn(n, seed), k: randn(n, seed + 1), v: randn(n, seed + 2) }
    }

    fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len(), "lengths differ");
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    }

    /// The explicit `[batch, heads, seq, seq]` matrix `Z` (0 or `1 / (1 - p)`, 0 above the
    /// diagonal) from the key function.
    fn explicit_mask(s: AttnShape, d: &AttnDropout) -> Vec<f64> {
        let t = s.seq;
        let mut z = vec![0.0; s.batch * s.heads * t * t];
        for b in 0..s.batch {
            for h in 0..s.heads {
                for i in 0..t {
                    let row = d.row(b, h, i);
                    for j in 0..=i {
                        if row.keep(j) {
                            z[((b * s.heads + h) * t + i) * t + j] = d.scale();
                        }
                    }
                }
            }
        }
        z
    }

    /// Plain attention with the whole score, probability and mask matrices: the output
    /// `(P * Z) V` and the gradients `dV = (P * Z)^T dO`, `dP = Z * (dO V^T)`,
    /// `dS = P * (dP - rowsum(P * dP))`, `dQ = scale dS K`, `dK = scale dS^T Q`, written
    /// from the definition, without the blocked kernel's `D = rowsum(dO * O)` shortcut.
    fn naive(s: AttnShape, x: &Qkv<f64>, z: &[f64], go: &[f64]) -> (Vec<f64>, AttnGrads<f64>) {
        let (t, d) = (s.seq, s.head_dim);
        let scale = 1.0 / (d as f64).sqrt();
        let n = s.numel();
        let mut o = vec![0.0; n];
        let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        for bh in 0..s.batch * s.heads {
            let base = bh * t * d;
            let row = |m: &[f64], i: usize| m[base + i * d..base + (i + 1) * d].to_vec();
            for i in 0..t {
                let scores: Vec<f64> =
                    (0..=i).map(|j| dot(&row(&x.q, i), &row(&x.k, j)) * scale).collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let zsum: f64 = scores.iter().map(|v| (v - mx).exp()).sum();
                let p: Vec<f64> = scores.iter().map(|v| (v - mx).exp() / zsum).collect();
                let zrow = &z[(bh * t + i) * t..(bh * t + i) * t + i + 1];
                let dp: Vec<f64> =
                    (0..=i).map(|j| zrow[j] * dot(&row(go, i), &row(&x.v, j))).collect();
                let psum = dot(&p, &dp);
                for j in 0..=i {
                    let ds = p[j] * (dp[j] - psum) * scale;
                    for c in 0..d {
                        o[base + i * d + c] += p[j] * zrow[j] * x.v[base + j * d + c];
                        dv[base + j * d + c] += p[j] * zrow[j] * go[base + i * d + c];
                        dq[base + i * d + c] += ds * x.k[base + j * d + c];
                        dk[base + j * d + c] += ds * x.q[base + i * d + c];
                    }
                }
            }
        }
        (o, AttnGrads { dq, dk, dv })
    }

    #[test]
    fn blocked_attention_with_dropout_equals_the_explicit_mask_adrop_3() {
        for (seq, p) in [(1, 0.3), (5, 0.5), (13, 0.2), (33, 0.1), (40, 0.7)] {
            let s = AttnShape { batch: 2, heads: 3, seq, head_dim: 4 };
            let x = rand_qkv(s, seq as u64);
            let go = randn(s.numel(), 100 + seq as u64);
            let d = drop(p, 17);
            let z = explicit_mask(s, &d);
            let (o, want) = naive(s, &x, &z, &go);
            for block in [1, 3, 4, 8, 64] {
                let at = format!("seq {seq} p {p} block {block}");
                let saved = attention_forward(s, block, Some(d), x.clone()).unwrap();
                assert!(max_diff(saved.output(), &o) < 1e-12, "{at}: output");
                let g = attention_backward(&saved, &go).unwrap();
                assert!(max_diff(&g.dq, &want.dq) < 1e-12, "{at}: dq");
                assert!(max_diff(&g.dk, &want.dk) < 1e-12, "{at}: dk");
                assert!(max_diff(&g.dv, &want.dv) < 1e-12, "{at}: dv");
            }
            // The dropout is visible: without it the output differs.
            let plain = attention_forward(s, 4, None, x.clone()).unwrap();
            if seq > 1 {
                assert!(max_diff(plain.output(), &o) > 1e-3, "seq {seq}: dropout changed nothing");
            }
        }
    }

    /// Through nanoGPT's layout: the gradient of the fused `c_attn` output (upstream of the
    /// split) equals the explicit-mask reference's, and the f32 kernel agrees with the f64
    /// one (NN-2).
    #[test]
    fn fused_qkv_gradient_and_f32_match_the_reference_adrop_3() {
        let s = AttnShape { batch: 2, heads: 2, seq: 19, head_dim: 8 };
        let qkv = randn(s.batch * s.seq * 3 * s.embd(), 5);
        let dy = randn(s.batch * s.seq * s.embd(), 6);
        let d = drop(0.25, 3);
        let x = split_qkv(s, &qkv).unwrap();
        let go = merge_heads_backward(s, &dy).unwrap();
        let (o, want) = naive(s, &x, &explicit_mask(s, &d), &go);
        let want_dqkv = split_qkv_backward(s, &want).unwrap();
        let saved = attention_forward(s, 4, Some(d), x).unwrap();
        let y = merge_heads(s, saved.output()).unwrap();
        assert!(max_diff(&y, &merge_heads(s, &o).unwrap()) < 1e-12, "y");
        let g = attention_backward(&saved, &go).unwrap();
        let dqkv = split_qkv_backward(s, &g).unwrap();
        assert!(max_diff(&dqkv, &want_dqkv) < 1e-12, "dqkv");

        let x32 = split_qkv(s, &to_f32(&qkv)).unwrap();
        let saved32 = attention_forward(s, 4, Some(d), x32).unwrap();
        assert_f32_close("y", &merge_heads(s, saved32.output()).unwrap(), &y);
        let g32 = attention_backward(&saved32, &to_f32(&go)).unwrap();
        let dqkv32 = split_qkv_backward(s, &g32).unwrap();
        // The f32 gradient sums up to seq terms of f32 rounding: compare at 1e-5.
        assert!(max_diff(&to_f64(&dqkv32), &dqkv) < 1e-5, "dqkv f32");
    }

    fn fd_case() -> (AttnShape, usize, Qkv<f64>, Vec<f64>) {
        let s = AttnShape { batch: 2, heads: 2, seq: 7, head_dim: 3 };
        (s, 3, rand_qkv(s, 21), randn(s.numel(), 22))
    }

    fn forward_fn(s: AttnShape, block: usize, d: AttnDropout) -> impl Fn(&[Vec<f64>]) -> Vec<f64> {
        move |a: &[Vec<f64>]| {
            let x = Qkv { q: a[0].clone(), k: a[1].clone(), v: a[2].clone() };
            attention_forward(s, block, Some(d), x).unwrap().output().to_vec()
        }
    }

    /// ADROP-3: with a fixed key the mask is fixed, so the dropped attention is a smooth
    /// function of q, k, v, and every gradient element matches f64 finite differences.
    #[test]
    fn gradients_with_dropout_match_finite_differences_adrop_3() {
        let (s, block, x, r) = fd_case();
        for p in [0.2, 0.5] {
            let d = drop(p, 9);
            let saved = attention_forward(s, block, Some(d), x.clone()).unwrap();
            let g = attention_backward(&saved, &r).unwrap();
            let args = [x.q.clone(), x.k.clone(), x.v.clone()];
            assert_grads(
                &["dq", "dk", "dv"],
                &args,
                &r,
                &forward_fn(s, block, d),
                &[g.dq, g.dk, g.dv],
            );
        }
    }

    /// The negative control of ADROP-3: a backward that draws its mask from another key (the
    /// next step's) than the forward's fails the finite-difference check and the reference.
    #[test]
    fn a_backward_keyed_differently_fails_the_checks_adrop_3() {
        let (s, block, x, r) = fd_case();
        let d = drop(0.3, 9);
        let other = d.with_key(DropoutKey { step: KEY.step + 1, ..KEY });
        let args = [x.q.clone(), x.k.clone(), x.v.clone()];
        let numeric = numeric_grads(&args, &r, &forward_fn(s, block, d));
        let saved = attention_forward(s, block, Some(d), x.clone()).unwrap();
        let good = attention_backward(&saved, &r).unwrap();
        assert!(compare(&["dq", "dk", "dv"], &numeric, &[good.dq, good.dk, good.dv]).is_ok());
        let wrong = attention_backward(&saved.with_dropout(Some(other)), &r).unwrap();
        let err = compare(&["dq", "dk", "dv"], &numeric, &[wrong.dq.clone(), wrong.dk, wrong.dv]);
        assert!(err.is_err(), "a backward with another mask passed the gradient check");
        let (_, want) = naive(s, &x, &explicit_mask(s, &d), &r);
        assert!(max_diff(&wrong.dq, &want.dq) > 1e-3, "the reference missed the other mask");
    }

    /// ADROP-1: a batch computed in slices at their global offsets, or with another block
    /// size, draws the same mask; another key draws another.
    #[test]
    fn the_mask_depends_on_the_place_not_the_slice_or_block_adrop_1() {
        let s = AttnShape { batch: 4, heads: 2, seq: 21, head_dim: 4 };
        let d = drop(0.4, 100);
        let whole = explicit_mask(s, &d);
        // Ranks holding global samples 100..101 and 101..104.
        let (s1, s3) = (AttnShape { batch: 1, ..s }, AttnShape { batch: 3, ..s });
        let mut sliced = explicit_mask(s1, &drop(0.4, 100));
        sliced.extend(explicit_mask(s3, &drop(0.4, 101)));
        assert_eq!(sliced, whole);
        for other in [
            DropoutKey { step: KEY.step + 1, ..KEY },
            DropoutKey { layer: KEY.layer + 1, ..KEY },
            DropoutKey { seed: KEY.seed + 1, ..KEY },
        ] {
            assert_ne!(explicit_mask(s, &d.with_key(other)), whole, "{other:?}");
        }
        // Through the kernel: slices at their offsets give the whole batch's output bitwise.
        let x = rand_qkv(s, 8);
        let whole = attention_forward(s, 8, Some(d), x.clone()).unwrap();
        let per = s.numel() / s.batch;
        let part = |from: usize, n: usize| {
            let cut = |v: &[f64]| v[from * per..(from + n) * per].to_vec();
            let xs = Qkv { q: cut(&x.q), k: cut(&x.k), v: cut(&x.v) };
            let shape = AttnShape { batch: n, ..s };
            attention_forward(shape, 8, Some(drop(0.4, 100 + from as u64)), xs).unwrap()
        };
        let (a, b) = (part(0, 1), part(1, 3));
        let joined: Vec<f64> = a.output().iter().chain(b.output()).copied().collect();
        assert_eq!(joined, whole.output());
        // Another block size keeps the mask: the outputs agree to rounding.
        let other_block = attention_forward(s, 5, Some(d), x).unwrap();
        assert!(max_diff(other_block.output(), whole.output()) < 1e-12);
    }

    /// ADROP-2: the kept fraction is `1 - p` and kept entries carry `1 / (1 - p)`; `p = 0`
    /// is no dropout and `p` outside `[0, 1)` an error.
    #[test]
    fn kept_fraction_and_scale_adrop_2() {
        let s = AttnShape { batch: 8, heads: 4, seq: 100, head_dim: 1 };
        for p in [0.1, 0.5, 0.9] {
            let d = drop(p, 0);
            let z = explicit_mask(s, &d);
            let live = s.batch * s.heads * s.seq * (s.seq + 1) / 2;
            let kept = z.iter().filter(|&&v| v != 0.0).count();
            let frac = kept as f64 / live as f64;
            // 161600 draws: a binomial standard deviation of at most 1.3e-3; 5 sigma.
            assert!((frac - (1.0 - p)).abs() < 6.5e-3, "p {p}: kept {frac}");
            assert!(z.iter().all(|&v| v == 0.0 || v == 1.0 / (1.0 - p)), "p {p}: scale");
        }
        assert_eq!(AttnDropout::new(0.0, KEY, 0).unwrap(), None);
        assert!(AttnDropout::new(1.0, KEY, 0).is_err());
        assert!(AttnDropout::new(-0.1, KEY, 0).is_err());
        assert!(AttnDropout::new(f64::NAN, KEY, 0).is_err());
    }
}
