//! The lowering of the convolutional layers and of the zoo's block models: convolution,
//! max and global average pooling, flatten, BatchNorm (SyncBatchNorm's statistics as a
//! collective of the program, on the layer's exact route: `f64` statistics, records merged
//! in rank order, the backward's sums added in f32 in rank order), and a block's
//! `post(main(x) + shortcut(x))`.

use std::cell::RefCell;
use std::rc::Rc;

use super::{Buf, Exec, Lowering, Val};
use crate::batchnorm::{BatchNorm, BnKind, STATS_RECORD};
use crate::conv::Conv2d;
use crate::error::ModelError;
use crate::layers::MaxPool2d;
use crate::model::{Block, Layer, Model};
use crate::ops::{BnDims, ConvDims, Op, PoolDims};

fn nchw(what: &str, x: &Val) -> Result<(usize, usize, usize, usize), ModelError> {
    match x.shape[..] {
        [n, c, h, w] => Ok((n, c, h, w)),
        _ => Err(ModelError::shape(what, "[N, C, H, W]", format!("{:?}", x.shape))),
    }
}

/// A convolution with its parameters at `at`.
pub(crate) fn conv2d(
    l: &mut Lowering,
    conv: &Conv2d,
    at: usize,
    x: Val,
) -> Result<Val, ModelError> {
    let (n, c, h, w) = nchw("conv2d input", &x)?;
    if c != conv.in_channels {
        let want = format!("[N, {}, H, W]", conv.in_channels);
        return Err(ModelError::shape("conv2d input", want, format!("{:?}", x.shape)));
    }
    let d = ConvDims { conv: conv.clone(), n, h, w };
    let params = Buf::Params { at, len: conv.num_params() };
    let y = l.value(&[n, conv.out_channels, conv.out_size(h), conv.out_size(w)]);
    l.op(Op::Conv2dForward(d.clone()), &[params, x.buf], &[y.buf]);
    l.on_backward(move |l, dy| {
        let dx = l.value(&x.shape);
        let grads = Buf::Grads { at, len: d.conv.num_params() };
        l.op(Op::Conv2dBackward(d), &[params, x.buf, dy.buf], &[grads, dx.buf]);
        Ok(Some(dx))
    });
    Ok(y)
}

/// Max pooling.
pub(crate) fn max_pool(l: &mut Lowering, pool: &MaxPool2d, x: Val) -> Result<Val, ModelError> {
    let (n, c, h, w) = nchw("maxpool input", &x)?;
    let d = PoolDims { pool: pool.clone(), n, c, h, w };
    let shape = [n, c, pool.out_size(h), pool.out_size(w)];
    let (y, argmax) = (l.value(&shape), l.value(&shape));
    l.op(Op::MaxPoolForward(d.clone()), &[x.buf], &[y.buf, argmax.buf]);
    l.on_backward(move |l, dy| {
        let dx = l.value(&x.shape);
        l.op(Op::MaxPoolBackward(d), &[argmax.buf, dy.buf], &[dx.buf]);
        Ok(Some(dx))
    });
    Ok(y)
}

/// Global average pooling `[N, C, H, W] -> [N, C]`.
pub(crate) fn global_avg_pool(l: &mut Lowering, x: Val) -> Result<Val, ModelError> {
    let (n, c, h, w) = nchw("global avg pool input", &x)?;
    let d = BnDims { n, c, s: h * w };
    let y = l.value(&[n, c]);
    l.op(Op::GlobalAvgPool(d), &[x.buf], &[y.buf]);
    l.on_backward(move |l, dy| {
        let dx = l.value(&x.shape);
        l.op(Op::GlobalAvgPoolBackward(d), &[dy.buf], &[dx.buf]);
        Ok(Some(dx))
    });
    Ok(y)
}

/// `[N, ...] -> [N, prod]`: the same buffer, reshaped both ways.
pub(crate) fn flatten(l: &mut Lowering, x: Val) -> Val {
    let shape = x.shape.clone();
    l.on_backward(move |_, dy| Ok(Some(Val { shape, ..dy })));
    let rest = x.shape.iter().skip(1).product();
    Val { shape: vec![x.shape.first().copied().unwrap_or(0), rest], ..x }
}

