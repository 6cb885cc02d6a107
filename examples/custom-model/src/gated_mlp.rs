//! The SiLU-gated MLP of LLaMA-style transformers (SwiGLU): `w2(silu(w1 x) * w3 x)`.

use shardline_models::module::{
    numel, unsave, Activation, Buffers, Grads, Linear, Module, Param, Params, Saved,
};
use shardline_models::{Ctx, ModelError, Tensor};
use std::ops::Range;

/// `w2(silu(w1 x) * w3 x)` over the last dimension, without biases: `w1` (the gate) and
/// `w3` (the value) map `dim -> hidden`, `w2` maps `hidden -> dim`.
#[derive(Clone, Debug, PartialEq)]
pub struct GatedMlp {
    /// The gate projection, `dim -> hidden`.
    pub w1: Linear,
    /// The output projection, `hidden -> dim`.
    pub w2: Linear,
    /// The value projection, `dim -> hidden`.
    pub w3: Linear,
}

impl GatedMlp {
    /// `dim -> hidden -> dim`, torch's default initialisation.
    pub fn new(dim: usize, hidden: usize) -> Self {
        GatedMlp {
            w1: Linear::new(dim, hidden, false),
            w2: Linear::new(hidden, dim, false),
            w3: Linear::new(dim, hidden, false),
        }
    }

    /// Where `w1`, `w2` and `w3` lie in the flat parameters (the order of `params()`).
    fn ranges(&self) -> [Range<usize>; 3] {
        let (a, b, c) =
            (numel(&self.w1.params()), numel(&self.w2.params()), numel(&self.w3.params()));
        [0..a, a..a + b, a + b..a + b + c]
    }
}

/// What backward needs: each projection's own saved state, and both branches' outputs
/// (the product's derivative in one is the other).
struct GatedSaved {
    w1: Saved,
    w2: Saved,
    w3: Saved,
    silu: Saved,
    gate: Tensor,
    value: Tensor,
}

impl Module for GatedMlp {
    fn params(&self) -> Vec<Param> {
        let named = [("w1", &self.w1), ("w2", &self.w2), ("w3", &self.w3)];
        named
            .into_iter()
            .flat_map(|(n, l)| l.params().into_iter().map(move |p| p.prefixed(n)))
            .collect()
    }

    fn forward(
        &self,
        p: Params<'_>,
        _: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        let [r1, r2, r3] = self.ranges();
        let (a, w1) = self.w1.forward(p.slice(r1)?, Buffers::none(), x.clone(), ctx)?;
        let (value, w3) = self.w3.forward(p.slice(r3)?, Buffers::none(), x, ctx)?;
        let (gate, silu) =
            Module::forward(&Activation::Silu, Params::new(&[]), Buffers::none(), a, ctx)?;
        let h: Vec<f32> = gate.as_f32()?.iter().zip(value.as_f32()?).map(|(g, v)| g * v).collect();
        let h = Tensor::new(gate.shape().to_vec(), h)?;
        let (y, w2) = self.w2.forward(p.slice(r2)?, Buffers::none(), h, ctx)?;
        Ok((y, Box::new(GatedSaved { w1, w2, w3, silu, gate, value })))
    }

    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let s: GatedSaved = unsave(saved, "GatedMlp")?;
        let [r1, r2, r3] = self.ranges();
        let dh = self.w2.backward(p.slice(r2.clone())?, s.w2, dy, g.slice(r2)?, ctx)?;
        let (dh, gate, value) = (dh.as_f32()?, s.gate.as_f32()?, s.value.as_f32()?);
        let shape = s.gate.shape().to_vec();
        let dgate = dh.iter().zip(value).map(|(d, v)| d * v).collect();
        let dvalue = dh.iter().zip(gate).map(|(d, g)| d * g).collect();
        let da = Module::backward(
            &Activation::Silu,
            Params::new(&[]),
            s.silu,
            Tensor::new(shape.clone(), dgate)?,
            Grads::new(&mut []),
            ctx,
        )?;
        let mut dx = self.w1.backward(p.slice(r1.clone())?, s.w1, da, g.slice(r1)?, ctx)?;
        let dx3 = self.w3.backward(
            p.slice(r3.clone())?,
            s.w3,
            Tensor::new(shape, dvalue)?,
            g.slice(r3)?,
            ctx,
        )?;
        dx.as_f32_mut()?.iter_mut().zip(dx3.as_f32()?).for_each(|(a, b)| *a += b);
        Ok(dx)
    }
}
