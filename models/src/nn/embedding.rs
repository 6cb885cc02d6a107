//! Token embedding: a `[vocab, dim]` table, token ids in, one table row per id out
//! (`torch.nn.functional.embedding`, without `padding_idx` or `max_norm`).
//!
//! Backward is a scatter-add into the table's gradient: a token that appears k times in the
//! batch gets the sum of its k output gradients, and rows of tokens absent from the batch
//! get nothing added. Ids come from data (a tokenizer, a file), so an id outside the table is
//! an error the caller can report, not a panic.
//!
//! Invariants:
//! - `EMB-1`: forward output row `i` is table row `ids[i]`, bit for bit.
//! - `EMB-2`: backward ADDS output-gradient row `i` into table-gradient row `ids[i]`
//!   (NN-3): repeated ids add up; the rows of ids not in the batch are left as they were.
//! - `EMB-3`: an id `>= vocab` is [`ModelError::OutOfRange`] naming the id, its position
//!   and the vocabulary size, in forward and in backward, returned before anything is
//!   written.

use num_traits::Float;

use super::same_len;
use crate::error::ModelError;
use crate::layers::check_len;
use crate::spec::ParamSpec;

/// An embedding table of `vocab` rows of `dim` values; parameter `weight [vocab, dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding {
    /// Number of rows (valid ids are `0..vocab`).
    pub vocab: usize,
    /// Values per row.
    pub dim: usize,
}

impl Embedding {
    /// A `[vocab, dim]` embedding.
    pub fn new(vocab: usize, dim: usize) -> Self {
        Embedding { vocab, dim }
    }

