//! One block's forward and backward: its layers in path order (main, shortcut, post), the
//! residual add, and a residual block's two last BatchNorms fused into one statistics
//! message each way (MODEL-2).

use std::ops::Range;

use super::{Block, BlockSaved, Ctx, Layer, LayerSaved, Node, Offsets};
use crate::batchnorm::{
    batchnorm_backward_fused, batchnorm_forward_fused, fused_results, BatchNorm, BnBackward,
    BnForward,
};
use crate::error::ModelError;
use crate::layers;
use crate::tensor::Tensor;

fn effective_bn(bn: &BatchNorm, ctx: &Ctx<'_>) -> BatchNorm {
    BatchNorm { sync: bn.sync || ctx.sync_bn, ..bn.clone() }
}

fn run_layer(
    block: &Block,
    node: &Node,
    p: &[f32],
    buf: &mut [f32],
    x: Tensor,
    ctx: &Ctx<'_>,
) -> Result<(Tensor, Option<LayerSaved>), ModelError> {
    let be = ctx.backend;
    Ok(match &node.layer {
        Layer::Linear(l) => {
            let (y, s) = l.forward(be, p, x)?;
            (y, Some(LayerSaved::Linear(s)))
        }
        Layer::Conv2d(c) => {
            let (y, s) = c.forward(be, p, x)?;
            (y, Some(LayerSaved::Conv(s)))
        }
        Layer::BatchNorm(bn) => {
            let name = format!("{}.{}", block.name, node.name);
            let bn = effective_bn(bn, ctx);
            let out = batchnorm_forward_fused(
                vec![BnForward { name: &name, layer: &bn, params: p, buffers: buf, input: x }],
                ctx.training,
                ctx.reducer,
            )?;
            let [(y, s)] = fused_results("batchnorm forward", out)?;
            (y, Some(LayerSaved::Bn(s)))
        }
        Layer::Relu => {
            let (y, s) = layers::relu_forward(be, x)?;
            (y, Some(LayerSaved::Relu(s)))
        }
        Layer::MaxPool2d(m) => {
            let (y, s) = m.forward(x)?;
            (y, Some(LayerSaved::MaxPool(s)))
        }
        Layer::GlobalAvgPool => {
            let (y, s) = layers::global_avg_pool_forward(x)?;
            (y, Some(LayerSaved::Shape(s)))
        }
        Layer::Flatten => {
            let (y, s) = layers::flatten_forward(x)?;
            (y, Some(LayerSaved::Shape(s)))
        }
    })
}

fn back_layer(
    node: &Node,
    p: &[f32],
    saved: &LayerSaved,
    g: Tensor,
    grads: &mut [f32],
    ctx: &Ctx<'_>,
) -> Result<Tensor, ModelError> {
    let be = ctx.backend;
    if ctx.overwrite_grads && !matches!(node.layer, Layer::Linear(_)) {
        // Only the linear layer writes in place of adding (its weight gradient is one
        // matrix multiply); for the others a zeroed region is the same thing.
        grads.fill(0.0);
    }
    match (&node.layer, saved) {
        (Layer::Linear(l), LayerSaved::Linear(s)) => {
            l.backward_into(be, p, s, &g, grads, !ctx.overwrite_grads)
        }
        (Layer::Conv2d(c), LayerSaved::Conv(s)) => c.backward(be, p, s, &g, grads),
        (Layer::BatchNorm(bn), LayerSaved::Bn(s)) => {
            let bn = effective_bn(bn, ctx);
            bn.backward(p, s, &g, grads, ctx.reducer)
        }
        (Layer::Relu, LayerSaved::Relu(s)) => layers::relu_backward(be, s, g),
        (Layer::MaxPool2d(m), LayerSaved::MaxPool(s)) => m.backward(s, &g),
        (Layer::GlobalAvgPool, LayerSaved::Shape(s)) => layers::global_avg_pool_backward(s, &g),
        (Layer::Flatten, LayerSaved::Shape(s)) => layers::flatten_backward(s, g),
        _ => Err(ModelError::Config(format!("saved state does not match layer {}", node.name))),
    }
}

fn last_bn(nodes: &[Node]) -> Option<usize> {
    nodes.iter().rposition(|n| matches!(n.layer, Layer::BatchNorm(_)))
}

/// One path of a block (main, shortcut or post): its nodes, and where its node 0 sits among
/// the block's nodes (the index into [`Offsets`]).
#[derive(Clone, Copy)]
pub(super) struct Path<'a> {
    nodes: &'a [Node],
    base: usize,
}

