//! BatchNorm and SyncBatchNorm with PyTorch's semantics.
//!
//! Training mode normalises with the batch statistics (biased variance), then updates
//! `running_mean` and `running_var` with momentum (`r = (1 - m) r + m s`), using the
//! UNBIASED variance for `running_var`, and adds one to `num_batches_tracked`. Eval mode
//! normalises with the running statistics.
//!
//! A SyncBatchNorm layer computes the statistics of the GLOBAL batch (all ranks' slices):
//! each rank reduces per channel `(count, mean, M2)` with Chan's parallel merge, so that
//! ranks with uneven or empty slices are weighted exactly.
//!
//! Invariants:
//! - `BN-1`: SyncBatchNorm on W ranks equals BatchNorm on the concatenation of the ranks'
//!   slices (outputs, input gradients, running statistics), for uneven and empty slices.
//!   An empty rank contributes count 0 and still takes part in every reduction.
//! - `BN-2`: forward sends ONE message per call of [`batchnorm_forward_fused`], whatever the
//!   number of layers in it and whatever the world size (records of fixed size per channel);
//!   backward sends one message per call of [`batchnorm_backward_fused`].
//! - `BN-3`: weight and bias gradients are the rank's LOCAL share (sums over its own slice);
//!   the ordinary gradient reduction sums them like every other parameter's.
//! - `BN-4`: a global batch with at most one value per channel in training mode is an
//!   error ([`ModelError::TooFewValues`]), never NaN.
//! - `BN-5`: every value in a statistics message is carried as an (f32 hi, f32 lo) pair
//!   holding an f64, so the merge loses no precision to the f32 wire format and counts are
//!   exact far beyond 2^24.

use crate::error::{ModelError, StatsError};
use crate::layers::check_len;
use crate::spec::ParamSpec;
use crate::tensor::Tensor;

/// Reduces statistics across the ranks of a data-parallel group (the `stats` lane).
/// Every rank calls the same methods in the same order with buffers of the same length.
///
/// The runtime hands the model one implementation that counts, traces and reduces on its
/// stats lane; a failure is a typed [`StatsError`] (rank, lane, message, cause) that
/// [`ModelError::Stats`] carries to the caller unchanged.
pub trait StatsReducer {
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Reduces `buf`, made of records of `record_len` values, with `combine(acc, other)`,
    /// which merges `other` into `acc` (both whole numbers of records); every rank gets the
    /// result.
    fn reduce_records(
        &self,
        buf: Vec<f32>,
        record_len: usize,
        combine: fn(&mut [f32], &[f32]),
    ) -> Result<Vec<f32>, StatsError>;
    /// Elementwise sum across ranks; every rank gets the result.
    fn reduce_sum(&self, buf: Vec<f32>) -> Result<Vec<f32>, StatsError>;
}

/// Values per channel in a forward statistics message: count, mean and M2, each as an
/// (f32 hi, f32 lo) pair (BN-5).
pub const STATS_RECORD: usize = 6;

fn split(v: f64) -> [f32; 2] {
    let hi = v as f32;
    [hi, (v - hi as f64) as f32]
}

fn join(p: &[f32]) -> f64 {
    p[0] as f64 + p[1] as f64
}

/// Per-channel statistics of a set of values: count, mean and M2 (sum of squared deviations).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ChannelStats {
    /// Number of values.
    pub count: f64,
    /// Mean.
    pub mean: f64,
    /// Sum of squared deviations from the mean.
    pub m2: f64,
}

impl ChannelStats {
    /// Chan et al.'s parallel merge of two disjoint sets' statistics.
    pub fn merge(self, o: ChannelStats) -> ChannelStats {
        if o.count == 0.0 {
            return self;
        }
        if self.count == 0.0 {
            return o;
        }
        let n = self.count + o.count;
        let delta = o.mean - self.mean;
        ChannelStats {
            count: n,
            mean: self.mean + delta * (o.count / n),
            m2: self.m2 + o.m2 + delta * delta * (self.count * o.count / n),
        }
    }

    pub(crate) fn encode(&self, out: &mut Vec<f32>) {
        out.extend_from_slice(&split(self.count));
        out.extend_from_slice(&split(self.mean));
        out.extend_from_slice(&split(self.m2));
    }

    pub(crate) fn decode(r: &[f32]) -> ChannelStats {
        ChannelStats { count: join(&r[0..2]), mean: join(&r[2..4]), m2: join(&r[4..6]) }
    }
}

/// The `combine` of the forward statistics message: Chan's merge on every record.
pub fn combine_stats(acc: &mut [f32], other: &[f32]) {
    assert_eq!(acc.len(), other.len(), "combine_stats: lengths differ");
    for (a, o) in acc.chunks_exact_mut(STATS_RECORD).zip(other.chunks_exact(STATS_RECORD)) {
        let m = ChannelStats::decode(a).merge(ChannelStats::decode(o));
        let mut v = Vec::with_capacity(STATS_RECORD);
        m.encode(&mut v);
        a.copy_from_slice(&v);
    }
}

