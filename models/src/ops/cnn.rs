//! The length rules (OPS-1) and host references (OPS-2) of the convolutional models' ops:
//! convolution, max and global average pooling, and BatchNorm on the exact route the layer
//! takes (its statistics in `f64`, SyncBatchNorm's records merged in rank order). Each host
//! reference calls the layer's own code: [`Conv2d`](crate::conv::Conv2d),
//! [`MaxPool2d`](crate::layers::MaxPool2d), [`crate::layers`]' pooling,
//! [`crate::batchnorm`]'s statistics, normalisation and backward pieces.

use super::{len_is, load_f64, store_f64, want, BnDims, ConvDims, Op, PoolDims};
use crate::backend::Cpu;
use crate::batchnorm::{
    backward_dx, backward_reduce, channel_stats, combine_stats, eval_normalize, train_normalize,
    ChannelStats, STATS_RECORD,
};
use crate::conv::ConvSaved;
use crate::layers::{global_avg_pool_backward, global_avg_pool_forward, MaxPoolSaved, ShapeSaved};
use crate::tensor::Tensor;

fn err(e: crate::error::ModelError) -> String {
    e.to_string()
}

fn len3(what: &str, d: &BnDims) -> Result<usize, String> {
    d.n.checked_mul(d.c)
        .and_then(|v| v.checked_mul(d.s))
        .ok_or_else(|| format!("{what}: {d:?} overflows"))
}

fn conv_lens(d: &ConvDims) -> Result<(usize, usize), String> {
    let c = &d.conv;
    if c.kernel == 0 || c.stride == 0 {
        return Err("conv2d: kernel and stride must be positive".into());
    }
    let x = d.n * c.in_channels * d.h * d.w;
    let y = d.n * c.out_channels * c.out_size(d.h) * c.out_size(d.w);
    Ok((x, y))
}

fn pool_lens(d: &PoolDims) -> Result<(usize, usize), String> {
    if d.pool.kernel == 0 || d.pool.stride == 0 {
        return Err("max pool: kernel and stride must be positive".into());
    }
    let x = d.n * d.c * d.h * d.w;
    Ok((x, d.n * d.c * d.pool.out_size(d.h) * d.pool.out_size(d.w)))
}

/// Reads and writes of `op` (counts, then each length).
pub(super) fn check(op: &Op, r: &[usize], w: &[usize]) -> Result<(), String> {
    let name = op.label();
    let counts = |nr: usize, nw: usize| -> Result<(), String> {
        want(&format!("{name} reads"), r, nr)?;
        want(&format!("{name} writes"), w, nw)
    };
    let is = |what: &str, got: usize, n: usize| len_is(&format!("{name} {what}"), got, n);
    match op {
        Op::Conv2dForward(d) => {
            counts(2, 1)?;
            let (x, y) = conv_lens(d)?;
            is("params", r[0], d.conv.num_params())?;
            is("x", r[1], x)?;
            is("y", w[0], y)
        }
        Op::Conv2dBackward(d) => {
            counts(3, 2)?;
            let (x, y) = conv_lens(d)?;
            is("params", r[0], d.conv.num_params())?;
            is("x", r[1], x)?;
            is("dy", r[2], y)?;
            is("grads", w[0], d.conv.num_params())?;
            is("dx", w[1], x)
        }
        Op::MaxPoolForward(d) => {
            counts(1, 2)?;
            let (x, y) = pool_lens(d)?;
            if x > u32::MAX as usize {
                return Err(format!("{name}: {x} inputs past u32 indices"));
            }
            is("x", r[0], x)?;
            is("y", w[0], y)?;
            is("argmax", w[1], y)
        }
        Op::MaxPoolBackward(d) => {
            counts(2, 1)?;
            let (x, y) = pool_lens(d)?;
            is("argmax", r[0], y)?;
            is("dy", r[1], y)?;
            is("dx", w[0], x)
        }
        Op::GlobalAvgPool(d) => {
            counts(1, 1)?;
            is("x", r[0], len3(name, d)?)?;
            is("y", w[0], d.n * d.c)
        }
        Op::GlobalAvgPoolBackward(d) => {
            counts(1, 1)?;
            is("dy", r[0], d.n * d.c)?;
            is("dx", w[0], len3(name, d)?)
        }
        Op::BatchNormLocalStats(d) => {
            counts(1, 1)?;
            is("x", r[0], len3(name, d)?)?;
            is("stats", w[0], 6 * d.c)
        }
        Op::BatchNormEncode { c } => {
            counts(1, 1)?;
            is("stats", r[0], 6 * c)?;
            is("records", w[0], STATS_RECORD * c)
        }
        Op::BatchNormMerge { c, world } => {
            counts(1, 1)?;
            if *world == 0 {
                return Err(format!("{name}: no ranks"));
            }
            is("records", r[0], world * STATS_RECORD * c)?;
            is("stats", w[0], 6 * c)
        }
        Op::BatchNormTrain { dims: d, .. } => {
            counts(3, 5)?;
            let len = len3(name, d)?;
            is("x", r[0], len)?;
            is("params", r[1], 2 * d.c)?;
            is("stats", r[2], 6 * d.c)?;
            is("y", w[0], len)?;
            is("xhat", w[1], len)?;
            is("invstd", w[2], d.c)?;
            is("count", w[3], 2)?;
            is("buffers", w[4], 2 * d.c + 1)
        }
        Op::BatchNormEval { dims: d, .. } => {
            counts(3, 1)?;
            let len = len3(name, d)?;
            is("x", r[0], len)?;
            is("params", r[1], 2 * d.c)?;
            is("buffers", r[2], 2 * d.c + 1)?;
            is("y", w[0], len)
        }
        Op::BatchNormGradSums(d) => {
            counts(2, 2)?;
            let len = len3(name, d)?;
            is("dy", r[0], len)?;
            is("xhat", r[1], len)?;
            is("sums", w[0], 4 * d.c)?;
            is("grads", w[1], 2 * d.c)
        }
        Op::BatchNormGradDx(d) => {
            counts(6, 1)?;
            let len = len3(name, d)?;
            is("params", r[0], 2 * d.c)?;
            is("xhat", r[1], len)?;
            is("invstd", r[2], d.c)?;
            is("sums", r[3], 4 * d.c)?;
            is("count", r[4], 2)?;
            is("dy", r[5], len)?;
            is("dx", w[0], len)
        }
        Op::F64ToF32 => {
            counts(1, 1)?;
            is("input", r[0], 2 * w[0])
        }
        Op::F32ToF64 => {
            counts(1, 1)?;
            is("output", w[0], 2 * r[0])
        }
        other => unreachable!("{} has its own rules", other.label()),
    }
}