impl<'a> Path<'a> {
    pub(super) fn main(b: &'a Block) -> Self {
        Path { nodes: &b.main, base: 0 }
    }
    pub(super) fn shortcut(b: &'a Block) -> Self {
        Path { nodes: b.shortcut.as_deref().unwrap_or(&[]), base: b.main.len() }
    }
    pub(super) fn post(b: &'a Block) -> Self {
        let ns = b.shortcut.as_ref().map_or(0, Vec::len);
        Path { nodes: &b.post, base: b.main.len() + ns }
    }
}

/// One block's forward: the block, where its layers' parameters and buffers lie, the unit's
/// buffers it updates, and the call's context.
pub(super) struct BlockRun<'a, 'c> {
    pub(super) block: &'a Block,
    pub(super) off: &'a Offsets,
    pub(super) params: &'a [f32],
    pub(super) buffers: &'a mut [f32],
    pub(super) ctx: &'a Ctx<'c>,
}

impl BlockRun<'_, '_> {
    /// Runs `path.nodes[range]`, saving each layer's state into `saved` (the path's).
    fn path(
        &mut self,
        path: Path<'_>,
        range: Range<usize>,
        mut x: Tensor,
        saved: &mut [Option<LayerSaved>],
    ) -> Result<Tensor, ModelError> {
        for i in range {
            let k = path.base + i;
            let (y, s) = run_layer(
                self.block,
                &path.nodes[i],
                &self.params[self.off.params[k].clone()],
                &mut self.buffers[self.off.buffers[k].clone()],
                x,
                self.ctx,
            )?;
            saved[i] = s;
            x = y;
        }
        Ok(x)
    }

    pub(super) fn forward(mut self, x: Tensor) -> Result<(Tensor, BlockSaved), ModelError> {
        let (block, off, ctx) = (self.block, self.off, self.ctx);
        let (main, sc, post) = (Path::main(block), Path::shortcut(block), Path::post(block));
        let (nm, ns) = (main.nodes.len(), sc.nodes.len());
        let mut s = BlockSaved {
            main: vec![None; nm],
            shortcut: vec![None; ns],
            post: vec![None; block.post.len()],
            fused: None,
        };
        let sc_input = block.shortcut.as_ref().map(|_| x.clone());
        let fuse = match (last_bn(main.nodes), last_bn(sc.nodes)) {
            (Some(i), Some(j)) if ctx.training => Some((i, j)),
            _ => None,
        };
        let y = match (fuse, sc_input) {
            (Some((i, j)), Some(xs)) => {
                let a = self.path(main, 0..i, x, &mut s.main)?;
                let b = self.path(sc, 0..j, xs, &mut s.shortcut)?;
                let (ka, kb) = (i, nm + j);
                let (bn_a, bn_b) = match (&main.nodes[i].layer, &sc.nodes[j].layer) {
                    (Layer::BatchNorm(p), Layer::BatchNorm(q)) => {
                        (effective_bn(p, ctx), effective_bn(q, ctx))
                    }
                    _ => return Err(ModelError::Config("fusion points are not BatchNorm".into())),
                };
                let (na, nb) = (
                    format!("{}.{}", block.name, main.nodes[i].name),
                    format!("{}.{}", block.name, sc.nodes[j].name),
                );
                // The two BN layers' buffers are disjoint ranges of the unit's buffer.
                let (ra, rb) = (off.buffers[ka].clone(), off.buffers[kb].clone());
                let (lo, hi) = self.buffers.split_at_mut(rb.start);
                let out = batchnorm_forward_fused(
                    vec![
                        BnForward {
                            name: &na,
                            layer: &bn_a,
                            params: &self.params[off.params[ka].clone()],
                            buffers: &mut lo[ra],
                            input: a,
                        },
                        BnForward {
                            name: &nb,
                            layer: &bn_b,
                            params: &self.params[off.params[kb].clone()],
                            buffers: &mut hi[..rb.len()],
                            input: b,
                        },
                    ],
                    true,
                    ctx.reducer,
                )?;
                let [(ya, sa), (yb, sb)] = fused_results("fused batchnorm forward", out)?;
                s.main[i] = Some(LayerSaved::Bn(sa));
                s.shortcut[j] = Some(LayerSaved::Bn(sb));
                s.fused = Some((i, j));
                let a = self.path(main, i + 1..nm, ya, &mut s.main)?;
                let b = self.path(sc, j + 1..ns, yb, &mut s.shortcut)?;
                layers::add_forward(ctx.backend, a, &b)?
            }
            (_, Some(xs)) => {
                let a = self.path(main, 0..nm, x, &mut s.main)?;
                let b = self.path(sc, 0..ns, xs, &mut s.shortcut)?;
                layers::add_forward(ctx.backend, a, &b)?
            }
            (_, None) => self.path(main, 0..nm, x, &mut s.main)?,
        };
        let y = self.path(post, 0..block.post.len(), y, &mut s.post)?;
        Ok((y, s))
    }
}