/// Whether a BatchNorm layer follows 1-d (`[N, C]`, `[N, C, L]`) or 2-d (`[N, C, H, W]`) inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BnKind {
    /// `BatchNorm1d`.
    D1,
    /// `BatchNorm2d`.
    D2,
}

/// A BatchNorm layer: parameters `weight [C]`, `bias [C]`; buffers `running_mean [C]`,
/// `running_var [C]`, `num_batches_tracked []` (stored as f32: exact up to 2^24 steps).
#[derive(Clone, Debug, PartialEq)]
pub struct BatchNorm {
    /// Channels (C).
    pub num_features: usize,
    /// Added to the variance (PyTorch default 1e-5).
    pub eps: f32,
    /// Running statistics momentum (PyTorch default 0.1).
    pub momentum: f32,
    /// 1-d or 2-d.
    pub kind: BnKind,
    /// SyncBatchNorm: reduce statistics across ranks in training mode.
    pub sync: bool,
}

/// What [`BatchNorm`] backward needs.
#[derive(Clone, Debug)]
pub struct BnSaved {
    xhat: Tensor,
    /// Per-channel `1 / sqrt(var + eps)` that normalised the input.
    invstd: Vec<f32>,
    /// Values per channel in the global batch.
    count: f64,
    training: bool,
    sync: bool,
}

impl BnSaved {
    /// Per-channel `1 / sqrt(var + eps)` used by the forward.
    pub fn invstd(&self) -> &[f32] {
        &self.invstd
    }
}

impl BatchNorm {
    /// `BatchNorm1d(c)` with PyTorch's defaults.
    pub fn d1(c: usize) -> Self {
        BatchNorm { num_features: c, eps: 1e-5, momentum: 0.1, kind: BnKind::D1, sync: false }
    }
    /// `BatchNorm2d(c)` with PyTorch's defaults.
    pub fn d2(c: usize) -> Self {
        BatchNorm { kind: BnKind::D2, ..Self::d1(c) }
    }

    /// `weight`, `bias`.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let c = self.num_features;
        vec![
            ParamSpec { name: "weight".into(), shape: vec![c] },
            ParamSpec { name: "bias".into(), shape: vec![c] },
        ]
    }

    /// `running_mean`, `running_var`, `num_batches_tracked`.
    pub fn buffer_specs(&self) -> Vec<ParamSpec> {
        let c = self.num_features;
        vec![
            ParamSpec { name: "running_mean".into(), shape: vec![c] },
            ParamSpec { name: "running_var".into(), shape: vec![c] },
            ParamSpec { name: "num_batches_tracked".into(), shape: vec![] },
        ]
    }

    /// Number of parameters (`2 C`).
    pub fn num_params(&self) -> usize {
        2 * self.num_features
    }

    /// Number of buffer values (`2 C + 1`).
    pub fn num_buffers(&self) -> usize {
        2 * self.num_features + 1
    }

    /// Initial parameters: weight 1, bias 0.
    pub fn init_params(&self) -> Vec<f32> {
        let c = self.num_features;
        let mut v = vec![1.0; c];
        v.resize(2 * c, 0.0);
        v
    }

    /// Initial buffers: mean 0, var 1, 0 batches tracked.
    pub fn init_buffers(&self) -> Vec<f32> {
        let c = self.num_features;
        let mut v = vec![0.0; c];
        v.resize(2 * c, 1.0);
        v.push(0.0);
        v
    }

    /// `(N, S)`: batch and values per channel per sample, after checking the input's rank.
    fn layout(&self, t: &Tensor) -> Result<(usize, usize), ModelError> {
        let ok = match self.kind {
            BnKind::D1 => t.shape().len() == 2 || t.shape().len() == 3,
            BnKind::D2 => t.shape().len() == 4,
        };
        if !ok || t.shape()[1] != self.num_features {
            let want = match self.kind {
                BnKind::D1 => {
                    format!("[N, {}] or [N, {}, L]", self.num_features, self.num_features)
                }
                BnKind::D2 => format!("[N, {}, H, W]", self.num_features),
            };
            return Err(ModelError::shape("batchnorm input", want, format!("{:?}", t.shape())));
        }
        Ok((t.shape()[0], t.shape()[2..].iter().product()))
    }

    /// Per-channel statistics of this rank's slice (two passes, f64).
    pub fn local_stats(&self, input: &Tensor) -> Result<Vec<ChannelStats>, ModelError> {
        let (n, s) = self.layout(input)?;
        Ok(channel_stats(n, self.num_features, s, input.as_f32()?))
    }

    /// Normalises with the global statistics and updates the running statistics.
    fn finish_train(
        &self,
        name: &str,
        params: &[f32],
        buffers: &mut [f32],
        mut input: Tensor,
        stats: &[ChannelStats],
    ) -> Result<(Tensor, BnSaved), ModelError> {
        let (n, s) = self.layout(&input)?;
        let c = self.num_features;
        let count = stats.first().map(|st| st.count).unwrap_or(0.0);
        if count <= 1.0 {
            return Err(ModelError::TooFewValues {
                layer: name.to_string(),
                count: count as usize,
            });
        }
        let (y, invstd) = train_normalize(
            (n, c, s),
            (self.eps, self.momentum),
            params,
            buffers,
            input.as_f32_mut()?,
            stats,
        );
        let output = Tensor::new(input.shape().to_vec(), y)?;
        Ok((output, BnSaved { xhat: input, invstd, count, training: true, sync: self.sync }))
    }

    fn forward_eval(
        &self,
        params: &[f32],
        buffers: &[f32],
        mut input: Tensor,
    ) -> Result<(Tensor, BnSaved), ModelError> {
        let (n, s) = self.layout(&input)?;
        let c = self.num_features;
        let (y, invstd) = eval_normalize((n, c, s), self.eps, params, buffers, input.as_f32_mut()?);
        let output = Tensor::new(input.shape().to_vec(), y)?;
        Ok((
            output,
            BnSaved { xhat: input, invstd, count: (n * s) as f64, training: false, sync: false },
        ))
    }

    /// Forward of one layer (see [`batchnorm_forward_fused`] for several at once).
    pub fn forward(
        &self,
        params: &[f32],
        buffers: &mut [f32],
        input: Tensor,
        training: bool,
        reducer: Option<&dyn StatsReducer>,
    ) -> Result<(Tensor, BnSaved), ModelError> {
        let out = batchnorm_forward_fused(
            vec![BnForward { name: "batchnorm", layer: self, params, buffers, input }],
            training,
            reducer,
        )?;
        let [one] = fused_results("batchnorm forward", out)?;
        Ok(one)
    }

    /// Backward of one layer (see [`batchnorm_backward_fused`] for several at once).
    pub fn backward(
        &self,
        params: &[f32],
        saved: &BnSaved,
        grad_output: &Tensor,
        grads_out: &mut [f32],
        reducer: Option<&dyn StatsReducer>,
    ) -> Result<Tensor, ModelError> {
        let out = batchnorm_backward_fused(
            vec![BnBackward { layer: self, params, saved, grad_output, grads_out }],
            reducer,
        )?;
        let [one] = fused_results("batchnorm backward", out)?;
        Ok(one)
    }
}

