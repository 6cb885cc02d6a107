//! Token-level cross-entropy: `loss = mean over every row of -log softmax(logits)[target]`
//! for `logits [rows, vocab]` (batch and time flattened into rows, one target per row),
//! `torch.nn.functional.cross_entropy(logits.view(-1, vocab), targets.view(-1))`, generic over
//! the float type.
//!
//! Forward keeps one logsumexp per row; backward recomputes the softmax from it:
//! `dlogits = dloss * (softmax(logits) - onehot(target)) / rows`.
//!
//! Invariants:
//! - `XENT-1`: forward is torch's mean cross-entropy, each row's logsumexp taken around the
//!   row's maximum (finite for every finite logit); backward writes `dloss * (softmax -
//!   onehot) / rows`, its exact derivative.
//! - `XENT-2`: a target `>= vocab` is [`ModelError::OutOfRange`] naming the target, its row and
//!   the vocabulary size, returned before anything is written.

use num_traits::Float;

use super::{lit, rows, same_len};
use crate::error::ModelError;

/// What [`cross_entropy_backward`] needs from [`cross_entropy_forward`], and the loss.
#[derive(Clone, Debug, PartialEq)]
pub struct CrossEntropySaved<T> {
    /// The mean loss over the rows.
    pub loss: T,
    /// `ln(sum_j exp(logits[r, j]))` of every row.
    pub logsumexp: Vec<T>,
}

fn check_targets(vocab: usize, targets: &[u32]) -> Result<(), ModelError> {
    match targets.iter().position(|&t| t as usize >= vocab) {
        None => Ok(()),
        Some(position) => Err(ModelError::OutOfRange {
            what: "cross-entropy targets".into(),
            index: targets[position] as u64,
            position,
            len: vocab,
        }),
    }
}

/// The mean cross-entropy of `logits [targets.len(), vocab]` against `targets` (XENT-1).
pub fn cross_entropy_forward<T: Float>(
    logits: &[T],
    vocab: usize,
    targets: &[u32],
) -> Result<CrossEntropySaved<T>, ModelError> {
    let n = rows("cross-entropy logits", logits.len(), vocab)?;
    same_len(&[("cross-entropy targets", targets.len())], n)?;
    check_targets(vocab, targets)?;
    let mut logsumexp = Vec::with_capacity(n);
    let mut total = T::zero();
    for (row, &t) in logits.chunks_exact(vocab).zip(targets) {
        let mx = row.iter().fold(T::neg_infinity(), |a, &b| a.max(b));
        let sum = row.iter().fold(T::zero(), |s, &v| s + (v - mx).exp());
        let lse = mx + sum.ln();
        total = total + (lse - row[t as usize]);
        logsumexp.push(lse);
    }
    let loss = if n == 0 { T::zero() } else { total / lit(n as f64) };
    Ok(CrossEntropySaved { loss, logsumexp })
}

/// Writes `dlogits = dloss * (softmax(logits) - onehot(targets)) / rows` (XENT-1).
pub fn cross_entropy_backward<T: Float>(
    logits: &[T],
    vocab: usize,
    targets: &[u32],
    saved: &CrossEntropySaved<T>,
    dloss: T,
    dlogits: &mut [T],
) -> Result<(), ModelError> {
    let n = rows("cross-entropy logits", logits.len(), vocab)?;
    same_len(
        &[
            ("cross-entropy targets", targets.len()),
            ("cross-entropy logsumexp", saved.logsumexp.len()),
        ],
        n,
    )?;
    same_len(&[("cross-entropy dlogits", dlogits.len())], logits.len())?;
    check_targets(vocab, targets)?;
    if n == 0 {
        return Ok(());
    }
    let scale = dloss / lit(n as f64);
    for (r, ((row, drow), &t)) in
        logits.chunks_exact(vocab).zip(dlogits.chunks_exact_mut(vocab)).zip(targets).enumerate()
    {
        let lse = saved.logsumexp[r];
        for (j, (d, &v)) in drow.iter_mut().zip(row).enumerate() {
            let p = (v - lse).exp();
            let onehot = if j == t as usize { T::one() } else { T::zero() };
            *d = scale * (p - onehot);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::{assert_close, assert_grads, randn};

    // PyTorch 2.15, float64:
    // L = torch.tensor([[1.0, 2.0, -0.5, 0.25], [0.0, -1.5, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]],
    //                  requires_grad=True); t = torch.tensor([1, 2, 3])
    // loss = F.cross_entropy(L, t); loss.backward()
    const L: [f64; 12] = [1.0, 2.0, -0.5, 0.25, 0.0, -1.5, 3.0, 0.5, 2.0, 2.0, 2.0, 2.0];
    const T: [u32; 3] = [1, 2, 3];
    const LOSS: f64 = 0.6682217710523214;
    const DL: [f64; 12] = [
        0.07552108249443207,
        -0.1280457471231621,
        0.016851031231565408,
        0.03567363339716467,
        0.014519653899339496,
        0.0032397726998593954,
        -0.041698288826244004,
        0.023938862227045086,
        0.08333333333333333,
        0.08333333333333333,
        0.08333333333333333,
        -0.25,
    ];

    /// XENT-1: torch's loss and gradient.
    #[test]
    fn loss_and_gradient_match_torch_xent_1() {
        let saved = cross_entropy_forward(&L, 4, &T).unwrap();
        assert_close("loss", &[saved.loss], &[LOSS], 1e-15);
        let mut d = vec![f64::NAN; 12];
        cross_entropy_backward(&L, 4, &T, &saved, 1.0, &mut d).unwrap();
        assert_close("dlogits", &d, &DL, 1e-15);
        // Large logits: the maximum is taken out first, nothing overflows.
        let big: Vec<f32> = L.iter().map(|v| *v as f32 * 100.0 + 1e4).collect();
        let s = cross_entropy_forward(&big, 4, &T).unwrap();
        assert!(s.loss.is_finite(), "{}", s.loss);
    }

    #[test]
    fn gradient_matches_finite_differences_nn_1() {
        let (n, v) = (5, 7);
        let logits = randn(n * v, 100);
        let targets = [0u32, 6, 3, 3, 1];
        let dloss = 1.7;
        let saved = cross_entropy_forward(&logits, v, &targets).unwrap();
        let mut d = vec![0.0; n * v];
        cross_entropy_backward(&logits, v, &targets, &saved, dloss, &mut d).unwrap();
        let f = |a: &[Vec<f64>]| vec![cross_entropy_forward(&a[0], v, &targets).unwrap().loss];
        assert_grads(&["logits"], &[logits], &[dloss], &f, &[d]);
    }

    #[test]
    fn out_of_range_targets_are_errors_xent_2() {
        let err = cross_entropy_forward(&L, 4, &[1, 4, 0]).unwrap_err();
        assert!(
            matches!(err, ModelError::OutOfRange { index: 4, position: 1, len: 4, .. }),
            "{err:?}"
        );
        let saved = cross_entropy_forward(&L, 4, &T).unwrap();
        let mut d = vec![7.0; 12];
        let err = cross_entropy_backward(&L, 4, &[0, 0, 9], &saved, 1.0, &mut d).unwrap_err();
        assert!(matches!(err, ModelError::OutOfRange { index: 9, position: 2, .. }), "{err:?}");
        assert!(d.iter().all(|&v| v == 7.0), "nothing written");
        let e = cross_entropy_forward(&L[..11], 4, &T);
        assert!(matches!(e, Err(ModelError::Shape { .. })), "{e:?}");
    }
}
