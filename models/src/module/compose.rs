//! Composition: a sequence of named children, and a residual connection.

use std::ops::Range;

use super::{numel, unsave, Buffers, Grads, Module, Param, Params, Saved};
use crate::error::ModelError;
use crate::lower::{Lowering, Val};
use crate::model::Ctx;
use crate::tensor::Tensor;

/// Children run in order; child `name`'s parameters are named `name.<param>` (MODULE-3; an
/// empty name adds no prefix, for a child that is only structure, like a residual).
#[derive(Debug, Default)]
pub struct Sequential {
    children: Vec<(String, Box<dyn Module>)>,
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Self {
        Sequential::default()
    }

    /// Appends `module` as child `name`.
    pub fn push(mut self, name: &str, module: impl Module + 'static) -> Self {
        self.children.push((name.to_string(), Box::new(module)));
        self
    }

    /// Appends a boxed `module` as child `name`.
    pub fn push_boxed(mut self, name: &str, module: Box<dyn Module>) -> Self {
        self.children.push((name.to_string(), module));
        self
    }

    /// The children, in order.
    pub fn children(&self) -> &[(String, Box<dyn Module>)] {
        &self.children
    }
}

impl Module for Sequential {
    fn params(&self) -> Vec<Param> {
        self.children
            .iter()
            .flat_map(|(n, m)| m.params().into_iter().map(move |p| p.prefixed(n)))
            .collect()
    }

    fn buffers(&self) -> Vec<Param> {
        self.children
            .iter()
            .flat_map(|(n, m)| m.buffers().into_iter().map(move |p| p.prefixed(n)))
            .collect()
    }

    fn forward(
        &self,
        p: Params<'_>,
        b: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        forward_children(&self.children, p, b, x, ctx)
    }

    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        backward_children(&self.children, p, saved, dy, g, ctx)
    }

    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        lower_children(&self.children, l, at, x)
    }
}

/// Per child, where its parameters and buffers lie in the views of the whole run.
fn child_ranges(children: &[(String, Box<dyn Module>)]) -> Vec<(Range<usize>, Range<usize>)> {
    let (mut p, mut b) = (0, 0);
    children
        .iter()
        .map(|(_, m)| {
            let (np, nb) = (numel(&m.params()), numel(&m.buffers()));
            let r = (p..p + np, b..b + nb);
            p += np;
            b += nb;
            r
        })
        .collect()
}

/// Runs `children` in order over their slices of `p` and `b` (a [`Sequential`], or a
/// network's unit of several top-level children); saves each child's state.
pub(crate) fn forward_children(
    children: &[(String, Box<dyn Module>)],
    p: Params<'_>,
    mut b: Buffers<'_>,
    mut x: Tensor,
    ctx: &Ctx,
) -> Result<(Tensor, Saved), ModelError> {
    let mut saved = Vec::with_capacity(children.len());
    for ((_, m), (rp, rb)) in children.iter().zip(child_ranges(children)) {
        let (y, s) = m.forward(p.slice(rp)?, b.slice(rb)?, x, ctx)?;
        saved.push(s);
        x = y;
    }
    Ok((x, Box::new(saved)))
}

/// [`forward_children`] as device ops: each child lowered over its slice of the parameters
/// and of the buffers ([`Lowering::buffers_at`]).
pub(crate) fn lower_children(
    children: &[(String, Box<dyn Module>)],
    l: &mut Lowering,
    at: usize,
    mut x: Val,
) -> Result<Val, ModelError> {
    let base = l.buffers_at();
    for ((_, m), (rp, rb)) in children.iter().zip(child_ranges(children)) {
        l.set_buffers_at(base + rb.start);
        x = m.lower(l, at + rp.start, x)?;
    }
    l.set_buffers_at(base);
    Ok(x)
}

/// The backward of [`forward_children`], children in reverse; returns the input gradient.
pub(crate) fn backward_children(
    children: &[(String, Box<dyn Module>)],
    p: Params<'_>,
    saved: Saved,
    mut dy: Tensor,
    mut g: Grads<'_>,
    ctx: &Ctx,
) -> Result<Tensor, ModelError> {
    let mut saved: Vec<Saved> = unsave(saved, "Sequential")?;
    for ((_, m), (rp, _)) in children.iter().zip(child_ranges(children)).rev() {
        let s = saved.pop().ok_or_else(|| ModelError::Config("Sequential: saved".into()))?;
        dy = m.backward(p.slice(rp.clone())?, s, dy, g.slice(rp)?, ctx)?;
    }
    Ok(dy)
}