/// Training mode with the batch's `stats` (count above 1): the running statistics in
/// `buffers` updated (f64, torch's unbiased variance), `x` normalised in place into `xhat`;
/// returns `y` and the per-channel `invstd`. The layer's code and the BatchNorm train op's
/// host reference (OPS-2).
pub(crate) fn train_normalize(
    (n, c, s): (usize, usize, usize),
    (eps, momentum): (f32, f32),
    params: &[f32],
    buffers: &mut [f32],
    x: &mut [f32],
    stats: &[ChannelStats],
) -> (Vec<f32>, Vec<f32>) {
    let mom = momentum as f64;
    let mut invstd = Vec::with_capacity(c);
    let mut mean = Vec::with_capacity(c);
    for (ch, st) in stats.iter().enumerate() {
        let var_unbiased = st.m2 / (st.count - 1.0);
        invstd.push(invstd_of(st.m2 / st.count, eps));
        mean.push(st.mean as f32);
        buffers[ch] = ((1.0 - mom) * buffers[ch] as f64 + mom * st.mean) as f32;
        buffers[c + ch] = ((1.0 - mom) * buffers[c + ch] as f64 + mom * var_unbiased) as f32;
    }
    buffers[2 * c] += 1.0;
    (normalize(n, c, s, x, &mean, &invstd, params), invstd)
}

/// Evaluation mode: `x` normalised in place with the running statistics of `buffers`;
/// returns `y` and `invstd` (the layer's code and the eval op's host reference).
pub(crate) fn eval_normalize(
    (n, c, s): (usize, usize, usize),
    eps: f32,
    params: &[f32],
    buffers: &[f32],
    x: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    let invstd: Vec<f32> = (0..c).map(|ch| invstd_of(buffers[c + ch] as f64, eps)).collect();
    (normalize(n, c, s, x, &buffers[..c], &invstd, params), invstd)
}

