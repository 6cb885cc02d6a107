//! CUDA kernels against the CPU backend and CPU layers on the same inputs (CUDA-1). Each
//! test opens the GPU first and prints `skipped: <reason>` when there is none.

use super::*;
use crate::backend::{naive_gemm, Cpu, GemmShape};
use crate::batchnorm::{BatchNorm, BnKind};
use crate::rng::SplitMix64;
use crate::tensor::Tensor;

fn gpu(test: &str) -> Option<Cuda> {
    match Cuda::open(0) {
        Ok(c) => Some(c),
        Err(e) => {
            println!("{test}: skipped: {e}");
            None
        }
    }
}

fn randn(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= rel * scale, "{what}[{i}]: {g} vs {w} (scale {scale})");
    }
}

#[test]
fn open_without_a_gpu_is_device_unavailable() {
    // CUDA-2: on a host without the driver this must be an error, not a panic.
    match Cuda::open(0) {
        Ok(c) => println!("GPU present ({}): nothing to check", c.device_name()),
        Err(ModelError::DeviceUnavailable(what)) => {
            assert!(what.contains("not found") || what.contains("no CUDA device"), "{what}")
        }
        Err(e) => panic!("expected DeviceUnavailable, got {e}"),
    }
    // An ordinal past the last device is refused the same way.
    if let Err(e) = Cuda::open(1 << 20) {
        assert!(matches!(e, ModelError::DeviceUnavailable(_)), "{e}");
    }
}

#[test]
fn gemm_matches_cpu_for_every_transpose() {
    // CUDA-1
    let Some(cuda) = gpu("gemm_matches_cpu_for_every_transpose") else { return };
    let mut rng = SplitMix64::new(3);
    for &(m, n, k) in
        &[(1, 1, 1), (3, 5, 7), (17, 9, 33), (64, 40, 1), (0, 3, 2), (2, 3, 0), (128, 96, 200)]
    {
        let a = randn(&mut rng, m * k);
        let b = randn(&mut rng, k * n);
        for ta in [false, true] {
            for tb in [false, true] {
                let mut want = vec![0.0; m * n];
                naive_gemm(GemmShape { m, n, k, trans_a: ta, trans_b: tb }, &a, &b, &mut want);
                let mut got = vec![7.0; m * n];
                cuda.gemm(GemmShape { m, n, k, trans_a: ta, trans_b: tb }, &a, &b, &mut got, false)
                    .unwrap();
                assert_close(&format!("{m}x{n}x{k} ta={ta} tb={tb}"), &got, &want, 1e-4);
                let mut cpu = vec![1.0; m * n];
                Cpu::new()
                    .gemm(GemmShape { m, n, k, trans_a: ta, trans_b: tb }, &a, &b, &mut cpu, true)
                    .unwrap();
                let mut acc = vec![1.0; m * n];
                cuda.gemm(GemmShape { m, n, k, trans_a: ta, trans_b: tb }, &a, &b, &mut acc, true)
                    .unwrap();
                assert_close("accumulate", &acc, &cpu, 1e-4);
            }
        }
    }
}

#[test]
fn elementwise_kernels_match_cpu() {
    // CUDA-1: relu, relu_backward, axpy; sizes around the block size.
    let Some(cuda) = gpu("elementwise_kernels_match_cpu") else { return };
    let mut rng = SplitMix64::new(4);
    for n in [0, 1, 255, 256, 257, 10_000] {
        let x = randn(&mut rng, n);
        let (mut want, mut got) = (x.clone(), x.clone());
        Cpu::new().relu(&mut want).unwrap();
        cuda.relu(&mut got).unwrap();
        assert_eq!(got, want, "relu n={n}");

        let g = randn(&mut rng, n);
        let (mut want, mut got) = (g.clone(), g.clone());
        Cpu::new().relu_backward(&x, &mut want).unwrap();
        cuda.relu_backward(&x, &mut got).unwrap();
        assert_eq!(got, want, "relu_backward n={n}");

        let (mut want, mut got) = (g.clone(), g.clone());
        Cpu::new().axpy(-0.37, &x, &mut want).unwrap();
        cuda.axpy(-0.37, &x, &mut got).unwrap();
        assert_close("axpy", &got, &want, 1e-6);
    }
}