/// `f(x) + x`, or `f(x) + shortcut(x)`: the residual connection of a transformer block, or
/// of a ResNet block whose shortcut changes the shape (torchvision's `downsample`).
#[derive(Debug)]
pub struct Residual {
    inner: Box<dyn Module>,
    /// The shortcut's name (its parameters' prefix) and module; `None`: the identity.
    shortcut: Option<(String, Box<dyn Module>)>,
}

impl Residual {
    /// `x + inner(x)`.
    pub fn new(inner: impl Module + 'static) -> Self {
        Residual { inner: Box::new(inner), shortcut: None }
    }

    /// `inner(x) + shortcut(x)`, the shortcut's parameters and buffers after the inner
    /// path's, named `name.<param>` (MODULE-3).
    pub fn with_shortcut(
        inner: impl Module + 'static,
        name: &str,
        shortcut: impl Module + 'static,
    ) -> Self {
        Residual { inner: Box::new(inner), shortcut: Some((name.to_string(), Box::new(shortcut))) }
    }

    /// Where the inner path's parameters and buffers end in the views.
    fn split(&self) -> (usize, usize) {
        (numel(&self.inner.params()), numel(&self.inner.buffers()))
    }
}

fn add_into(a: &mut Tensor, b: &Tensor) -> Result<(), ModelError> {
    if a.shape() != b.shape() {
        return Err(ModelError::shape(
            "residual add",
            format!("{:?}", a.shape()),
            format!("{:?}", b.shape()),
        ));
    }
    let bv = b.as_f32()?;
    for (x, y) in a.as_f32_mut()?.iter_mut().zip(bv) {
        *x += y;
    }
    Ok(())
}

impl Module for Residual {
    fn params(&self) -> Vec<Param> {
        let mut v = self.inner.params();
        if let Some((n, m)) = &self.shortcut {
            v.extend(m.params().into_iter().map(|p| p.prefixed(n)));
        }
        v
    }

    fn buffers(&self) -> Vec<Param> {
        let mut v = self.inner.buffers();
        if let Some((n, m)) = &self.shortcut {
            v.extend(m.buffers().into_iter().map(|p| p.prefixed(n)));
        }
        v
    }

    fn forward(
        &self,
        p: Params<'_>,
        mut b: Buffers<'_>,
        x: Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, Saved), ModelError> {
        // The clones share `x`'s values (TENSOR-3): the branch's first layer may keep it for
        // its backward, and no copy is made.
        let Some((_, sc)) = &self.shortcut else {
            let (mut y, s) = self.inner.forward(p, b, x.clone(), ctx)?;
            add_into(&mut y, &x)?;
            return Ok((y, s));
        };
        let (np, nb) = self.split();
        let nb_all = nb + numel(&sc.buffers());
        let (mut y, s) = self.inner.forward(p.slice(0..np)?, b.slice(0..nb)?, x.clone(), ctx)?;
        let (short, ss) = sc.forward(p.slice(np..p.len())?, b.slice(nb..nb_all)?, x, ctx)?;
        add_into(&mut y, &short)?;
        Ok((y, Box::new((s, ss))))
    }

    fn backward(
        &self,
        p: Params<'_>,
        saved: Saved,
        dy: Tensor,
        mut g: Grads<'_>,
        ctx: &Ctx,
    ) -> Result<Tensor, ModelError> {
        let Some((_, sc)) = &self.shortcut else {
            let mut dx = self.inner.backward(p, saved, dy.clone(), g, ctx)?;
            add_into(&mut dx, &dy)?;
            return Ok(dx);
        };
        let (s, ss): (Saved, Saved) = unsave(saved, "Residual")?;
        let (np, n) = (self.split().0, p.len());
        let mut dx = self.inner.backward(p.slice(0..np)?, s, dy.clone(), g.slice(0..np)?, ctx)?;
        let dshort = sc.backward(p.slice(np..n)?, ss, dy, g.slice(np..n)?, ctx)?;
        add_into(&mut dx, &dshort)?;
        Ok(dx)
    }

    /// `y = f(x) + x` (or `f(x) + shortcut(x)`) as the host adds, the shortcut's buffers
    /// after the inner module's.
    fn lower(&self, l: &mut Lowering, at: usize, x: Val) -> Result<Val, ModelError> {
        let base = l.buffers_at();
        let (np, nb) = self.split();
        let inner = |l: &mut Lowering, x: Val| {
            l.set_buffers_at(base);
            self.inner.lower(l, at, x)
        };
        let shortcut = self.shortcut.as_ref().map(|(_, sc)| {
            Box::new(move |l: &mut Lowering, x: Val| {
                l.set_buffers_at(base + nb);
                sc.lower(l, at + np, x)
            }) as crate::lower::layers::Branch<'_>
        });
        let y = crate::lower::layers::residual(l, x, inner, shortcut);
        l.set_buffers_at(base);
        y
    }
}