/// Per-channel (count, mean, M2) of `xs` laid out `[n, c, s]`, two passes in f64 (also the
/// BatchNorm statistics op's host reference); an empty batch: count, mean and M2 0.
pub(crate) fn channel_stats(n: usize, c: usize, s: usize, xs: &[f32]) -> Vec<ChannelStats> {
    if s == 1 {
        // [N, C]: walk rows so the per-channel accumulators vectorise.
        let count = n as f64;
        let mut sum = vec![0.0f64; c];
        for row in xs.chunks_exact(c.max(1)) {
            sum.iter_mut().zip(row).for_each(|(a, &v)| *a += v as f64);
        }
        let mean: Vec<f64> = sum.iter().map(|v| if n == 0 { 0.0 } else { v / count }).collect();
        let mut m2 = vec![0.0f64; c];
        for row in xs.chunks_exact(c.max(1)) {
            m2.iter_mut().zip(row).zip(&mean).for_each(|((a, &v), m)| *a += (v as f64 - m).powi(2));
        }
        return (0..c).map(|ch| ChannelStats { count, mean: mean[ch], m2: m2[ch] }).collect();
    }
    let mut out = Vec::with_capacity(c);
    for ch in 0..c {
        let planes = (0..n).map(|i| &xs[(i * c + ch) * s..][..s]);
        let count = (n * s) as f64;
        if count == 0.0 {
            out.push(ChannelStats::default());
            continue;
        }
        let sum: f64 = planes.clone().map(|p| p.iter().map(|&v| v as f64).sum::<f64>()).sum();
        let mean = sum / count;
        let m2: f64 =
            planes.map(|p| p.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>()).sum();
        out.push(ChannelStats { count, mean, m2 });
    }
    out
}

/// `1 / sqrt(var + eps)` in f64, rounded once to f32 (training and eval mode).
pub(crate) fn invstd_of(var: f64, eps: f32) -> f32 {
    (1.0 / (var + eps as f64).sqrt()) as f32
}

/// `x <- (x - mean) * invstd` in place (the saved `xhat`) and returns `y = xhat * w + b`,
/// for `x` laid out `[n, c, s]`.
pub(crate) fn normalize(
    n: usize,
    c: usize,
    s: usize,
    x: &mut [f32],
    mean: &[f32],
    invstd: &[f32],
    params: &[f32],
) -> Vec<f32> {
    let (w, b) = params.split_at(c);
    let mut y = vec![0.0f32; x.len()];
    if s == 1 {
        for (xr, yr) in x.chunks_exact_mut(c.max(1)).zip(y.chunks_exact_mut(c.max(1))) {
            for ch in 0..c {
                let v = (xr[ch] - mean[ch]) * invstd[ch];
                xr[ch] = v;
                yr[ch] = v * w[ch] + b[ch];
            }
        }
    } else {
        for i in 0..n {
            for ch in 0..c {
                let off = (i * c + ch) * s;
                let (m, is, wv, bv) = (mean[ch], invstd[ch], w[ch], b[ch]);
                for (xv, yv) in x[off..off + s].iter_mut().zip(&mut y[off..off + s]) {
                    *xv = (*xv - m) * is;
                    *yv = *xv * wv + bv;
                }
            }
        }
    }
    y
}

/// One layer's part of a fused forward.
pub struct BnForward<'a> {
    /// Layer name for errors.
    pub name: &'a str,
    /// The layer.
    pub layer: &'a BatchNorm,
    /// `weight`, `bias`.
    pub params: &'a [f32],
    /// `running_mean`, `running_var`, `num_batches_tracked` (updated in training mode).
    pub buffers: &'a mut [f32],
    /// This rank's slice (possibly empty).
    pub input: Tensor,
}

/// One layer's part of a fused backward.
pub struct BnBackward<'a> {
    /// The layer.
    pub layer: &'a BatchNorm,
    /// `weight`, `bias`.
    pub params: &'a [f32],
    /// From the forward.
    pub saved: &'a BnSaved,
    /// Gradient of the layer's output.
    pub grad_output: &'a Tensor,
    /// `weight`, `bias` gradients: the local share is ADDED (LAYER-1, BN-3).
    pub grads_out: &'a mut [f32],
}

/// The `N` results of a fused call of `N` layers, as an array (one per layer, in order).
pub(crate) fn fused_results<T, const N: usize>(
    what: &str,
    out: Vec<T>,
) -> Result<[T; N], ModelError> {
    let got = out.len();
    out.try_into().map_err(|_| ModelError::shape(what, format!("{N} results"), got))
}

fn syncing(sync: bool, reducer: Option<&dyn StatsReducer>) -> Option<&dyn StatsReducer> {
    reducer.filter(|r| sync && r.world() > 1)
}