#[test]
fn batchnorm_statistics_normalisation_and_backward_match_the_cpu_layer() {
    // CUDA-1: [N, C] and [N, C, H, W] layouts; the GPU path computes stats, normalises and
    // back-propagates with the kernels; the CPU path is the BatchNorm layer itself.
    let Some(cuda) = gpu("batchnorm_statistics_normalisation_and_backward_match_the_cpu_layer")
    else {
        return;
    };
    let mut rng = SplitMix64::new(5);
    for (shape, kind) in
        [(vec![37, 5], BnKind::D1), (vec![1000, 3], BnKind::D1), (vec![6, 4, 7, 9], BnKind::D2)]
    {
        let (n, c) = (shape[0], shape[1]);
        let s: usize = shape[2..].iter().product();
        let bn = BnShape { n, c, s };
        let layer = BatchNorm { num_features: c, eps: 1e-5, momentum: 0.1, kind, sync: false };
        let mut params = randn(&mut rng, 2 * c);
        params[..c].iter_mut().for_each(|w| *w += 1.0);
        let x: Vec<f32> = randn(&mut rng, n * c * s).iter().map(|v| 3.0 * v + 1.5).collect();
        let input = Tensor::new(shape.clone(), x.clone()).unwrap();

        let stats = layer.local_stats(&input).unwrap();
        let dx = cuda.upload(&x).unwrap();
        let (mean, m2) = cuda.bn_stats_dev(&dx, bn).unwrap();
        let (mean, m2) = (cuda.download(&mean).unwrap(), cuda.download(&m2).unwrap());
        let want_mean: Vec<f32> = stats.iter().map(|st| st.mean as f32).collect();
        let want_m2: Vec<f32> = stats.iter().map(|st| st.m2 as f32).collect();
        assert_close("mean", &mean, &want_mean, 1e-5);
        assert_close("m2", &m2, &want_m2, 1e-4);

        let mut buffers = layer.init_buffers();
        let (y_cpu, saved) = layer.forward(&params, &mut buffers, input, true, None).unwrap();
        let count = (n * s) as f64;
        let invstd: Vec<f32> =
            stats.iter().map(|st| (1.0 / (st.m2 / count + 1e-5).sqrt()) as f32).collect();
        assert_close("invstd", &invstd, saved.invstd(), 1e-5);
        let (d_mean, d_invstd) = (cuda.upload(&want_mean).unwrap(), cuda.upload(&invstd).unwrap());
        let (w, b) = (cuda.upload(&params[..c]).unwrap(), cuda.upload(&params[c..]).unwrap());
        let mut xhat = cuda.upload(&x).unwrap();
        let y = cuda.bn_normalize_dev(&mut xhat, &d_mean, &d_invstd, &w, &b, bn).unwrap();
        assert_close("y", &cuda.download(&y).unwrap(), y_cpu.as_f32().unwrap(), 1e-5);

        let dy_host = randn(&mut rng, n * c * s);
        let grad_out = Tensor::new(shape.clone(), dy_host.clone()).unwrap();
        let mut grads = vec![0.0f32; 2 * c];
        let dx_cpu = layer.backward(&params, &saved, &grad_out, &mut grads, None).unwrap();
        let dy = cuda.upload(&dy_host).unwrap();
        let (sdy, sdyx) = cuda.bn_backward_reduce_dev(&dy, &xhat, bn).unwrap();
        assert_close("grad weight", &cuda.download(&sdyx).unwrap(), &grads[..c], 1e-4);
        assert_close("grad bias", &cuda.download(&sdy).unwrap(), &grads[c..], 1e-4);
        let sums = BnGradSums { sum_dy: &sdy, sum_dy_xhat: &sdyx, count: count as f32 };
        let dx_gpu = cuda.bn_backward_dx_dev(&dy, &xhat, &d_invstd, &w, sums, bn).unwrap();
        assert_close("dx", &cuda.download(&dx_gpu).unwrap(), dx_cpu.as_f32().unwrap(), 1e-4);
    }
}

