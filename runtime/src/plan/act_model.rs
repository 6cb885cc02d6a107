//! `gpt`'s activations counted from its shape, for models too large to run one microbatch
//! on this host (ACTEST-1 runs one; at 13B parameters that is 100 GB of host memory).
//!
//! With `R = microbatch x block_size` rows, width `C`, `H` heads, `L` blocks and a
//! vocabulary of `V`, every tensor is `f32` (4 bytes) and the kernels keep per row:
//! - a block: `16C + H` values (ln_1 and its statistics' inputs, the fused q/k/v rows, the
//!   attention output and its per-head row statistics, ln_2, the MLP's `4C` hidden rows
//!   before and after GELU, the two residual sums);
//! - the root: `2C` for the embeddings' sum and ln_f, `2V + 2` for the logits, their
//!   softmax and the loss's per-row values.
//!
//! Without recomputation the peak is the end of the forward pass, everything kept:
//! `4R (L (16C + H) + 2C + 2V + 2)` bytes. With `--recompute units` every block keeps only its
//! input (`C` per row); the peak is the larger of the root's last call with every block's
//! input, `4R (LC + 2C + 2V + 2)`, and one block re-run during backward with every input and
//! the gradient flowing back, `4R (LC + 16C + H + C + 2)`.
//!
//! Each call's tensor traffic (what `cost` charges as elementwise work) is taken as the
//! values it keeps, forward and again backward; kernels' scratch (the host's packing
//! buffers) is not modelled at scale.
//!
//! Invariant:
//! - PLAN-9: the counted activations are the bytes one microbatch run on this host
//!   registers (ACTEST-1), with and without recomputation.

use shardline_models::nn::GptConfig;

use crate::engine::Recompute;

/// Values per row of one block's kept tensors.
fn block_values(g: &GptConfig) -> u64 {
    16 * g.n_embd as u64 + g.n_head as u64
}

/// Values per row the root keeps: the embeddings' sum and ln_f, the logits, their softmax
/// and the loss's per-row values.
fn root_values(g: &GptConfig) -> u64 {
    2 * g.n_embd as u64 + 2 * g.vocab_size as u64 + 2
}

/// Peak bytes of activations of one microbatch of `samples` sequences (PLAN-9).
pub fn gpt_activations(g: &GptConfig, samples: usize, recompute: Recompute) -> u64 {
    let rows = (samples * g.block_size) as u64;
    let (l, c) = (g.n_layer as u64, g.n_embd as u64);
    let values = match recompute {
        Recompute::None => l * block_values(g) + root_values(g),
        Recompute::Units => (l * c + root_values(g)).max(l * c + block_values(g) + c + 2),
    };
    4 * rows * values
}

/// Per call of the forward pass (the root, each block, the root again), the bytes its
/// forward and its backward make: the values it keeps, both ways.
pub fn gpt_traffic(g: &GptConfig, samples: usize) -> Vec<(u64, u64)> {
    let rows = (samples * g.block_size) as u64;
    let c = g.n_embd as u64;
    let first = 4 * rows * c;
    let block = 4 * rows * block_values(g);
    let last = 4 * rows * (root_values(g) - c);
    let mut v = vec![(first, first)];
    v.extend(std::iter::repeat_n((block, block), g.n_layer));
    v.push((last, last));
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::TrainConfig;

    /// PLAN-9: at small sizes the formula is the host probe's activation peak, with and
    /// without recomputation, across layers, heads, widths, contexts, vocabularies and
    /// microbatches.
    #[test]
    fn counted_activations_are_the_probes_plan_9() {
        let shapes = [
            (2, 2, 32, 16, 4, None),
            (4, 2, 32, 16, 4, None),
            (2, 4, 32, 16, 8, None),
            (3, 4, 48, 24, 4, None),
            (2, 2, 64, 32, 4, Some(300)),
            (1, 2, 16, 8, 2, Some(1024)),
        ];
        for (l, h, c, t, batch, vocab) in shapes {
            for recompute in [Recompute::None, Recompute::Units] {
                let cfg = TrainConfig {
                    model: "gpt".into(),
                    dataset: "text".into(),
                    world: 1,
                    batch_size: batch,
                    n_layer: Some(l),
                    n_head: Some(h),
                    n_embd: Some(c),
                    block_size: Some(t),
                    vocab_size: vocab,
                    recompute,
                    ..TrainConfig::default()
                };
                let job = crate::train::plan(&cfg).unwrap();
                let probe =
                    crate::activations::activation_peaks(&*job.model, &job.train, &cfg).unwrap();
                let g = job.gpt.as_ref().unwrap();
                let counted = gpt_activations(g, batch, recompute);
                assert_eq!(
                    counted, probe.activations,
                    "{l} {h} {c} {t} {batch} {vocab:?} {recompute:?}"
                );
                assert_eq!(gpt_traffic(g, batch).len(), job.model.calls().len());
            }
        }
    }
}