/// BatchNorm with its parameters at `at` and its buffers at `buffers`: evaluation with the
/// running statistics, or training with the batch's, reduced over the ranks when the layer
/// (or the context) syncs and the context has ranks.
pub(crate) fn batchnorm(
    l: &mut Lowering,
    bn: &BatchNorm,
    (at, buffers): (usize, usize),
    x: Val,
) -> Result<Val, ModelError> {
    let c = bn.num_features;
    let ok = match bn.kind {
        BnKind::D1 => matches!(x.shape.len(), 2 | 3),
        BnKind::D2 => x.shape.len() == 4,
    };
    if !ok || x.shape.get(1) != Some(&c) {
        return Err(ModelError::shape(
            "batchnorm input",
            format!("[N, {c}, ..]"),
            format!("{:?}", x.shape),
        ));
    }
    let d = BnDims { n: x.shape[0], c, s: x.shape[2..].iter().product() };
    let params = Buf::Params { at, len: 2 * c };
    let bufs = Buf::Buffers { at: buffers, len: 2 * c + 1 };
    let y = l.value(&x.shape);
    let ctx = l.ctx();
    if !ctx.training {
        l.op(Op::BatchNormEval { dims: d, eps: bn.eps }, &[x.buf, params, bufs], &[y.buf]);
        return Ok(y);
    }
    let world = if (bn.sync || ctx.sync_bn) && ctx.world > 1 { ctx.world } else { 1 };
    let mut stats = l.value(&[6 * c]);
    l.op(Op::BatchNormLocalStats(d), &[x.buf], &[stats.buf]);
    if world > 1 {
        let records = l.value(&[STATS_RECORD * c]);
        l.op(Op::BatchNormEncode { c }, &[stats.buf], &[records.buf]);
        let all = l.value(&[world * STATS_RECORD * c]);
        l.exec(Exec::AllGather { world }, &[records.buf], &[all.buf]);
        stats = l.value(&[6 * c]);
        l.op(Op::BatchNormMerge { c, world }, &[all.buf], &[stats.buf]);
    }
    let (xhat, invstd, count) = (l.value(&x.shape), l.value(&[c]), l.value(&[2]));
    let op = Op::BatchNormTrain { dims: d, eps: bn.eps, momentum: bn.momentum };
    let writes = [y.buf, xhat.buf, invstd.buf, count.buf, bufs];
    l.op(op, &[x.buf, params, stats.buf], &writes);
    l.on_backward(move |l, dy| {
        let mut sums = l.value(&[4 * c]);
        let grads = Buf::Grads { at, len: 2 * c };
        l.op(Op::BatchNormGradSums(d), &[dy.buf, xhat.buf], &[sums.buf, grads]);
        if world > 1 {
            // As SyncBatchNorm sends them: f32, summed in rank order.
            let (mine, all) = (l.value(&[2 * c]), l.value(&[2 * c]));
            l.op(Op::F64ToF32, &[sums.buf], &[mine.buf]);
            l.exec(Exec::AllReduce, &[mine.buf], &[all.buf]);
            sums = l.value(&[4 * c]);
            l.op(Op::F32ToF64, &[all.buf], &[sums.buf]);
        }
        let dx = l.value(&x.shape);
        let reads = [params, xhat.buf, invstd.buf, sums.buf, count.buf, dy.buf];
        l.op(Op::BatchNormGradDx(d), &reads, &[dx.buf]);
        Ok(Some(dx))
    });
    Ok(y)
}

/// A branch of a residual block, lowered when called.
pub(crate) type Branch<'a> = Box<dyn FnOnce(&mut Lowering, Val) -> Result<Val, ModelError> + 'a>;

