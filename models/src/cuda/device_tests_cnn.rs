//! The convolutional models' ops (convolution, max and global average pooling, BatchNorm on
//! the exact route, the f64 conversions) on the CUDA device against the host device, with
//! the helpers of `device_tests.rs`. The pure data moves (argmax, conversions) must match bit
//! for bit, f64 results (as element pairs) decoded within a relative tolerance, the rest
//! within CUDA-1's tolerances. Each test opens GPU 0 first and prints `skipped: <reason>`
//! when there is none.

use shardline_collectives::device::CpuDevice;

use super::device::CudaDevice;
use super::device_tests::{assert_close, gpu, randn, run_on, ELEMENTWISE, REDUCTION};
use crate::conv::Conv2d;
use crate::layers::MaxPool2d;
use crate::ops::{load_f64, store_f64, BnDims, ConvDims, Op, PoolDims};
use crate::rng::SplitMix64;

/// How a written buffer is compared.
#[derive(Clone, Copy, Debug)]
enum Cmp {
    /// Elementwise within `rel` of the largest value ([`assert_close`]).
    Close(f32),
    /// `f64`s as element pairs ([`store_f64`]), each within `rel` of the largest.
    F64(f64),
    /// Bit for bit.
    Bits,
}

fn pairs(v: &[f32]) -> Vec<f64> {
    v.chunks_exact(2).map(load_f64).collect()
}

fn compare(what: &str, got: &[f32], want: &[f32], cmp: Cmp) {
    match cmp {
        Cmp::Close(rel) => assert_close(what, got, want, rel),
        Cmp::F64(rel) => {
            let (g, w) = (pairs(got), pairs(want));
            assert_eq!(g.len(), w.len(), "{what}: lengths");
            let scale = w.iter().filter(|v| v.is_finite()).fold(1.0f64, |m, v| m.max(v.abs()));
            for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                assert!((a - b).abs() <= rel * scale, "{what}[{i}]: {a} vs {b} (scale {scale})");
            }
        }
        Cmp::Bits => {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got), bits(want), "{what}: bits");
        }
    }
}

/// `op` on the GPU against the host device, each write compared as `cmp` says.
fn check_as(d: &CudaDevice, op: Op, reads: &[Vec<f32>], writes: &[Vec<f32>], cmp: &[Cmp]) {
    assert_eq!(writes.len(), cmp.len(), "{op:?}: a comparison per write");
    let want = run_on(&CpuDevice::new(), &op, reads, writes);
    let got = run_on(d, &op, reads, writes);
    for (i, ((g, w), c)) in got.iter().zip(&want).zip(cmp).enumerate() {
        compare(&format!("{op:?} write {i}"), g, w, *c);
    }
}

/// The host device's writes of `op` (to build another op's inputs).
fn host(op: &Op, reads: &[Vec<f32>], writes: &[Vec<f32>]) -> Vec<Vec<f32>> {
    run_on(&CpuDevice::new(), op, reads, writes)
}

fn conv(
    cin: usize,
    cout: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    bias: bool,
) -> Conv2d {
    Conv2d { in_channels: cin, out_channels: cout, kernel, stride, padding, bias }
}