/// torch.optim.SGD, written out independently of the kernel.
fn sgd_ref(p: &mut [f32], g: &[f32], buf: &mut [f32], hp: SgdStep) {
    let SgdStep { lr, momentum: mom, dampening: damp, weight_decay: wd, nesterov: nest, step } = hp;
    for i in 0..p.len() {
        let mut d = g[i] + wd * p[i];
        if mom != 0.0 {
            buf[i] = if step == 1 { d } else { mom * buf[i] + (1.0 - damp) * d };
            d = if nest { d + mom * buf[i] } else { buf[i] };
        }
        p[i] -= lr * d;
    }
}

/// torch.optim.AdamW (state interleaved m, v), in f64 for the reference.
fn adamw_ref(p: &mut [f32], g: &[f32], st: &mut [f32], hp: AdamWStep) {
    let AdamWStep { lr, beta1: b1, beta2: b2, eps, weight_decay: wd, step } = hp;
    let t = step as i32;
    for i in 0..p.len() {
        let (b1, b2, gi) = (b1 as f64, b2 as f64, g[i] as f64);
        let mut pi = p[i] as f64 * (1.0 - lr as f64 * wd as f64);
        let m = b1 * st[2 * i] as f64 + (1.0 - b1) * gi;
        let v = b2 * st[2 * i + 1] as f64 + (1.0 - b2) * gi * gi;
        let mhat = m / (1.0 - b1.powi(t));
        let vhat = v / (1.0 - b2.powi(t));
        pi -= lr as f64 * mhat / (vhat.sqrt() + eps as f64);
        p[i] = pi as f32;
        st[2 * i] = m as f32;
        st[2 * i + 1] = v as f32;
    }
}

#[test]
fn optimizer_kernels_match_the_reference_over_several_steps() {
    // CUDA-1: SGD (plain, momentum, nesterov, weight decay) and AdamW, five steps each.
    let Some(cuda) = gpu("optimizer_kernels_match_the_reference_over_several_steps") else {
        return;
    };
    let mut rng = SplitMix64::new(6);
    let n = 1000;
    for (momentum, dampening, weight_decay, nesterov) in
        [(0.0, 0.0, 0.0, false), (0.9, 0.1, 1e-2, false), (0.9, 0.0, 0.0, true)]
    {
        let mut p = randn(&mut rng, n);
        let mut buf = vec![0.0f32; n];
        let mut dp = cuda.upload(&p).unwrap();
        let mut dbuf = cuda.zeros(n).unwrap();
        for step in 1..=5 {
            let g = randn(&mut rng, n);
            let hp = SgdStep { lr: 0.05, momentum, dampening, weight_decay, nesterov, step };
            sgd_ref(&mut p, &g, &mut buf, hp);
            let dg = cuda.upload(&g).unwrap();
            cuda.sgd_dev(&mut dp, &dg, &mut dbuf, hp).unwrap();
        }
        assert_close("sgd params", &cuda.download(&dp).unwrap(), &p, 1e-5);
    }
    let mut p = randn(&mut rng, n);
    let mut st = vec![0.0f32; 2 * n];
    let mut dp = cuda.upload(&p).unwrap();
    let mut dst = cuda.zeros(2 * n).unwrap();
    for step in 1..=5 {
        let g = randn(&mut rng, n);
        let hp =
            AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step };
        adamw_ref(&mut p, &g, &mut st, hp);
        let dg = cuda.upload(&g).unwrap();
        cuda.adamw_dev(&mut dp, &dg, &mut dst, hp).unwrap();
    }
    assert_close("adamw params", &cuda.download(&dp).unwrap(), &p, 1e-5);
    assert_close("adamw state", &cuda.download(&dst).unwrap(), &st, 1e-4);
}