    /// `weight [vocab, dim]` (torch's name).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        vec![ParamSpec { name: "weight".into(), shape: vec![self.vocab, self.dim] }]
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.vocab * self.dim
    }

    /// Every id below `vocab` (EMB-3).
    fn check_ids(&self, what: &str, ids: &[u32]) -> Result<(), ModelError> {
        match ids.iter().position(|&id| id as usize >= self.vocab) {
            None => Ok(()),
            Some(position) => Err(ModelError::OutOfRange {
                what: what.to_string(),
                index: ids[position] as u64,
                position,
                len: self.vocab,
            }),
        }
    }

    /// Writes table row `ids[i]` into row `i` of `out [ids.len(), dim]` (EMB-1).
    pub fn forward<T: Float>(
        &self,
        table: &[T],
        ids: &[u32],
        out: &mut [T],
    ) -> Result<(), ModelError> {
        check_len("embedding table", table.len(), self.num_params())?;
        same_len(&[("embedding output", out.len())], ids.len() * self.dim)?;
        self.check_ids("embedding ids", ids)?;
        if self.dim == 0 {
            return Ok(());
        }
        for (row, &id) in out.chunks_exact_mut(self.dim).zip(ids) {
            let at = id as usize * self.dim;
            row.copy_from_slice(&table[at..at + self.dim]);
        }
        Ok(())
    }

    /// Adds row `i` of `dy [ids.len(), dim]` into row `ids[i]` of `grads [vocab, dim]`
    /// (EMB-2).
    pub fn backward<T: Float>(
        &self,
        ids: &[u32],
        dy: &[T],
        grads: &mut [T],
    ) -> Result<(), ModelError> {
        check_len("embedding grads", grads.len(), self.num_params())?;
        same_len(&[("embedding dy", dy.len())], ids.len() * self.dim)?;
        self.check_ids("embedding ids", ids)?;
        if self.dim == 0 {
            return Ok(());
        }
        for (row, &id) in dy.chunks_exact(self.dim).zip(ids) {
            let at = id as usize * self.dim;
            for (g, &d) in grads[at..at + self.dim].iter_mut().zip(row) {
                *g = *g + d;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::{assert_grads, randn, to_f32, to_f64};

    // PyTorch 2.15, float64:
    // T = torch.arange(12, dtype=torch.float64).reshape(4, 3).mul(0.5).sub(1.0).requires_grad_()
    // ids = torch.tensor([2, 0, 2, 2]); y = torch.nn.functional.embedding(ids, T)
    // DE = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75], [-0.125, 3.0, 1.0], [2.0, -2.0, 0.5]])
    // (dtable,) = torch.autograd.grad(y, (T,), DE)
    const IDS: [u32; 4] = [2, 0, 2, 2];
    const EMB_Y: [f64; 12] = [2.0, 2.5, 3.0, -1.0, -0.5, 0.0, 2.0, 2.5, 3.0, 2.0, 2.5, 3.0];
    const DE: [f64; 12] = [0.5, -1.0, 2.0, 1.5, 0.25, -0.75, -0.125, 3.0, 1.0, 2.0, -2.0, 0.5];
    const EMB_DTABLE: [f64; 12] = [1.5, 0.25, -0.75, 0.0, 0.0, 0.0, 2.375, 0.0, 3.5, 0.0, 0.0, 0.0];

    fn table() -> Vec<f64> {
        (0..12).map(|i| i as f64 * 0.5 - 1.0).collect()
    }

    /// EMB-1 (lookup), EMB-2 (scatter-add; added, not written): equal to torch's.
    #[test]
    fn lookup_and_scatter_add_match_torch() {
        let emb = Embedding::new(4, 3);
        let mut y = vec![f64::NAN; 12];
        emb.forward(&table(), &IDS, &mut y).unwrap();
        assert_eq!(y, EMB_Y);
        let mut grads = vec![0.0; 12];
        emb.backward(&IDS, &DE, &mut grads).unwrap();
        assert_eq!(grads, EMB_DTABLE, "id 2 three times: its rows add up; ids 1, 3: zero");
        // Added, not written: a second backward doubles, rows 1 and 3 keep what they held.
        let mut grads = vec![1.0; 12];
        emb.backward(&IDS, &DE, &mut grads).unwrap();
        emb.backward(&IDS, &DE, &mut grads).unwrap();
        let want: Vec<f64> = EMB_DTABLE.iter().map(|g| 1.0 + 2.0 * g).collect();
        assert_eq!(grads, want);
    }

    /// EMB-1: bit for bit, so the f32 and f64 lookups agree exactly (NN-2).
    #[test]
    fn rows_are_copied_bit_for_bit() {
        let emb = Embedding::new(5, 7);
        let t32 = to_f32(&randn(35, 60));
        let ids = [4u32, 0, 4, 1, 3];
        let mut y32 = vec![0.0f32; 35];
        emb.forward(&t32, &ids, &mut y32).unwrap();
        let mut y64 = vec![0.0f64; 35];
        emb.forward(&to_f64(&t32), &ids, &mut y64).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let row = &t32[id as usize * 7..][..7];
            assert!(y32[i * 7..][..7].iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        assert_eq!(to_f64(&y32), y64);
    }

    #[test]
    fn table_gradient_matches_finite_differences_nn_1() {
        // Repeated ids and an unused row (2): a gradient that overwrites instead of adding, or
        // writes an unused row, fails.
        let emb = Embedding::new(4, 5);
        let ids = [3u32, 1, 3, 0, 3, 1];
        let t = randn(20, 61);
        let r = randn(30, 62);
        let mut grads = vec![0.0; 20];
        emb.backward(&ids, &r, &mut grads).unwrap();
        let f = |a: &[Vec<f64>]| {
            let mut y = vec![0.0; 30];
            emb.forward(&a[0], &ids, &mut y).unwrap();
            y
        };
        assert_grads(&["weight"], &[t], &r, &f, &[grads]);
    }

    #[test]
    fn out_of_range_ids_are_errors_before_any_write_emb_3() {
        let emb = Embedding::new(4, 3);
        let mut y = vec![7.0; 12];
        let err = emb.forward(&table(), &[1, 3, 4, 0], &mut y).unwrap_err();
        match &err {
            ModelError::OutOfRange { index: 4, position: 2, len: 4, .. } => {}
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("index 4 at position 2"), "{err}");
        let mut grads = vec![7.0; 12];
        let err = emb.backward(&[0, 1, 2, u32::MAX], &DE, &mut grads).unwrap_err();
        assert!(
            matches!(err, ModelError::OutOfRange { index, position: 3, .. } if index == u32::MAX as u64),
            "{err:?}"
        );
        assert!(y.iter().chain(&grads).all(|&v| v == 7.0), "nothing written");
    }

    #[test]
    fn wrong_lengths_are_shape_errors_nn_4() {
        let emb = Embedding::new(4, 3);
        let mut y = vec![0.0; 12];
        let e1 = emb.forward(&table()[..11], &IDS, &mut y);
        let e2 = emb.forward(&table(), &IDS[..3], &mut y);
        let e3 = emb.backward(&IDS, &DE[..9], &mut y);
        let e4 = emb.backward(&IDS, &DE, &mut y[..9]);
        for e in [e1, e2, e3, e4] {
            assert!(matches!(e, Err(ModelError::Shape { .. })), "{e:?}");
        }
        // No ids: nothing to do, in either direction.
        emb.forward::<f64>(&table(), &[], &mut []).unwrap();
        emb.backward::<f64>(&[], &[], &mut y).unwrap();
    }
}
