//! Losses: what a model's output is scored against, as a rank's share of the mean over the
//! global batch (LOSS-1), so that the ranks' losses and gradients sum to those of the whole
//! batch whatever the world size.

use crate::error::ModelError;
use crate::loss::{correct_count, softmax_cross_entropy};
use crate::lower::Lowering;
use crate::ops::Op;
use crate::tensor::Tensor;

/// A loss over a model's output and a target.
pub trait Loss: Send + Sync + std::fmt::Debug {
    /// Short name for reports (`cross-entropy`, `lm-cross-entropy`, `mse`).
    fn name(&self) -> &'static str;

    /// This rank's share of the mean loss over a global batch of `global_batch` samples, and
    /// the gradient of that share with respect to `output` (LOSS-1).
    fn forward_backward(
        &self,
        output: &Tensor,
        target: &Tensor,
        global_batch: usize,
    ) -> Result<(f32, Tensor), ModelError>;

    /// Predictions that hit their target, and how many there were (samples, or tokens);
    /// `None` where the loss has no notion of a hit (regression).
    fn correct(&self, output: &Tensor, target: &Tensor) -> Result<Option<(u64, u64)>, ModelError> {
        let _ = (output, target);
        Ok(None)
    }

    /// [`Loss::forward_backward`] for an output of `shape` as one device op (reads the
    /// output and the targets, writes the loss and the output's gradient; `crate::lower`).
    /// The default refuses (LOWER-3).
    fn lower(&self, shape: &[usize], global_batch: usize) -> Result<Op, ModelError> {
        let _ = (shape, global_batch);
        Err(Lowering::unlowered(&format!("the {} loss", self.name())))
    }
}

/// Classification: softmax cross-entropy of `[N, classes]` logits against `u32` labels `[N]`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClassCrossEntropy;

impl Loss for ClassCrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }
    fn forward_backward(
        &self,
        output: &Tensor,
        target: &Tensor,
        global: usize,
    ) -> Result<(f32, Tensor), ModelError> {
        softmax_cross_entropy(output, target.as_u32()?, global)
    }
    fn lower(&self, shape: &[usize], global: usize) -> Result<Op, ModelError> {
        match shape {
            &[_, classes] => Ok(Op::SoftmaxCrossEntropy { classes, global }),
            s => Err(ModelError::shape("cross-entropy logits", "[N, K]", format!("{s:?}"))),
        }
    }
    fn correct(&self, output: &Tensor, target: &Tensor) -> Result<Option<(u64, u64)>, ModelError> {
        let y = target.as_u32()?;
        Ok(Some((correct_count(output, y)? as u64, y.len() as u64)))
    }
}

/// Language modelling: cross-entropy over every token of `[B, T, vocab]` logits against
/// `u32` next tokens `[B, T]`, the mean over all `global_batch x T` tokens (torch's
/// `F.cross_entropy(logits.view(-1, V), targets.view(-1))` on the whole batch).
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenCrossEntropy;

fn as_rows(output: &Tensor, target: &Tensor) -> Result<(Tensor, usize), ModelError> {
    let (s, t) = (output.shape(), target.shape());
    if s.len() != 3 || t != &s[..2] {
        return Err(ModelError::shape(
            "lm cross-entropy",
            format!("logits [B, T, V] and targets [B, T], got targets {t:?}"),
            format!("logits {s:?}"),
        ));
    }
    Ok((output.clone().reshape(vec![s[0] * s[1], s[2]])?, s[1]))
}