/// `f(x) + g(x)` (`g` the identity when `None`): the gradient of each branch added, the
/// branches' backwards run as the tape orders them (the shortcut's first).
pub(crate) fn residual(
    l: &mut Lowering,
    x: Val,
    main: impl FnOnce(&mut Lowering, Val) -> Result<Val, ModelError>,
    shortcut: Option<Branch<'_>>,
) -> Result<Val, ModelError> {
    let (dy_kept, dsc_kept) =
        (Rc::new(RefCell::new(None::<Val>)), Rc::new(RefCell::new(None::<Val>)));
    let (k1, k2) = (Rc::clone(&dsc_kept), Rc::clone(&dy_kept));
    l.on_backward(move |l, dmain| {
        let dsc = k1.borrow_mut().take().ok_or_else(|| Lowering::unlowered("residual"))?;
        let out = l.value(&dmain.shape);
        l.op(Op::Add, &[dmain.buf, dsc.buf], &[out.buf]);
        Ok(Some(out))
    });
    let a = main(l, x.clone())?;
    l.on_backward(move |_, dsc| {
        *dsc_kept.borrow_mut() = Some(dsc);
        let dy = k2.borrow_mut().take().ok_or_else(|| Lowering::unlowered("residual"))?;
        Ok(Some(dy))
    });
    let b = match shortcut {
        Some(f) => f(l, x)?,
        None => x,
    };
    if a.shape != b.shape {
        let (want, got) = (format!("{:?}", a.shape), format!("{:?}", b.shape));
        return Err(ModelError::shape("residual add", want, got));
    }
    l.on_backward(move |_, dy| {
        *dy_kept.borrow_mut() = Some(dy.clone());
        Ok(Some(dy))
    });
    let y = l.value(&a.shape);
    l.op(Op::Add, &[a.buf, b.buf], &[y.buf]);
    Ok(y)
}

/// One zoo layer with its parameters at `p` and buffers at `b`.
fn layer(
    l: &mut Lowering,
    layer: &Layer,
    (p, b): (usize, usize),
    x: Val,
) -> Result<Val, ModelError> {
    use crate::module::Module;
    match layer {
        Layer::Linear(lin) => {
            crate::module::Linear::new(lin.in_features, lin.out_features, lin.bias).lower(l, p, x)
        }
        Layer::Relu => crate::module::Relu.lower(l, p, x),
        Layer::Flatten => Ok(flatten(l, x)),
        Layer::Conv2d(c) => conv2d(l, c, p, x),
        Layer::MaxPool2d(m) => max_pool(l, m, x),
        Layer::GlobalAvgPool => global_avg_pool(l, x),
        Layer::BatchNorm(bn) => batchnorm(l, bn, (p, b), x),
    }
}

/// Lowers `nodes` in order from the offsets `at`; returns the output and the offsets after.
fn path(
    l: &mut Lowering,
    nodes: &[crate::model::Node],
    mut at: (usize, usize),
    mut x: Val,
) -> Result<(Val, (usize, usize)), ModelError> {
    for n in nodes {
        x = layer(l, &n.layer, at, x)?;
        at = (at.0 + n.layer.num_params(), at.1 + n.layer.num_buffers());
    }
    Ok((x, at))
}

/// The zoo model's unit `unit`: its blocks in order, each `post(main(x) + shortcut(x))`.
pub(crate) fn zoo_unit(
    model: &Model,
    unit: usize,
    l: &mut Lowering,
    x: Val,
) -> Result<Val, ModelError> {
    let mut at = (0, 0);
    let mut x = x;
    for b in model.unit_blocks(unit)? {
        let Block { main, shortcut, post, .. } = b;
        let (mut after_main, mut after_sc) = (at, at);
        x = match shortcut {
            None => {
                let (y, next) = path(l, main, at, x)?;
                after_sc = next;
                y
            }
            Some(sc) => {
                let main_at = at;
                let y = residual(
                    l,
                    x,
                    |l, x| {
                        let (y, next) = path(l, main, main_at, x)?;
                        after_main = next;
                        Ok(y)
                    },
                    Some(Box::new(|l: &mut Lowering, x: Val| {
                        let start = main.iter().fold(main_at, |a, n| {
                            (a.0 + n.layer.num_params(), a.1 + n.layer.num_buffers())
                        });
                        let (y, next) = path(l, sc, start, x)?;
                        after_sc = next;
                        Ok(y)
                    })),
                )?;
                let _ = after_main;
                y
            }
        };
        let (y, next) = path(l, post, after_sc, x)?;
        at = next;
        x = y;
    }
    Ok(x)
}