/// One block's backward: where its layers' parameters lie, the unit's gradients it writes,
/// and the call's context.
pub(super) struct BlockBack<'a, 'c> {
    pub(super) off: &'a Offsets,
    pub(super) params: &'a [f32],
    pub(super) grads: &'a mut [f32],
    pub(super) ctx: &'a Ctx<'c>,
}

impl BlockBack<'_, '_> {
    /// Backward through `path.nodes[range]` in reverse, from the path's saved states.
    pub(super) fn path(
        &mut self,
        path: Path<'_>,
        range: Range<usize>,
        saved: &[Option<LayerSaved>],
        mut g: Tensor,
    ) -> Result<Tensor, ModelError> {
        for i in range.rev() {
            let k = path.base + i;
            let node = &path.nodes[i];
            let s = saved[i]
                .as_ref()
                .ok_or_else(|| ModelError::Config(format!("no saved state for {}", node.name)))?;
            let r = self.off.params[k].clone();
            g = back_layer(node, &self.params[r.clone()], s, g, &mut self.grads[r], self.ctx)?;
        }
        Ok(g)
    }

    pub(super) fn block(
        &mut self,
        block: &Block,
        s: &BlockSaved,
        g: Tensor,
    ) -> Result<Tensor, ModelError> {
        let (off, params, ctx) = (self.off, self.params, self.ctx);
        let (main, sc, post) = (Path::main(block), Path::shortcut(block), Path::post(block));
        let (nm, ns) = (main.nodes.len(), sc.nodes.len());
        let g = self.path(post, 0..block.post.len(), &s.post, g)?;
        if block.shortcut.is_none() {
            return self.path(main, 0..nm, &s.main, g);
        }
        let (ga, gb) = layers::add_backward(&g);
        let (mut ga, gb) = match s.fused {
            Some((i, j)) => {
                let ga = self.path(main, i + 1..nm, &s.main, ga)?;
                let gb = self.path(sc, j + 1..ns, &s.shortcut, gb)?;
                let (ka, kb) = (i, nm + j);
                let (bn_a, bn_b) = match (&main.nodes[i].layer, &sc.nodes[j].layer) {
                    (Layer::BatchNorm(p), Layer::BatchNorm(q)) => {
                        (effective_bn(p, ctx), effective_bn(q, ctx))
                    }
                    _ => return Err(ModelError::Config("fusion points are not BatchNorm".into())),
                };
                let (sa, sb) = match (&s.main[i], &s.shortcut[j]) {
                    (Some(LayerSaved::Bn(a)), Some(LayerSaved::Bn(b))) => (a, b),
                    _ => return Err(ModelError::Config("fused BatchNorm state missing".into())),
                };
                let (ra, rb) = (off.params[ka].clone(), off.params[kb].clone());
                if ctx.overwrite_grads {
                    self.grads[ra.clone()].fill(0.0);
                    self.grads[rb.clone()].fill(0.0);
                }
                let (lo, hi) = self.grads.split_at_mut(rb.start);
                let out = batchnorm_backward_fused(
                    vec![
                        BnBackward {
                            layer: &bn_a,
                            params: &params[ra.clone()],
                            saved: sa,
                            grad_output: &ga,
                            grads_out: &mut lo[ra],
                        },
                        BnBackward {
                            layer: &bn_b,
                            params: &params[rb.clone()],
                            saved: sb,
                            grad_output: &gb,
                            grads_out: &mut hi[..rb.len()],
                        },
                    ],
                    ctx.reducer,
                )?;
                let [ga, gb] = fused_results("fused batchnorm backward", out)?;
                (self.path(main, 0..i, &s.main, ga)?, self.path(sc, 0..j, &s.shortcut, gb)?)
            }
            None => (self.path(main, 0..nm, &s.main, ga)?, self.path(sc, 0..ns, &s.shortcut, gb)?),
        };
        ctx.backend.axpy(1.0, gb.as_f32()?, ga.as_f32_mut()?)?;
        Ok(ga)
    }
}