impl Loss for TokenCrossEntropy {
    fn name(&self) -> &'static str {
        "lm-cross-entropy"
    }
    fn forward_backward(
        &self,
        output: &Tensor,
        target: &Tensor,
        global: usize,
    ) -> Result<(f32, Tensor), ModelError> {
        let (rows, seq) = as_rows(output, target)?;
        let (loss, g) = softmax_cross_entropy(&rows, target.as_u32()?, global * seq)?;
        Ok((loss, g.reshape(output.shape().to_vec())?))
    }
    fn lower(&self, shape: &[usize], global: usize) -> Result<Op, ModelError> {
        match shape {
            &[_, seq, classes] => Ok(Op::SoftmaxCrossEntropy { classes, global: global * seq }),
            s => Err(ModelError::shape("lm cross-entropy logits", "[B, T, V]", format!("{s:?}"))),
        }
    }
    fn correct(&self, output: &Tensor, target: &Tensor) -> Result<Option<(u64, u64)>, ModelError> {
        let (rows, _) = as_rows(output, target)?;
        let y = target.as_u32()?;
        Ok(Some((correct_count(&rows, y)? as u64, y.len() as u64)))
    }
}

/// Regression: mean squared error of `f32` outputs against `f32` targets of the same shape,
/// the mean over every element of the global batch (torch's `MSELoss()`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Mse;

impl Loss for Mse {
    fn name(&self) -> &'static str {
        "mse"
    }
    fn forward_backward(
        &self,
        output: &Tensor,
        target: &Tensor,
        global: usize,
    ) -> Result<(f32, Tensor), ModelError> {
        if output.shape() != target.shape() {
            return Err(ModelError::shape(
                "mse target",
                format!("{:?}", output.shape()),
                format!("{:?}", target.shape()),
            ));
        }
        let per: usize = output.shape().iter().skip(1).product();
        let n = (global * per).max(1) as f64;
        let (y, t) = (output.as_f32()?, target.as_f32()?);
        let mut loss = 0.0f64;
        let g = y
            .iter()
            .zip(t)
            .map(|(&a, &b)| {
                let d = a as f64 - b as f64;
                loss += d * d;
                (2.0 * d / n) as f32
            })
            .collect();
        Ok(((loss / n) as f32, Tensor::new(output.shape().to_vec(), g)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_shares_of_any_split_sum_to_the_whole_batch() {
        // [4, 3, 5] logits against [4, 3] targets, split 1 + 3 samples.
        let logits: Vec<f32> = (0..60).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let targets: Vec<u32> = (0..12).map(|i| (i * 7 % 5) as u32).collect();
        let whole = Tensor::new(vec![4, 3, 5], logits).unwrap();
        let y = Tensor::from_u32(vec![4, 3], targets).unwrap();
        let (l, g) = TokenCrossEntropy.forward_backward(&whole, &y, 4).unwrap();
        let (l1, g1) = TokenCrossEntropy
            .forward_backward(&whole.rows(0, 1).unwrap(), &y.rows(0, 1).unwrap(), 4)
            .unwrap();
        let (l2, g2) = TokenCrossEntropy
            .forward_backward(&whole.rows(1, 4).unwrap(), &y.rows(1, 4).unwrap(), 4)
            .unwrap();
        assert!((l - (l1 + l2)).abs() < 1e-6, "{l} vs {l1} + {l2}");
        let parts: Vec<f32> =
            g1.as_f32().unwrap().iter().chain(g2.as_f32().unwrap()).copied().collect();
        assert!(parts.iter().zip(g.as_f32().unwrap()).all(|(a, b)| (a - b).abs() < 1e-7));
        // The mean over every token: 12 rows, each row's gradient sums to zero.
        assert!(g.as_f32().unwrap().chunks(5).all(|r| r.iter().sum::<f32>().abs() < 1e-6));

        let t = Tensor::new(vec![2, 2], vec![1.0, 0.0, 0.5, 2.0]).unwrap();
        let o = Tensor::new(vec![2, 2], vec![0.0, 0.0, 0.5, 1.0]).unwrap();
        let (m, gm) = Mse.forward_backward(&o, &t, 2).unwrap();
        assert!((m - 0.5).abs() < 1e-7, "torch: ((1)^2 + 0 + 0 + (1)^2) / 4 = 0.5, got {m}");
        assert_eq!(gm.as_f32().unwrap(), &[-0.5, 0.0, 0.0, -0.5]);
        assert!(Mse.correct(&o, &t).unwrap().is_none());
        assert!(TokenCrossEntropy.forward_backward(&o, &t, 2).is_err(), "shapes are checked");
    }
}