#[test]
fn convolution_matches_the_host_device() {
    let Some(d) = gpu("convolution_matches_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(41);
    // (layer, n, h, w): padding 1 stride 2 with bias; 3x3 stride 1 without; 1x1 stride 2;
    // a kernel wider than the input with padding; a convolution of 30 samples whose
    // columns (144 x 4096 per sample) take two chunks.
    let cases = [
        (conv(3, 4, 3, 2, 1, true), 2, 7, 6),
        (conv(2, 3, 3, 1, 1, false), 3, 5, 5),
        (conv(3, 2, 1, 2, 0, false), 2, 5, 6),
        (conv(1, 2, 4, 1, 1, true), 2, 3, 3),
        (conv(16, 4, 3, 1, 1, true), 30, 64, 64),
    ];
    for (layer, n, h, w) in cases {
        let dims = ConvDims { conv: layer.clone(), n, h, w };
        let (ho, wo) = (layer.out_size(h), layer.out_size(w));
        let params = randn(&mut rng, layer.num_params());
        let x = randn(&mut rng, n * layer.in_channels * h * w);
        let y_len = n * layer.out_channels * ho * wo;
        let reads = [params.clone(), x.clone()];
        let op = Op::Conv2dForward(dims.clone());
        check_as(&d, op, &reads, &[randn(&mut rng, y_len)], &[Cmp::Close(REDUCTION)]);
        // The gradients add onto what the buffer holds; dx is overwritten.
        let dy = randn(&mut rng, y_len);
        let writes = [randn(&mut rng, layer.num_params()), randn(&mut rng, x.len())];
        let cmp = [Cmp::Close(REDUCTION), Cmp::Close(REDUCTION)];
        check_as(&d, Op::Conv2dBackward(dims), &[params, x, dy], &writes, &cmp);
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

#[test]
fn max_pooling_matches_the_host_device() {
    let Some(d) = gpu("max_pooling_matches_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(42);
    // 3x3 stride 2 (overlapping windows: an input may be several outputs' argmax) and 2x2
    // stride 2; values rounded to a few levels, so windows hold ties (the first wins).
    for (kernel, stride, n, c, h, w) in [(3, 2, 2, 3, 9, 8), (2, 2, 2, 3, 8, 6), (3, 2, 1, 2, 4, 3)]
    {
        let dims = PoolDims { pool: MaxPool2d { kernel, stride }, n, c, h, w };
        let y_len = n * c * dims.pool.out_size(h) * dims.pool.out_size(w);
        let x: Vec<f32> =
            randn(&mut rng, n * c * h * w).iter().map(|v| (v * 2.0).round()).collect();
        let fwd = Op::MaxPoolForward(dims.clone());
        let writes = [vec![0.0; y_len], vec![0.0; y_len]];
        check_as(&d, fwd.clone(), std::slice::from_ref(&x), &writes, &[Cmp::Bits, Cmp::Bits]);
        let argmax = host(&fwd, std::slice::from_ref(&x), &writes).swap_remove(1);
        let dy = randn(&mut rng, y_len);
        let bwd = Op::MaxPoolBackward(dims);
        let dx = randn(&mut rng, x.len());
        check_as(&d, bwd, &[argmax, dy], &[dx], &[Cmp::Close(ELEMENTWISE)]);
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

#[test]
fn global_average_pooling_matches_the_host_device() {
    let Some(d) = gpu("global_average_pooling_matches_the_host_device", None) else { return };
    let mut rng = SplitMix64::new(43);
    for (n, c, s) in [(3, 4, 49), (2, 5, 1), (1, 3, 300)] {
        let dims = BnDims { n, c, s };
        let x = randn(&mut rng, n * c * s);
        let fwd = Op::GlobalAvgPool(dims);
        check_as(&d, fwd, &[x], &[randn(&mut rng, n * c)], &[Cmp::Close(ELEMENTWISE)]);
        let bwd = Op::GlobalAvgPoolBackward(dims);
        let dy = randn(&mut rng, n * c);
        check_as(&d, bwd, &[dy], &[randn(&mut rng, n * c * s)], &[Cmp::Close(ELEMENTWISE)]);
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

/// `[n, c, s]` values with a channel offset and scale, as BatchNorm inputs are.
fn bn_input(rng: &mut SplitMix64, d: BnDims) -> Vec<f32> {
    randn(rng, d.n * d.c * d.s).iter().map(|v| 3.0 * v + 1.5).collect()
}

#[test]
fn batch_norm_statistics_encode_and_merge_match_the_host_device() {
    let test = "batch_norm_statistics_encode_and_merge_match_the_host_device";
    let Some(d) = gpu(test, None) else { return };
    let mut rng = SplitMix64::new(44);
    // s == 1 and s > 1; three ranks, one with an empty slice.
    for (c, s, ns) in [(5, 1, [37usize, 0, 11]), (4, 63, [6, 2, 0]), (3, 300, [1, 4, 2])] {
        let mut records = Vec::new();
        for n in ns {
            let dims = BnDims { n, c, s };
            let x = bn_input(&mut rng, dims);
            let stats_op = Op::BatchNormLocalStats(dims);
            let writes = [randn(&mut rng, 6 * c)];
            check_as(&d, stats_op.clone(), std::slice::from_ref(&x), &writes, &[Cmp::F64(1e-13)]);
            let stats = host(&stats_op, &[x], &writes).swap_remove(0);
            let enc = Op::BatchNormEncode { c };
            let writes = [vec![0.0; 6 * c]];
            check_as(&d, enc.clone(), std::slice::from_ref(&stats), &writes, &[Cmp::Bits]);
            records.extend(host(&enc, &[stats], &writes).swap_remove(0));
        }
        let merge = Op::BatchNormMerge { c, world: ns.len() };
        check_as(&d, merge, &[records], &[randn(&mut rng, 6 * c)], &[Cmp::F64(1e-13)]);
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

/// Running statistics `[mean c, var c, batches]`.
fn running(rng: &mut SplitMix64, c: usize) -> Vec<f32> {
    let mut b = randn(rng, c);
    b.extend(randn(rng, c).iter().map(|v| 0.5 + v.abs()));
    b.push(3.0);
    b
}

#[test]
fn batch_norm_train_eval_and_backward_match_the_host_device() {
    let test = "batch_norm_train_eval_and_backward_match_the_host_device";
    let Some(d) = gpu(test, None) else { return };
    let mut rng = SplitMix64::new(45);
    for (n, c, s) in [(37, 5, 1), (6, 4, 63), (2, 3, 1), (3, 2, 300)] {
        let dims = BnDims { n, c, s };
        let len = n * c * s;
        let x = bn_input(&mut rng, dims);
        let stats =
            host(&Op::BatchNormLocalStats(dims), std::slice::from_ref(&x), &[vec![0.0; 6 * c]])
                .swap_remove(0);
        let mut params = randn(&mut rng, 2 * c);
        params[..c].iter_mut().for_each(|w| *w += 1.0);
        let train = Op::BatchNormTrain { dims, eps: 1e-5, momentum: 0.1 };
        let reads = [x.clone(), params.clone(), stats];
        let writes =
            [vec![0.0; len], vec![0.0; len], vec![0.0; c], vec![0.0; 2], running(&mut rng, c)];
        let close = Cmp::Close(ELEMENTWISE);
        check_as(&d, train.clone(), &reads, &writes, &[close, close, close, Cmp::Bits, close]);
        let saved = host(&train, &reads, &writes);
        let (xhat, invstd) = (saved[1].clone(), saved[2].clone());

        let eval = Op::BatchNormEval { dims, eps: 1e-5 };
        let reads = [x.clone(), params.clone(), running(&mut rng, c)];
        check_as(&d, eval, &reads, &[randn(&mut rng, len)], &[close]);

        let dy = randn(&mut rng, len);
        let sums_op = Op::BatchNormGradSums(dims);
        let reads = [dy.clone(), xhat.clone()];
        let writes = [randn(&mut rng, 4 * c), randn(&mut rng, 2 * c)];
        check_as(&d, sums_op.clone(), &reads, &writes, &[Cmp::F64(1e-12), Cmp::Close(REDUCTION)]);
        let sums = host(&sums_op, &reads, &writes).swap_remove(0);

        let mut count = vec![0.0; 2];
        store_f64((n * s) as f64, &mut count);
        let dx_op = Op::BatchNormGradDx(dims);
        let reads = [params.clone(), xhat, invstd, sums, count, dy];
        check_as(&d, dx_op, &reads, &[randn(&mut rng, len)], &[Cmp::Close(REDUCTION)]);
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

#[test]
fn batch_norm_train_with_one_value_per_channel_writes_nan_and_keeps_the_running_stats() {
    // The host refuses a count of at most 1 (BN-4); the kernel cannot, and shows it instead.
    let test = "batch_norm_train_with_one_value_per_channel_writes_nan_and_keeps_the_running_stats";
    let Some(d) = gpu(test, None) else { return };
    let mut rng = SplitMix64::new(46);
    let dims = BnDims { n: 1, c: 3, s: 1 };
    let x = randn(&mut rng, 3);
    let stats = host(&Op::BatchNormLocalStats(dims), std::slice::from_ref(&x), &[vec![0.0; 18]])
        .swap_remove(0);
    let buffers = running(&mut rng, 3);
    let train = Op::BatchNormTrain { dims, eps: 1e-5, momentum: 0.1 };
    let writes = [vec![0.0; 3], vec![0.0; 3], vec![0.0; 3], vec![0.0; 2], buffers.clone()];
    let got = run_on(&d, &train, &[x, vec![1.0; 6], stats], &writes);
    assert!(got[0].iter().chain(&got[1]).chain(&got[2]).all(|v| v.is_nan()), "{got:?}");
    assert_eq!(load_f64(&got[3]), 1.0);
    assert_eq!(got[4], buffers, "running statistics");
    assert!(d.failure().is_none(), "{:?}", d.failure());
}

#[test]
fn f64_conversions_match_the_host_device_bit_for_bit() {
    let Some(d) = gpu("f64_conversions_match_the_host_device_bit_for_bit", None) else { return };
    let mut rng = SplitMix64::new(47);
    let mut values: Vec<f32> = randn(&mut rng, 1000).iter().map(|v| v * 1e3).collect();
    values.extend([0.0, -0.0, 1e-40, -1e-45, f32::MAX, f32::INFINITY, f32::NEG_INFINITY]);
    let widened = vec![0.0; 2 * values.len()];
    check_as(&d, Op::F32ToF64, std::slice::from_ref(&values), &[widened], &[Cmp::Bits]);
    let mut pairs = vec![0.0f32; 2 * values.len()];
    for (i, v) in values.iter().enumerate() {
        // Values with bits below f32's precision, past its range, and specials.
        let wide = f64::from(*v) * (1.0 + 1e-12) * if i % 7 == 0 { 1e300 } else { 1.0 };
        store_f64(wide, &mut pairs[2 * i..2 * i + 2]);
    }
    let narrowed = vec![0.0; values.len()];
    check_as(&d, Op::F64ToF32, &[pairs], &[narrowed], &[Cmp::Bits]);
    for n in [0usize, 1] {
        let (one, two) = (randn(&mut rng, n), randn(&mut rng, 2 * n));
        check_as(
            &d,
            Op::F32ToF64,
            std::slice::from_ref(&one),
            std::slice::from_ref(&two),
            &[Cmp::Bits],
        );
        check_as(&d, Op::F64ToF32, &[two], &[one], &[Cmp::Bits]);
    }
    assert!(d.failure().is_none(), "{:?}", d.failure());
}