fn stats_of(v: &[f32]) -> Vec<ChannelStats> {
    v.chunks_exact(6)
        .map(|p| ChannelStats {
            count: load_f64(&p[0..2]),
            mean: load_f64(&p[2..4]),
            m2: load_f64(&p[4..6]),
        })
        .collect()
}

fn store_stats(stats: &[ChannelStats], out: &mut [f32]) {
    for (st, o) in stats.iter().zip(out.chunks_exact_mut(6)) {
        store_f64(st.count, &mut o[0..2]);
        store_f64(st.mean, &mut o[2..4]);
        store_f64(st.m2, &mut o[4..6]);
    }
}

/// The host references of the ops [`check`] covers.
pub(super) fn host(op: &Op, r: &[&[f32]], w: &mut [&mut [f32]]) -> Result<(), String> {
    let be = Cpu::new();
    match op {
        Op::Conv2dForward(d) => {
            let x = Tensor::new(vec![d.n, d.conv.in_channels, d.h, d.w], r[1].to_vec());
            let (y, _) = d.conv.forward(&be, r[0], x.map_err(err)?).map_err(err)?;
            w[0].copy_from_slice(y.as_f32().map_err(err)?);
        }
        Op::Conv2dBackward(d) => {
            let x = Tensor::new(vec![d.n, d.conv.in_channels, d.h, d.w], r[1].to_vec());
            let saved = ConvSaved::of(x.map_err(err)?);
            let (ho, wo) = (d.conv.out_size(d.h), d.conv.out_size(d.w));
            let dy = Tensor::new(vec![d.n, d.conv.out_channels, ho, wo], r[2].to_vec());
            let [grads, dx] = w else { unreachable!("checked: two writes") };
            let gx = d.conv.backward(&be, r[0], &saved, &dy.map_err(err)?, grads).map_err(err)?;
            dx.copy_from_slice(gx.as_f32().map_err(err)?);
        }
        Op::MaxPoolForward(d) => {
            let x = Tensor::new(vec![d.n, d.c, d.h, d.w], r[0].to_vec()).map_err(err)?;
            let (y, saved) = d.pool.forward(x).map_err(err)?;
            let [out, argmax] = w else { unreachable!("checked: two writes") };
            out.copy_from_slice(y.as_f32().map_err(err)?);
            argmax.iter_mut().zip(saved.argmax()).for_each(|(o, &a)| *o = f32::from_bits(a));
        }
        Op::MaxPoolBackward(d) => {
            let argmax = r[0].iter().map(|v| v.to_bits()).collect();
            let saved = MaxPoolSaved::of(vec![d.n, d.c, d.h, d.w], argmax);
            let dy = Tensor::new(vec![r[1].len()], r[1].to_vec()).map_err(err)?;
            let gx = d.pool.backward(&saved, &dy).map_err(err)?;
            w[0].copy_from_slice(gx.as_f32().map_err(err)?);
        }
        Op::GlobalAvgPool(d) => {
            let x = Tensor::new(vec![d.n, d.c, d.s, 1], r[0].to_vec()).map_err(err)?;
            let (y, _) = global_avg_pool_forward(x).map_err(err)?;
            w[0].copy_from_slice(y.as_f32().map_err(err)?);
        }
        Op::GlobalAvgPoolBackward(d) => {
            let saved = ShapeSaved::of(vec![d.n, d.c, d.s, 1]);
            let dy = Tensor::new(vec![d.n, d.c], r[0].to_vec()).map_err(err)?;
            let gx = global_avg_pool_backward(&saved, &dy).map_err(err)?;
            w[0].copy_from_slice(gx.as_f32().map_err(err)?);
        }
        Op::BatchNormLocalStats(d) => store_stats(&channel_stats(d.n, d.c, d.s, r[0]), w[0]),
        Op::BatchNormEncode { .. } => {
            let mut out = Vec::with_capacity(w[0].len());
            stats_of(r[0]).iter().for_each(|st| st.encode(&mut out));
            w[0].copy_from_slice(&out);
        }
        Op::BatchNormMerge { c, world } => {
            // As the reducer: rank 0's records, then every other rank's merged in rank order.
            let mut ranks = r[0].chunks_exact(STATS_RECORD * c).take(*world);
            let mut acc = ranks.next().unwrap_or_default().to_vec();
            ranks.for_each(|other| combine_stats(&mut acc, other));
            let stats: Vec<ChannelStats> =
                acc.chunks_exact(STATS_RECORD).map(ChannelStats::decode).collect();
            store_stats(&stats, w[0]);
        }
        Op::BatchNormTrain { dims: d, eps, momentum } => {
            let stats = stats_of(r[2]);
            let count = stats.first().map_or(0.0, |st| st.count);
            if count <= 1.0 {
                return Err(format!(
                    "expected more than 1 value per channel when training, got {count} (BN-4)"
                ));
            }
            let [y, xhat, invstd, cnt, buffers] = w else { unreachable!("checked: five writes") };
            xhat.copy_from_slice(r[0]);
            let (out, is) =
                train_normalize((d.n, d.c, d.s), (*eps, *momentum), r[1], buffers, xhat, &stats);
            y.copy_from_slice(&out);
            invstd.copy_from_slice(&is);
            store_f64(count, cnt);
        }
        Op::BatchNormEval { dims: d, eps } => {
            let mut x = r[0].to_vec();
            let (y, _) = eval_normalize((d.n, d.c, d.s), *eps, r[1], r[2], &mut x);
            w[0].copy_from_slice(&y);
        }
        Op::BatchNormGradSums(d) => {
            let [sums, grads] = w else { unreachable!("checked: two writes") };
            let got = backward_reduce((d.n, d.c, d.s), r[0], r[1], grads);
            for (v, o) in got.iter().zip(sums.chunks_exact_mut(2)) {
                store_f64(*v, o);
            }
        }
        Op::BatchNormGradDx(d) => {
            let sums: Vec<f64> = r[3].chunks_exact(2).map(load_f64).collect();
            let count = load_f64(r[4]);
            w[0].copy_from_slice(r[5]);
            let weight = &r[0][..d.c];
            backward_dx((d.n, d.c, d.s), weight, r[2], Some((&sums, count)), r[1], w[0]);
        }
        Op::F64ToF32 => {
            w[0].iter_mut().zip(r[0].chunks_exact(2)).for_each(|(o, p)| *o = load_f64(p) as f32);
        }
        Op::F32ToF64 => {
            r[0].iter().zip(w[0].chunks_exact_mut(2)).for_each(|(&v, o)| store_f64(v as f64, o));
        }
        other => unreachable!("{} has its own host reference", other.label()),
    }
    Ok(())
}