/// Forward of several independent BatchNorm layers whose inputs are ready together (e.g. a
/// residual block's main-path and shortcut BN): the statistics of all SyncBatchNorm layers
/// among them travel in ONE message (BN-2). Layers that are not `sync`, eval mode, and a
/// missing or single-rank reducer need no message.
pub fn batchnorm_forward_fused(
    items: Vec<BnForward<'_>>,
    training: bool,
    reducer: Option<&dyn StatsReducer>,
) -> Result<Vec<(Tensor, BnSaved)>, ModelError> {
    for it in &items {
        check_len("batchnorm params", it.params.len(), it.layer.num_params())?;
        check_len("batchnorm buffers", it.buffers.len(), it.layer.num_buffers())?;
    }
    if !training {
        return items
            .into_iter()
            .map(|it| it.layer.forward_eval(it.params, it.buffers, it.input))
            .collect();
    }
    let mut stats =
        items.iter().map(|it| it.layer.local_stats(&it.input)).collect::<Result<Vec<_>, _>>()?;
    let synced: Vec<usize> =
        (0..items.len()).filter(|&i| syncing(items[i].layer.sync, reducer).is_some()).collect();
    if let (Some(r), false) = (reducer, synced.is_empty()) {
        let mut buf =
            Vec::with_capacity(synced.iter().map(|&i| stats[i].len() * STATS_RECORD).sum());
        for &i in &synced {
            stats[i].iter().for_each(|s| s.encode(&mut buf));
        }
        let want = buf.len();
        let reduced = r.reduce_records(buf, STATS_RECORD, combine_stats)?;
        check_len("reduced statistics", reduced.len(), want)?;
        let mut records = reduced.chunks_exact(STATS_RECORD);
        for &i in &synced {
            for s in stats[i].iter_mut() {
                *s = records.next().map(ChannelStats::decode).unwrap_or_default();
            }
        }
    }
    items
        .into_iter()
        .zip(stats)
        .map(|(it, st)| it.layer.finish_train(it.name, it.params, it.buffers, it.input, &st))
        .collect()
}

/// Backward of several BatchNorm layers at once; the `(sum dy, sum dy * xhat)` of all
/// SyncBatchNorm layers among them travel in ONE message (BN-2).
pub fn batchnorm_backward_fused(
    mut items: Vec<BnBackward<'_>>,
    reducer: Option<&dyn StatsReducer>,
) -> Result<Vec<Tensor>, ModelError> {
    // Local sums per layer: [sum dy (C), sum dy*xhat (C)].
    let mut sums = Vec::with_capacity(items.len());
    for it in items.iter_mut() {
        let l = it.layer;
        check_len("batchnorm params", it.params.len(), l.num_params())?;
        check_len("batchnorm grads", it.grads_out.len(), l.num_params())?;
        check_len("batchnorm grad_output", it.grad_output.numel(), it.saved.xhat.numel())?;
        let (n, s) = l.layout(&it.saved.xhat)?;
        let (dy, xhat) = (it.grad_output.as_f32()?, it.saved.xhat.as_f32()?);
        sums.push(backward_reduce((n, l.num_features, s), dy, xhat, it.grads_out));
    }
    let synced: Vec<usize> = (0..items.len())
        .filter(|&i| items[i].saved.training && syncing(items[i].saved.sync, reducer).is_some())
        .collect();
    if let (Some(r), false) = (reducer, synced.is_empty()) {
        let buf: Vec<f32> =
            synced.iter().flat_map(|&i| sums[i].iter().map(|&v| v as f32)).collect();
        let want = buf.len();
        let reduced = r.reduce_sum(buf)?;
        check_len("reduced gradient sums", reduced.len(), want)?;
        let mut vals = reduced.into_iter();
        for &i in &synced {
            for v in sums[i].iter_mut() {
                *v = vals.next().unwrap_or_default() as f64;
            }
        }
    }
    let mut out = Vec::with_capacity(items.len());
    for (it, sum) in items.iter().zip(&sums) {
        let (c, (n, s)) = (it.layer.num_features, it.layer.layout(&it.saved.xhat)?);
        let mut gx = it.grad_output.clone();
        // Eval mode: the statistics are constants, so dx = w * invstd * dy.
        let global = it.saved.training.then_some((sum.as_slice(), it.saved.count));
        let (weight, xhat) = (&it.params[..c], it.saved.xhat.as_f32()?);
        backward_dx((n, c, s), weight, &it.saved.invstd, global, xhat, gx.as_f32_mut()?);
        out.push(gx);
    }
    Ok(out)
}

/// The backward's reduce over `dy`, `xhat` (`[n, c, s]`): returns `[sum dy (C), sum dy *
/// xhat (C)]` (f64; f32 within a plane when `s > 1`), what SyncBatchNorm sums across ranks,
/// and ADDS the local parameter gradients to `grads` (weight: sum dy * xhat; bias: sum dy).
pub(crate) fn backward_reduce(
    (n, c, s): (usize, usize, usize),
    dy: &[f32],
    xhat: &[f32],
    grads: &mut [f32],
) -> Vec<f64> {
    let (mut sdy, mut sdyx) = (vec![0.0f64; c], vec![0.0f64; c]);
    if s == 1 {
        for (dr, xr) in dy.chunks_exact(c.max(1)).zip(xhat.chunks_exact(c.max(1))) {
            for ch in 0..c {
                sdy[ch] += dr[ch] as f64;
                sdyx[ch] += (dr[ch] * xr[ch]) as f64;
            }
        }
    } else {
        for i in 0..n {
            for ch in 0..c {
                let off = (i * c + ch) * s;
                let (mut a, mut b) = (0.0f32, 0.0f32);
                for (d, x) in dy[off..off + s].iter().zip(&xhat[off..off + s]) {
                    a += d;
                    b += d * x;
                }
                sdy[ch] += a as f64;
                sdyx[ch] += b as f64;
            }
        }
    }
    for ch in 0..c {
        grads[ch] += sdyx[ch] as f32;
        grads[c + ch] += sdy[ch] as f32;
    }
    sdy.extend_from_slice(&sdyx);
    sdy
}

