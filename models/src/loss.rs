//! Softmax cross-entropy, averaged over the GLOBAL batch.
//!
//! `LOSS-1`: each rank divides by the global batch size (not its own slice's), so that the
//! ranks' losses and gradients SUM to the loss and gradient of the whole batch's mean; the
//! ordinary gradient reduction (a sum) then gives exactly the single-process gradient, even
//! with uneven or empty slices.

use crate::error::ModelError;
use crate::nn::exp::{exp_f64, softmax_f32, sum_exp_f32};
use crate::tensor::Tensor;

/// `(loss_share, grad_logits)` for `logits [N, K]` and labels in `0..K`: the rank's share
/// of the mean cross-entropy over a global batch of `global_batch` samples (LOSS-1).
pub fn softmax_cross_entropy(
    logits: &Tensor,
    labels: &[u32],
    global_batch: usize,
) -> Result<(f32, Tensor), ModelError> {
    if logits.shape().len() != 2 || logits.shape()[0] != labels.len() {
        return Err(ModelError::shape(
            "cross-entropy logits",
            format!("[{}, K]", labels.len()),
            format!("{:?}", logits.shape()),
        ));
    }
    if global_batch < labels.len() || (global_batch == 0 && !labels.is_empty()) {
        return Err(ModelError::Config(format!(
            "global batch {global_batch} smaller than the local batch {}",
            labels.len()
        )));
    }
    let k = logits.shape()[1];
    let scale = if global_batch == 0 { 0.0 } else { 1.0 / global_batch as f64 };
    let mut grad = logits.clone();
    let mut loss = 0.0f64;
    for (row, &y) in grad.as_f32_mut()?.chunks_exact_mut(k.max(1)).zip(labels) {
        let y = y as usize;
        if y >= k {
            return Err(ModelError::Config(format!("label {y} out of range for {k} classes")));
        }
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        // The softmax through the vectorised `exp` (EXP-3); the label's entry then gets its
        // `- 1`, as `(p - 1) * scale`.
        let z = sum_exp_f32(row, m);
        let at_label = row[y] as f64;
        loss += z.ln() + m - at_label;
        softmax_f32(row, m, z, scale);
        row[y] = ((exp_f64(at_label - m) / z - 1.0) * scale) as f32;
    }
    Ok(((loss * scale) as f32, grad))
}

/// Number of rows whose largest logit is at the label.
pub fn correct_count(logits: &Tensor, labels: &[u32]) -> Result<usize, ModelError> {
    let k = logits.shape().get(1).copied().unwrap_or(0).max(1);
    Ok(logits
        .as_f32()?
        .chunks_exact(k)
        .zip(labels)
        .filter(|(row, &y)| {
            let best = row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| {
                if v > b.1 {
                    (i, v)
                } else {
                    b
                }
            });
            best.0 == y as usize
        })
        .count())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{check_grads, rand_tensor};

    #[test]
    fn cross_entropy_gradient_matches_finite_differences() {
        // LAYER-2 for the loss: y = loss as a 1-element tensor
        let labels = [2u32, 0, 1];
        check_grads(0, &[3, 4], 9, &|_p, x, gy, _gp| {
            let (l, g) = softmax_cross_entropy(&x, &labels, 5)?;
            let y = Tensor::new(vec![1], vec![l])?;
            Ok((
                y,
                gy.map(|gy| {
                    Tensor::new(
                        g.shape().to_vec(),
                        g.as_f32().unwrap().iter().map(|v| v * gy.as_f32().unwrap()[0]).collect(),
                    )
                    .unwrap()
                }),
            ))
        });
    }

    #[test]
    fn shares_sum_to_the_global_mean() {
        // LOSS-1: slices of 2, 0 and 3 rows
        let x = rand_tensor(&[5, 3], 4);
        let labels = [0u32, 2, 1, 1, 0];
        let (whole, g) = softmax_cross_entropy(&x, &labels, 5).unwrap();
        let mut sum = 0.0;
        let mut grads = Vec::new();
        for (a, b) in [(0, 2), (2, 2), (2, 5)] {
            let part =
                Tensor::new(vec![b - a, 3], x.as_f32().unwrap()[a * 3..b * 3].to_vec()).unwrap();
            let (l, gp) = softmax_cross_entropy(&part, &labels[a..b], 5).unwrap();
            sum += l;
            grads.extend(gp.into_f32().unwrap());
        }
        assert!((sum - whole).abs() < 1e-6);
        assert!(grads.iter().zip(g.as_f32().unwrap()).all(|(a, b)| (a - b).abs() < 1e-7));
        // the direct formula: mean of -log softmax at the label
        let want: f64 = (0..5)
            .map(|i| {
                let row = &x.as_f32().unwrap()[i * 3..i * 3 + 3];
                let z: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
                -((row[labels[i] as usize] as f64).exp() / z).ln()
            })
            .sum::<f64>()
            / 5.0;
        assert!((whole as f64 - want).abs() < 1e-6);
    }
}
