//! The model's root: token and position embeddings in; the final RMSNorm and the output
//! head, tied to the token embedding, out.

use shardline_models::module::{
    numel, unsave, Buffers, Embedding, Grads, Linear, Module, Param, Params, RmsNorm, RootModule,
    Saved,
};
use shardline_models::{Ctx, ModelError, Tensor};
use std::ops::Range;

/// Token embedding `wte [vocab, dim]` plus a learned position embedding `wpe [block, dim]`
/// before the body; after it, `norm` and logits `x @ wte^T`. Being a [`RootModule`], its
/// parameters form one unit used first and last, so the head's gradient and the
/// embedding's are summed into `wte` before it is reduced.
#[derive(Clone, Debug, PartialEq)]
pub struct TiedEmbedding {
    wte: Embedding,
    block: usize,
    norm: RmsNorm,
}

impl TiedEmbedding {
    /// `vocab` tokens of width `dim`, contexts of up to `block` tokens, embeddings started
    /// from a normal of std `std`.
    pub fn new(vocab: usize, dim: usize, block: usize, std: f32) -> Self {
        TiedEmbedding { wte: Embedding::new(vocab, dim, std), block, norm: RmsNorm::new(dim, 1e-5) }
    }

    fn dim(&self) -> usize {
        self.wte.table.dim
    }

    /// The head reads `wte` as a bias-free Linear `dim -> vocab` (torch's `[out, in]`).
    fn head(&self) -> Linear {
        Linear::new(self.dim(), self.wte.table.vocab, false)
    }

    /// Where `wte`, `wpe` and `norm` lie in the flat parameters.
    fn ranges(&self) -> [Range<usize>; 3] {
        let v = numel(&self.wte.params());
        let b = self.block * self.dim();
        [0..v, v..v + b, v + b..v + b + self.dim()]
    }
}

impl RootModule for TiedEmbedding {
    fn params(&self) -> Vec<Param> {
        let mut v: Vec<Param> = self.wte.params().into_iter().map(|p| p.prefixed("wte")).collect();
        v.push(Param::new("wpe.weight", vec![self.block, self.dim()], self.wte.init));
        v.extend(self.norm.params().into_iter().map(|p| p.prefixed("norm")));
        v
    }

    fn forward_in(
        &self,
        p: Params<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let t = match x.shape() {
            &[_, t] if (1..=self.block).contains(&t) => t,
            s => {
                return Err(ModelError::Config(format!(
                    "tokens: want [batch, seq] with seq <= {}, got {s:?}",
                    self.block
                )))
            }
        };
        let [wte, wpe, _] = self.ranges();
        let (mut y, saved) = self.wte.forward(p.slice(wte)?, Buffers::none(), x, ctx)?;
        let (e, pos) = (self.dim(), p.slice(wpe)?.f32()?);
        for (i, row) in y.as_f32_mut()?.chunks_exact_mut(e).enumerate() {
            let at = (i % t) * e;
            row.iter_mut().zip(&pos[at..at + e]).for_each(|(a, w)| *a += w);
        }
        Ok((y, Box::new((saved, t))))
    }

    fn backward_in(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<(), ModelError> {
        let (saved, t): (Saved, usize) = unsave(saved, "TiedEmbedding (in)")?;
        let [wte, wpe, _] = self.ranges();
        let e = self.dim();
        let mut gp = g.slice(wpe)?;
        let gp = gp.f32_mut()?;
        for (i, row) in dy.as_f32()?.chunks_exact(e).enumerate() {
            let at = (i % t) * e;
            gp[at..at + e].iter_mut().zip(row).for_each(|(a, d)| *a += d);
        }
        self.wte.backward(p.slice(wte.clone())?, saved, dy, g.slice(wte)?, ctx)?;
        Ok(())
    }

    fn forward_out(
        &self,
        p: Params<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let [wte, _, norm] = self.ranges();
        let (h, n) = self.norm.forward(p.slice(norm)?, Buffers::none(), x, ctx)?;
        let (logits, head) = self.head().forward(p.slice(wte)?, Buffers::none(), h, ctx)?;
        Ok((logits, Box::new((n, head))))
    }

    fn backward_out(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let (n, head): (Saved, Saved) = unsave(saved, "TiedEmbedding (out)")?;
        let [wte, _, norm] = self.ranges();
        let dh = self.head().backward(p.slice(wte.clone())?, head, dy, g.slice(wte)?, ctx)?;
        self.norm.backward(p.slice(norm.clone())?, n, dh, g.slice(norm)?, ctx)
    }
}