/// The input gradient in place over `gx` (`dy` on entry), `[n, c, s]`: `dx = weight *
/// invstd * (dy - sum_dy / count - xhat * sum_dy_xhat / count)` with `global` the global
/// batch's sums ([`backward_reduce`]) and count; `None` in eval mode (constant statistics).
pub(crate) fn backward_dx(
    (n, c, s): (usize, usize, usize),
    weight: &[f32],
    invstd: &[f32],
    global: Option<(&[f64], f64)>,
    xhat: &[f32],
    gx: &mut [f32],
) {
    let av: Vec<f32> = (0..c).map(|ch| weight[ch] * invstd[ch]).collect();
    // The per-channel means of dy (from 0) and dy * xhat (from c); 0 in eval mode.
    let mean = |at: usize| -> Vec<f32> {
        (0..c).map(|ch| global.map_or(0.0, |(sum, nn)| (sum[at + ch] / nn) as f32)).collect()
    };
    let (bv, kv) = (mean(0), mean(c));
    if s == 1 {
        for (gr, xr) in gx.chunks_exact_mut(c.max(1)).zip(xhat.chunks_exact(c.max(1))) {
            for ch in 0..c {
                gr[ch] = av[ch] * (gr[ch] - bv[ch] - xr[ch] * kv[ch]);
            }
        }
    } else {
        for i in 0..n {
            for ch in 0..c {
                let off = (i * c + ch) * s;
                let (a, b, k) = (av[ch], bv[ch], kv[ch]);
                for (g, x) in gx[off..off + s].iter_mut().zip(&xhat[off..off + s]) {
                    *g = a * (*g - b - x * k);
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // index loops over parallel arrays read best here
mod tests {
    use super::*;
    use crate::testing::{run_ranks, thread_reducers, CountingReducer};
    use crate::testutil::{check_grads, rand_tensor};
    use std::time::Duration;

    /// Direct f64 formulas of training-mode BatchNorm on a whole batch.
    fn naive_bn(x: &Tensor, w: &[f32], b: &[f32], eps: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (n, c) = (x.shape()[0], x.shape()[1]);
        let s: usize = x.shape()[2..].iter().product();
        let mut y = vec![0.0; x.numel()];
        let (mut means, mut vars) = (vec![0.0; c], vec![0.0; c]);
        for ch in 0..c {
            let vals: Vec<f64> = (0..n)
                .flat_map(|i| (0..s).map(move |j| (i, j)))
                .map(|(i, j)| x.as_f32().unwrap()[(i * c + ch) * s + j] as f64)
                .collect();
            let m = vals.iter().sum::<f64>() / vals.len() as f64;
            let v = vals.iter().map(|v| (v - m).powi(2)).sum::<f64>() / vals.len() as f64;
            means[ch] = m;
            vars[ch] = v;
            for i in 0..n {
                for j in 0..s {
                    let k = (i * c + ch) * s + j;
                    y[k] = (x.as_f32().unwrap()[k] as f64 - m) / (v + eps).sqrt() * w[ch] as f64
                        + b[ch] as f64;
                }
            }
        }
        (y, means, vars)
    }

    #[test]
    fn batchnorm_matches_direct_formula_and_updates_running_stats() {
        let bn = BatchNorm::d2(3);
        let x = rand_tensor(&[4, 3, 2, 3], 7);
        let p = vec![1.5, 0.5, -1.0, 0.1, 0.2, 0.3];
        let mut buf = bn.init_buffers();
        let (y, _) = bn.forward(&p, &mut buf, x.clone(), true, None).unwrap();
        let (want, means, vars) = naive_bn(&x, &p[..3], &p[3..], 1e-5);
        for (a, b) in y.as_f32().unwrap().iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5);
        }
        let cnt = 24.0;
        for ch in 0..3 {
            assert!((buf[ch] as f64 - 0.1 * means[ch]).abs() < 1e-6);
            assert!((buf[3 + ch] as f64 - (0.9 + 0.1 * vars[ch] * cnt / (cnt - 1.0))).abs() < 1e-6);
        }
        assert_eq!(buf[6], 1.0);
        // eval uses the running statistics
        let (ye, _) = bn.forward(&p, &mut buf.clone(), x.clone(), false, None).unwrap();
        let k = 5;
        let ch = (k / 6) % 3;
        let want =
            (x.as_f32().unwrap()[k] - buf[ch]) / (buf[3 + ch] + 1e-5).sqrt() * p[ch] + p[3 + ch];
        assert!((ye.as_f32().unwrap()[k] - want).abs() < 1e-5);
    }

    #[test]
    fn batchnorm_gradients_match_finite_differences() {
        // LAYER-2 for BatchNorm1d (NC, NCL) and BatchNorm2d, training and eval
        for (bn, shape) in [
            (BatchNorm::d1(3), vec![5, 3]),
            (BatchNorm::d1(2), vec![3, 2, 4]),
            (BatchNorm::d2(2), vec![2, 2, 3, 2]),
        ] {
            for training in [true, false] {
                let mut running = bn.init_buffers();
                for (i, v) in running.iter_mut().enumerate().take(2 * bn.num_features) {
                    *v += 0.1 * i as f32;
                }
                check_grads(bn.num_params(), &shape, 21, &|p, x, gy, gp| {
                    let mut b = running.clone();
                    let (y, s) = bn.forward(p, &mut b, x, training, None)?;
                    Ok((
                        y,
                        match gy {
                            Some(gy) => Some(bn.backward(p, &s, gy, gp, None)?),
                            None => None,
                        },
                    ))
                });
            }
        }
    }

    fn slices(x: &Tensor, sizes: &[usize]) -> Vec<Tensor> {
        let per: usize = x.shape()[1..].iter().product();
        let mut at = 0;
        sizes
            .iter()
            .map(|&n| {
                let mut shape = x.shape().to_vec();
                shape[0] = n;
                let t = Tensor::new(shape, x.as_f32().unwrap()[at * per..(at + n) * per].to_vec())
                    .unwrap();
                at += n;
                t
            })
            .collect()
    }

    #[test]
    fn syncbn_uneven_and_empty_slices_equal_global_batchnorm() {
        // BN-1, BN-2, BN-3
        let sizes = [3usize, 0, 5, 2];
        let total: usize = sizes.iter().sum();
        let mut bn = BatchNorm::d1(3);
        let x = rand_tensor(&[total, 3, 2], 31);
        let gy = rand_tensor(&[total, 3, 2], 32);
        let p = vec![1.2, 0.8, -0.5, 0.1, 0.0, -0.2];
        let mut want_buf = bn.init_buffers();
        let (want_y, saved) = bn.forward(&p, &mut want_buf, x.clone(), true, None).unwrap();
        let mut want_gp = vec![0.0; 6];
        let want_gx = bn.backward(&p, &saved, &gy, &mut want_gp, None).unwrap();

        bn.sync = true;
        let (xs, gys) = (slices(&x, &sizes), slices(&gy, &sizes));
        let reducers = thread_reducers(sizes.len(), Duration::from_secs(20));
        let results = run_ranks(sizes.len(), |r| {
            let counter = CountingReducer::new(&reducers[r]);
            let mut buf = bn.init_buffers();
            let (y, s) = bn.forward(&p, &mut buf, xs[r].clone(), true, Some(&counter)).unwrap();
            let mut gp = vec![0.0; 6];
            let gx = bn.backward(&p, &s, &gys[r], &mut gp, Some(&counter)).unwrap();
            (y, gx, gp, buf, counter.messages())
        });
        let ys: Vec<f32> = results.iter().flat_map(|r| r.0.as_f32().unwrap().to_vec()).collect();
        let gxs: Vec<f32> = results.iter().flat_map(|r| r.1.as_f32().unwrap().to_vec()).collect();
        assert!(ys.iter().zip(want_y.as_f32().unwrap()).all(|(a, b)| (a - b).abs() < 1e-5));
        assert!(gxs.iter().zip(want_gx.as_f32().unwrap()).all(|(a, b)| (a - b).abs() < 1e-5));
        for (r, res) in results.iter().enumerate() {
            assert_eq!(res.0.shape()[0], sizes[r]);
            assert!(
                res.3.iter().zip(&want_buf).all(|(a, b)| (a - b).abs() < 1e-6),
                "running stats rank {r}"
            );
            assert_eq!(res.4, 2, "one forward and one backward message");
        }
        // local shares sum to the global gradient; the empty rank's share is zero
        assert!(results[1].2.iter().all(|&v| v == 0.0));
        for k in 0..6 {
            let s: f32 = results.iter().map(|r| r.2[k]).sum();
            assert!((s - want_gp[k]).abs() < 1e-4);
        }
    }

    #[test]
    fn fused_layers_share_one_message() {
        // BN-2: two layers with different widths and layouts, one message each way
        let a = BatchNorm { sync: true, ..BatchNorm::d2(2) };
        let b = BatchNorm { sync: true, ..BatchNorm::d2(3) };
        let world = 3;
        let xa = rand_tensor(&[6, 2, 2, 2], 41);
        let xb = rand_tensor(&[6, 3, 1, 2], 42);
        let pa = a.init_params();
        let pb = b.init_params();
        let reducers = thread_reducers(world, Duration::from_secs(20));
        let res = run_ranks(world, |r| {
            let counter = CountingReducer::new(&reducers[r]);
            let (mut ba, mut bb) = (a.init_buffers(), b.init_buffers());
            let sa = slices(&xa, &[2, 2, 2])[r].clone();
            let sb = slices(&xb, &[1, 5, 0])[r].clone();
            let out = batchnorm_forward_fused(
                vec![
                    BnForward { name: "a", layer: &a, params: &pa, buffers: &mut ba, input: sa },
                    BnForward { name: "b", layer: &b, params: &pb, buffers: &mut bb, input: sb },
                ],
                true,
                Some(&counter),
            )
            .unwrap();
            let (ga, gb) = (out[0].0.clone(), out[1].0.clone());
            let (mut gpa, mut gpb) = (vec![0.0; 4], vec![0.0; 6]);
            batchnorm_backward_fused(
                vec![
                    BnBackward {
                        layer: &a,
                        params: &pa,
                        saved: &out[0].1,
                        grad_output: &ga,
                        grads_out: &mut gpa,
                    },
                    BnBackward {
                        layer: &b,
                        params: &pb,
                        saved: &out[1].1,
                        grad_output: &gb,
                        grads_out: &mut gpb,
                    },
                ],
                Some(&counter),
            )
            .unwrap();
            (counter.messages(), ba, bb)
        });
        let mut la = BatchNorm { sync: false, ..a.clone() };
        la.sync = false;
        let mut want_a = a.init_buffers();
        la.forward(&pa, &mut want_a, xa, true, None).unwrap();
        for (m, ba, _) in &res {
            assert_eq!(*m, 2);
            assert!(ba.iter().zip(&want_a).all(|(x, y)| (x - y).abs() < 1e-6));
        }
    }

    #[test]
    fn one_value_per_channel_is_an_error_on_every_rank() {
        // BN-4: sizes 1 and 0: one value per channel globally
        let bn = BatchNorm { sync: true, ..BatchNorm::d1(2) };
        let reducers = thread_reducers(2, Duration::from_secs(20));
        let res = run_ranks(2, |r| {
            let x = rand_tensor(&[1 - r, 2], 5);
            let mut buf = bn.init_buffers();
            bn.forward(&bn.init_params(), &mut buf, x, true, Some(&reducers[r])).map(|_| ())
        });
        for r in res {
            assert!(matches!(r, Err(ModelError::TooFewValues { count: 1, .. })), "{r:?}");
        }
        // plain BatchNorm on one sample, and on an empty batch
        let plain = BatchNorm::d1(2);
        for n in [0, 1] {
            let e = plain.forward(
                &plain.init_params(),
                &mut plain.init_buffers(),
                Tensor::zeros(&[n, 2]),
                true,
                None,
            );
            assert!(matches!(e, Err(ModelError::TooFewValues { .. })));
        }
        // eval mode is fine with one sample
        let (y, _) = plain
            .forward(
                &plain.init_params(),
                &mut plain.init_buffers(),
                Tensor::zeros(&[1, 2]),
                false,
                None,
            )
            .unwrap();
        assert!(y.as_f32().unwrap().iter().all(|v| v.is_finite()));
    }

    /// A failed statistics reduction reaches the caller typed: the reducer's [`StatsError`]
    /// (rank, lane, message, cause) inside [`ModelError::Stats`], not a string.
    #[test]
    fn a_failed_reduction_is_a_typed_stats_error() {
        use crate::error::{StatsFailure, StatsOp};
        use crate::testing::THREAD_LANE;
        let bn = BatchNorm { sync: true, ..BatchNorm::d1(2) };
        // Rank 1 never arrives: rank 0's forward times out.
        let reducers = thread_reducers(2, Duration::from_millis(20));
        let x = rand_tensor(&[3, 2], 9);
        let e = bn.forward(&bn.init_params(), &mut bn.init_buffers(), x, true, Some(&reducers[0]));
        match e {
            Err(ModelError::Stats(s)) => {
                assert_eq!((s.rank, s.lane.as_str(), s.op), (0, THREAD_LANE, StatsOp::Forward));
                assert!(matches!(s.what, StatsFailure::Timeout(_)), "{s}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn chan_merge_matches_two_pass_statistics() {
        let v: Vec<f64> = (0..37).map(|i| ((i * 7919) % 101) as f64 * 0.37 - 5.0).collect();
        let st = |s: &[f64]| {
            let n = s.len() as f64;
            let m = if s.is_empty() { 0.0 } else { s.iter().sum::<f64>() / n };
            ChannelStats { count: n, mean: m, m2: s.iter().map(|x| (x - m).powi(2)).sum() }
        };
        let whole = st(&v);
        let merged = st(&v[..10]).merge(st(&v[10..10])).merge(st(&v[10..]));
        assert!((whole.mean - merged.mean).abs() < 1e-12 && (whole.m2 - merged.m2).abs() < 1e-9);
        // BN-5: the wire encoding keeps f64 precision
        let mut buf = Vec::new();
        whole.encode(&mut buf);
        let back = ChannelStats::decode(&buf);
        assert!((back.mean - whole.mean).abs() < 1e-12 * whole.mean.abs().max(1.0));
    }
}