#[test]
fn gemm_throughput_is_reported() {
    let Some(cuda) = gpu("gemm_throughput_is_reported") else { return };
    let t = cublas_tflops(&cuda, 4096, 4096, 4096, 5).unwrap();
    println!("figure: cublas sgemm 4096^3 (backend) on {}: {t:.1} TFLOP/s", cuda.device_name());
    assert!(t.is_finite() && t > 0.0);
}

/// The kernel sources compile with NVRTC (cnn.cu with the device's options, `--fmad=false`),
/// and every kernel the two loaders look up is in
/// the PTX (so `load_function` finds it). NVRTC needs no GPU: where libnvrtc is found (CI
/// installs NVIDIA's `nvidia-cuda-nvrtc-cu12` wheel for this), this runs without a device.
#[test]
fn the_kernel_sources_compile_with_nvrtc() {
    // SAFETY: only tries to dlopen libnvrtc by its usual names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("skipped: the_kernel_sources_compile_with_nvrtc: libnvrtc.so not found");
        return;
    }
    let ptx = |src: &str, what: &str| -> String {
        cudarc::nvrtc::compile_ptx(src).unwrap_or_else(|e| panic!("{what}: {e:?}")).to_src()
    };
    let entries = |ptx: &str| -> Vec<String> {
        ptx.lines()
            .filter_map(|l| l.split(".entry ").nth(1))
            .map(|n| n.trim_end_matches(['(', ' ']).to_string())
            .collect()
    };
    let ops_ptx = ptx(super::device::OPS_CU, "ops.cu");
    let base = entries(&ptx(KERNELS_CU, "kernels.cu"));
    let ops = entries(&ops_ptx);
    let cnn_ptx = super::device_ops::compile_cnn().unwrap_or_else(|e| panic!("cnn.cu: {e:?}"));
    let cnn = entries(&cnn_ptx.to_src());
    // The attention kernels take the device's `AttnLayout` by value: a parameter of its
    // bytes in each (a field added on one side only would change one size, not both).
    let layout = format!("[{}]", super::device_ops::ATTN_LAYOUT_BYTES);
    for name in ["attn_fwd_f32", "attn_bwd_dq_f32", "attn_bwd_dkdv_f32", "attn_bwd_dkdv_tokens_f32"]
    {
        let param = format!(".b8 {name}_param_");
        assert!(
            ops_ptx.lines().any(|l| l.contains(&param) && l.contains(&layout)),
            "{name}: no {layout}-byte layout parameter in the PTX"
        );
    }
    // The names the loaders ask for, read from their source: `f("name")` in this module's
    // `Cuda::open`, `f(&base, "name")` and `f(&ops, "name")` in the device's.
    let wanted = |src: &str, open: &str| -> Vec<String> {
        src.split(open).skip(1).filter_map(|s| s.split('"').next()).map(str::to_string).collect()
    };
    let (mod_src, dev_src) = (include_str!("mod.rs"), include_str!("device_ops.rs"));
    let checks = [
        (wanted(mod_src, "f(\""), &base, "kernels.cu"),
        (wanted(dev_src, "f(&base, \""), &base, "kernels.cu"),
        (wanted(dev_src, "f(&ops, \""), &ops, "ops.cu"),
        (wanted(dev_src, "f(&cnn, \""), &cnn, "cnn.cu"),
    ];
    let mut n = 0;
    for (names, have, file) in checks {
        assert!(!names.is_empty(), "no kernel name found for {file}");
        for name in names {
            assert!(have.contains(&name), "{name} is not an entry of {file}: {have:?}");
            n += 1;
        }
    }
    println!("{n} kernel lookups found in the PTX of kernels.cu, ops.cu and cnn.cu");
}
