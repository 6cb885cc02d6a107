//! Tests of the blocked attention, its token route and nanoGPT's split and merge
//! (ATTN-1..5), against materialised references, finite differences and torch.

use super::*;
use crate::rng::SplitMix64;

fn shape(batch: usize, heads: usize, seq: usize, head_dim: usize) -> AttnShape {
    AttnShape { batch, heads, seq, head_dim }
}

/// Uniform values in [-2, 2).
fn rand_vec(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| 4.0 * rng.next_f64() - 2.0).collect()
}

fn rand_qkv(s: AttnShape, seed: u64) -> Qkv<f64> {
    let n = s.numel();
    Qkv { q: rand_vec(n, seed), k: rand_vec(n, seed ^ 0x1111), v: rand_vec(n, seed ^ 0x2222) }
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// Attention with the whole `seq x seq` probability matrix of every (batch, head)
/// materialised: returns (output, probabilities `[batch, heads, seq, seq]`, logsumexp).
fn naive_forward(s: AttnShape, x: &Qkv<f64>) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, d) = (s.seq, s.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let mut o = vec![0.0; s.numel()];
    let mut p = vec![0.0; s.batch * s.heads * t * t];
    let mut lse = vec![0.0; s.rows()];
    for bh in 0..s.batch * s.heads {
        let base = bh * t * d;
        for i in 0..t {
            let scores: Vec<f64> = (0..=i)
                .map(|j| {
                    (0..d).map(|c| x.q[base + i * d + c] * x.k[base + j * d + c]).sum::<f64>()
                        * scale
                })
                .collect();
            let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = scores.iter().map(|v| (v - mx).exp()).sum();
            lse[bh * t + i] = mx + z.ln();
            for (j, sc) in scores.iter().enumerate() {
                let pij = (sc - mx).exp() / z;
                p[(bh * t + i) * t + j] = pij;
                for c in 0..d {
                    o[base + i * d + c] += pij * x.v[base + j * d + c];
                }
            }
        }
    }
    (o, p, lse)
}

/// The backward of [`naive_forward`] from its materialised probabilities:
/// `dV = P^T dO`, `dP = dO V^T`, `dS = P * (dP - rowsum(P * dP))`, `dQ = scale dS K`,
/// `dK = scale dS^T Q`.
fn naive_backward(s: AttnShape, x: &Qkv<f64>, p: &[f64], go: &[f64]) -> AttnGrads<f64> {
    let (t, d) = (s.seq, s.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let n = s.numel();
    let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    for bh in 0..s.batch * s.heads {
        let base = bh * t * d;
        for i in 0..t {
            let prow = &p[(bh * t + i) * t..(bh * t + i + 1) * t];
            let dp: Vec<f64> = (0..t)
                .map(|j| (0..d).map(|c| go[base + i * d + c] * x.v[base + j * d + c]).sum())
                .collect();
            let dot: f64 = prow.iter().zip(&dp).map(|(a, b)| a * b).sum();
            for j in 0..t {
                let ds = prow[j] * (dp[j] - dot) * scale;
                for c in 0..d {
                    dv[base + j * d + c] += prow[j] * go[base + i * d + c];
                    dq[base + i * d + c] += ds * x.k[base + j * d + c];
                    dk[base + j * d + c] += ds * x.q[base + i * d + c];
                }
            }
        }
    }
    AttnGrads { dq, dk, dv }
}

/// ATTN-1: forward keeps exactly q, k, v (the caller's buffers), the output and one
/// logsumexp per (batch, head, row): nothing of size seq x seq, for any block size.
#[test]
fn saved_state_is_qkv_output_and_logsumexp() {
    // The struct holds three metered vectors, the shape, the block size, the layout and
    // the dropout key and nothing else, so no field can hold scores or a mask: a new field
    // changes its size.
    assert_eq!(
        std::mem::size_of::<AttnSaved<f64>>(),
        3 * std::mem::size_of::<crate::meter::Metered<f64>>()
            + std::mem::size_of::<AttnShape>()
            + std::mem::size_of::<usize>()
            + std::mem::size_of::<Layout>()
            + std::mem::size_of::<Option<AttnDropout>>()
    );
    for (s, block) in [(shape(2, 3, 37, 4), 8), (shape(1, 2, 64, 3), 64), (shape(2, 2, 1, 3), 5)] {
        let x = rand_qkv(s, 7);
        let saved = attention_forward(s, block, None, x).unwrap();
        assert_eq!(saved.src.len(), 3 * s.numel(), "q, k, v");
        assert_eq!(saved.o.len(), s.numel(), "output");
        assert_eq!(saved.lse.len(), s.batch * s.heads * s.seq, "one logsumexp per row");
        assert_eq!(saved.saved_values(), 4 * s.numel() + s.rows());
        assert_eq!(saved.output().len(), s.numel());
        // The token route keeps the caller's fused buffer itself, no copy, and leaves
        // the output with the caller.
        let qkv = rand_vec(3 * s.numel(), 8);
        let ptr = qkv.as_ptr();
        let mut out = vec![0.0; s.numel()];
        let saved = attention_forward_tokens(s, block, None, qkv, &mut out).unwrap();
        assert_eq!(saved.src.as_ptr(), ptr, "q, k, v are kept without copying");
        assert_eq!(saved.saved_values() + out.len(), 4 * s.numel() + s.rows());
    }
}

/// ATTN-5: the token route equals split, heads apart and merge, forward and backward,
/// with and without dropout, for several block sizes.
#[test]
fn token_route_equals_split_and_merge_attn_5() {
    use crate::nn::dropout::DropoutKey;
    let key = DropoutKey { seed: 3, step: 1, layer: 1 };
    for (s, block) in [(shape(2, 3, 13, 4), 4), (shape(1, 2, 9, 5), 64), (shape(3, 1, 1, 2), 1)] {
        let qkv = rand_vec(3 * s.numel(), 61);
        let dy = rand_vec(s.numel(), 62);
        for dropout in [None, AttnDropout::new(0.3, key, 5).unwrap()] {
            let at = format!("{s:?} block {block} dropout {}", dropout.is_some());
            let saved = attention_forward(s, block, dropout, split_qkv(s, &qkv).unwrap()).unwrap();
            let y = merge_heads(s, saved.output()).unwrap();
            let g = attention_backward(&saved, &merge_heads_backward(s, &dy).unwrap()).unwrap();
            let dqkv = split_qkv_backward(s, &g).unwrap();
            let mut out = vec![f64::NAN; s.numel()];
            let tok = attention_forward_tokens(s, block, dropout, qkv.clone(), &mut out).unwrap();
            assert!(max_diff(&out, &y) < 1e-12, "{at}: output");
            assert!(max_diff(tok.logsumexp(), saved.logsumexp()) < 1e-12, "{at}: lse");
            let got = attention_backward_tokens(&tok, &out, &dy).unwrap();
            assert!(max_diff(&got, &dqkv) < 1e-12, "{at}: dqkv");
            // Each route's backward refuses the other route's saved state.
            assert!(attention_backward(&tok, &merge_heads_backward(s, &dy).unwrap()).is_err());
            assert!(attention_backward_tokens(&saved, &out, &dy).is_err());
        }
    }
}

/// ATTN-2: blocked forward (output and logsumexp) and backward equal the materialised
/// computation, for block sizes that divide seq, do not, exceed it, and for seq = 1.
#[test]
fn blocked_equals_materialised_attention() {
    for seq in [1, 2, 3, 5, 7, 8, 13, 16, 33] {
        let s = shape(2, 3, seq, 4);
        let x = rand_qkv(s, 100 + seq as u64);
        let (o, p, lse) = naive_forward(s, &x);
        let go = rand_vec(s.numel(), 200 + seq as u64);
        let want = naive_backward(s, &x, &p, &go);
        for block in [1, 2, 3, 4, 5, 8, 16, 32, 64] {
            let saved = attention_forward(s, block, None, x.clone()).unwrap();
            let at = format!("seq {seq} block {block}");
            assert!(max_diff(saved.output(), &o) < 1e-12, "{at}: output");
            assert!(max_diff(saved.logsumexp(), &lse) < 1e-12, "{at}: logsumexp");
            let g = attention_backward(&saved, &go).unwrap();
            assert!(max_diff(&g.dq, &want.dq) < 1e-12, "{at}: dq");
            assert!(max_diff(&g.dk, &want.dk) < 1e-12, "{at}: dk");
            assert!(max_diff(&g.dv, &want.dv) < 1e-12, "{at}: dv");
        }
    }
}

/// The f32 instantiation agrees with the f64 reference to f32 rounding.
#[test]
fn f32_matches_f64_reference() {
    let s = shape(2, 2, 19, 8);
    let x = rand_qkv(s, 31);
    let (o, p, _) = naive_forward(s, &x);
    let go = rand_vec(s.numel(), 32);
    let want = naive_backward(s, &x, &p, &go);
    let f = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
    let x32 = Qkv { q: f(&x.q), k: f(&x.k), v: f(&x.v) };
    let saved = attention_forward(s, 4, None, x32).unwrap();
    let g = attention_backward(&saved, &f(&go)).unwrap();
    let up = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    assert!(max_diff(&up(saved.output()), &o) < 1e-5);
    assert!(max_diff(&up(&g.dq), &want.dq) < 1e-5);
    assert!(max_diff(&up(&g.dk), &want.dk) < 1e-5);
    assert!(max_diff(&up(&g.dv), &want.dv) < 1e-5);
}

/// Tolerance of the finite-difference check: central differences with step 1e-5 in f64
/// agree with the analytical gradients of these cases to 4e-10.
const FD_TOL: f64 = 1e-7;

/// Compares every element of `grads` with central finite differences of
/// `L = sum(output * r)`; returns one line per element that disagrees by more than
/// [`FD_TOL`].
fn fd_mismatches(
    s: AttnShape,
    block: usize,
    x: &Qkv<f64>,
    r: &[f64],
    grads: &AttnGrads<f64>,
) -> Vec<String> {
    let loss = |x: Qkv<f64>| -> f64 {
        let saved = attention_forward(s, block, None, x).unwrap();
        saved.output().iter().zip(r).map(|(a, b)| a * b).sum()
    };
    let h = 1e-5;
    let mut bad = Vec::new();
    for (which, ana) in [("dq", &grads.dq), ("dk", &grads.dk), ("dv", &grads.dv)] {
        assert_eq!(ana.len(), s.numel(), "{which} length");
        for (i, &ana) in ana.iter().enumerate() {
            let nudge = |delta: f64| {
                let mut y = x.clone();
                match which {
                    "dq" => y.q[i] += delta,
                    "dk" => y.k[i] += delta,
                    _ => y.v[i] += delta,
                }
                loss(y)
            };
            let num = (nudge(h) - nudge(-h)) / (2.0 * h);
            if (num - ana).abs() > FD_TOL {
                bad.push(format!("{which}[{i}]: finite difference {num} vs {ana}"));
            }
        }
    }
    bad
}

const FD_CASES: [(AttnShape, usize); 5] = [
    (AttnShape { batch: 2, heads: 2, seq: 7, head_dim: 3 }, 3),
    (AttnShape { batch: 2, heads: 2, seq: 7, head_dim: 4 }, 2),
    (AttnShape { batch: 2, heads: 2, seq: 5, head_dim: 4 }, 64),
    (AttnShape { batch: 2, heads: 2, seq: 6, head_dim: 3 }, 4),
    (AttnShape { batch: 2, heads: 2, seq: 1, head_dim: 3 }, 1),
];

/// ATTN-3: every element of dq, dk, dv equals the central finite difference in f64.
#[test]
fn gradients_match_finite_differences() {
    let mut worst = 0.0f64;
    for (case, (s, block)) in FD_CASES.into_iter().enumerate() {
        let x = rand_qkv(s, 40 + case as u64);
        let r = rand_vec(s.numel(), 50 + case as u64);
        let saved = attention_forward(s, block, None, x.clone()).unwrap();
        let g = attention_backward(&saved, &r).unwrap();
        let bad = fd_mismatches(s, block, &x, &r, &g);
        assert!(bad.is_empty(), "{s:?} block {block}:\n{}", bad.join("\n"));
        worst = worst.max(g.dq.iter().chain(&g.dk).chain(&g.dv).fold(0.0, |m, v| m.max(v.abs())));
    }
    // The gradients are far from zero, so FD_TOL is a strict bound relative to them.
    assert!(worst > 0.1, "largest gradient {worst}");
}

/// The check of ATTN-3 catches one wrong element: each of dq, dk, dv with a single
/// element off by 1e-6 (ten times the tolerance) is reported, and only that element.
#[test]
fn finite_difference_check_catches_one_wrong_element() {
    let (s, block) = FD_CASES[0];
    let x = rand_qkv(s, 40);
    let r = rand_vec(s.numel(), 50);
    let saved = attention_forward(s, block, None, x.clone()).unwrap();
    let good = attention_backward(&saved, &r).unwrap();
    for (which, i) in [("dq", 17), ("dk", 0), ("dv", s.numel() - 1)] {
        let mut g = good.clone();
        match which {
            "dq" => g.dq[i] += 1e-6,
            "dk" => g.dk[i] += 1e-6,
            _ => g.dv[i] += 1e-6,
        }
        let bad = fd_mismatches(s, block, &x, &r, &g);
        assert_eq!(bad.len(), 1, "{which}[{i}]: {bad:?}");
        assert!(bad[0].starts_with(&format!("{which}[{i}]:")), "{bad:?}");
    }
}

// Reference values from torch 2.15 (float64, CPU), nanoGPT's attention path: split of the
// fused c_attn output, scaled_dot_product_attention with is_causal=True, heads merged:
//
// import math, torch
// import torch.nn.functional as F
// B, T, C, nh = 2, 5, 6, 2
// qkv = torch.tensor([1.5 * math.sin(0.37 * i + 0.1) for i in range(B * T * 3 * C)],
//                    dtype=torch.float64).view(B, T, 3 * C).requires_grad_()
// q, k, v = qkv.split(C, dim=2)
// q = q.view(B, T, nh, C // nh).transpose(1, 2)
// k = k.view(B, T, nh, C // nh).transpose(1, 2)
// v = v.view(B, T, nh, C // nh).transpose(1, 2)
// y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
// y = y.transpose(1, 2).contiguous().view(B, T, C)
// dy = torch.tensor([math.cos(0.23 * i - 0.4) for i in range(B * T * C)],
//                   dtype=torch.float64).view(B, T, C)
// y.backward(dy)
// TORCH_Y = y.reshape(-1).tolist(); TORCH_DQKV = qkv.grad.reshape(-1).tolist()
#[rustfmt::skip]
const TORCH_Y: [f64; 60] = [
    -1.477766672255789, -1.4708075966911036, -1.2647816127846259, -0.887573370946515,
    -0.3902362371457033, 0.159917540671834, -1.4753210936273518, -1.4133231763688219,
    -1.1600385973875145, -0.7360784530806075, -0.2228821730927403, 0.32048016343568836,
    -1.4619896097992198, -1.3885280731956966, -1.1271357757647915, -0.5577105252819042,
    -0.04075124631446944, 0.4817235226688904, -1.4537706799680372, -1.3776724637690307,
    -1.115112742552575, -0.2919622033282493, 0.21243860801221529, 0.6880868503527893,
    -1.4383912298103274, -1.3487180181591127, -1.0765021498723069, 0.02302890479060553,
    0.490593224080914, 0.891758051968725, 0.2106337900245267, 0.7334282824715775,
    1.1569566975537122, 1.42389645115118, 1.498118499885548, 1.3695772376519968,
    0.4645398971819488, 0.9387747564555571, 1.2859508564343765, 1.446341039313009,
    1.4576797832689492, 1.2717284068444314, 0.6718200548874607, 1.0828298943767174,
    1.347283787446758, 1.4364840628622104, 1.4345641795892043, 1.2384827644535952,
    0.7566173643672984, 1.1246071935205884, 1.3403867148017077, 1.4295896644148958,
    1.4291955399931788, 1.2353665038927544, 0.7367713752711335, 1.1037238522202482,
    1.3212924835740107, 1.4235896723563066, 1.4157893210716634, 1.2163685269479232,
];
#[rustfmt::skip]
const TORCH_DQKV: [f64; 180] = [
    0.0, 0.0, 0.0, 0.0,
    0.0, 0.0, 0.04402408264118074, 0.07920614671133011,
    0.1036680303969326, 0.3272071543565622, 0.4075091383633828, 0.43265667220450654,
    0.48481049166284085, 0.5448734314778284, 0.5762394078596105, 0.46145469641674164,
    0.3268177443819309, 0.1749682135755434, -0.006726188036426883, -0.008056323930414607,
    -0.00829607417434473, 0.03118705438592488, 0.023250824207889827, 0.012167704047864089,
    -0.03174873820647402, -0.04174404872622836, -0.04608949808107298, -0.2853767993349799,
    -0.19296920698354403, -0.07444413772635891, -0.08156350766641055, -0.09431712470923481,
    -0.10210332193941532, -0.1710949012199516, -0.16197591786495896, -0.14432611483057134,
    0.06548975130535943, 0.07411567780348963, 0.07271039500327948, 0.23422675778139856,
    0.15637450428420577, 0.05735769521810746, -0.04180811608297787, -0.06114532532377649,
    -0.07220680162769019, -0.2685700456005703, -0.23498946184681177, -0.16960415681748678,
    -0.06307559714303047, -0.05120090133696297, -0.036629596908542665, -0.059188638994437354,
    -0.0006087794141229619, 0.058003142879432035, 0.06352163262635516, 0.0689807187079156,
    0.06510358811553964, 0.025828529308362734, 0.01385509903718725, 6.446108536267009e-06,
    0.007912853020701618, 0.003811579291898192, -0.0008055738131369297, 0.08690626373416932,
    0.002004788876324057, -0.08316802475104111, -0.005328209833236846, 0.0013324336143038917,
    0.007922901500883369, 0.1047807495812135, 0.1566016379234029, 0.2001747549164197,
    -0.10657766732930649, -0.11176554106831371, -0.10182647313957967, -0.4210804405933348,
    -0.16496201282106482, 0.11348324951475133, 0.021619918627570074, 0.019871648046777136,
    0.015433843124968042, 0.1398334268448189, 0.018444741590648964, -0.10544035290961978,
    0.003631168681469059, 0.00545272288970512, 0.006987097396495895, 0.13891299392755213,
    0.1514688170973448, 0.1560472002702482, 0.0, 0.0,
    0.0, 0.0, 0.0, 0.0,
    0.2662686214681966, 0.20607652125419956, 0.11799293063711033, -0.1304001192838877,
    -0.10001089150818447, -0.05608565873914981, 0.7804690981085207, 0.6925053842741828,
    0.5680693439475882, 0.4836387312339821, 0.3827339100077674, 0.2616715615731665,
    0.006335269378378305, -0.0010086910304343139, -0.008216129840261231, 0.01736988481532494,
    0.022416948147317754, 0.02442998271022931, -0.07841049026758447, -0.05385335680391683,
    -0.022007424134356267, 0.009963755011190255, -0.013361728383675574, -0.03487876452451255,
    -0.1756733862011442, -0.1926395676398897, -0.19945996051750808, -0.11621755237011455,
    -0.10058058264319952, -0.07964631424937374, 0.032066461914572714, -0.04530083253582107,
    -0.11653687181830266, 0.03260960239592858, 0.03896773327934705, 0.040051764269306775,
    -0.15044224405526244, -0.09403482900827259, -0.024900240992338632, 0.049513038583061816,
    0.04165364563848951, 0.028156627162832994, -0.20278038740946716, -0.13840273684770182,
    -0.06673580028129192, 0.015868068422001037, 0.033816463273558396, 0.04998383935279346,
    0.0006021258250812275, -0.021187709878348646, -0.04010988844578431, -0.04798134365241625,
    -0.05543644976992825, -0.05538849247522304, -0.03008110576804743, -0.044077839187827234,
    -0.0521088438520253, 0.05069013074362115, 0.052039094422562736, 0.04634481079783829,
    0.03263406839717512, 0.07461614721951326, 0.1126684017476522, 0.02281006118792167,
    0.025139551046065557, 0.02614501089023082, -0.007022283748043371, 0.0807695287443982,
    0.15762956442827306, -0.09484085171849943, -0.10480354734034068, -0.10058157448533336,
    -0.007334781377302044, -0.014110496254182649, -0.01897642165838984, 0.020233194946013996,
    0.019679879830807313, 0.01646298530299065, 0.03575515066661184, 0.039770621513515715,
    0.04169148468576426, 0.006489238224389396, 0.006104394501851819, 0.005398049352227984,
];

/// The torch reference: nanoGPT's split, causal attention and merge, forward and
/// backward, for several block sizes (ATTN-2, ATTN-4).
#[test]
fn matches_torch_scaled_dot_product_attention() {
    let s = shape(2, 2, 5, 3);
    let qkv: Vec<f64> =
        (0..s.batch * s.seq * 3 * s.embd()).map(|i| 1.5 * (0.37 * i as f64 + 0.1).sin()).collect();
    let dy: Vec<f64> =
        (0..s.batch * s.seq * s.embd()).map(|i| (0.23 * i as f64 - 0.4).cos()).collect();
    for block in [1, 2, 3, 4, 64] {
        let saved = attention_forward(s, block, None, split_qkv(s, &qkv).unwrap()).unwrap();
        let y = merge_heads(s, saved.output()).unwrap();
        assert!(max_diff(&y, &TORCH_Y) < 1e-12, "block {block}: y");
        let g = attention_backward(&saved, &merge_heads_backward(s, &dy).unwrap()).unwrap();
        let dqkv = split_qkv_backward(s, &g).unwrap();
        assert!(max_diff(&dqkv, &TORCH_DQKV) < 1e-12, "block {block}: dqkv");
    }
}

/// ATTN-4: split and merge place every value exactly once, in nanoGPT's layout, and their
/// backwards undo them exactly.
#[test]
fn split_and_merge_are_permutations_with_inverse_backward() {
    let s = shape(2, 3, 4, 2);
    let (embd, n) = (s.embd(), s.numel());
    let qkv: Vec<f64> = (0..s.batch * s.seq * 3 * embd).map(|i| i as f64).collect();
    let x = split_qkv(s, &qkv).unwrap();
    // Element (b, h, t, c) of q, k, v is column part * embd + h * head_dim + c of token
    // (b, t).
    for b in 0..s.batch {
        for h in 0..s.heads {
            for t in 0..s.seq {
                for c in 0..s.head_dim {
                    let at = head_index(&s, b, h, t, c);
                    for (part, dst) in [&x.q, &x.k, &x.v].into_iter().enumerate() {
                        let want = qkv[(b * s.seq + t) * 3 * embd + part * embd + h * 2 + c];
                        assert_eq!(dst[at], want);
                    }
                }
            }
        }
    }
    let mut all: Vec<f64> = x.q.iter().chain(&x.k).chain(&x.v).copied().collect();
    all.sort_by(f64::total_cmp);
    assert_eq!(all, qkv, "every value exactly once");
    let back =
        split_qkv_backward(s, &AttnGrads { dq: x.q.clone(), dk: x.k.clone(), dv: x.v.clone() })
            .unwrap();
    assert_eq!(back, qkv);

    let o: Vec<f64> = (0..n).map(|i| i as f64).collect();
    let y = merge_heads(s, &o).unwrap();
    for b in 0..s.batch {
        for t in 0..s.seq {
            for h in 0..s.heads {
                for c in 0..s.head_dim {
                    assert_eq!(
                        y[(b * s.seq + t) * embd + h * 2 + c],
                        o[head_index(&s, b, h, t, c)]
                    );
                }
            }
        }
    }
    let mut sorted = y.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(sorted, o, "every value exactly once");
    assert_eq!(merge_heads_backward(s, &y).unwrap(), o);
    assert_eq!(merge_heads(s, &merge_heads_backward(s, &y).unwrap()).unwrap(), y);
}

#[test]
fn rejects_bad_lengths_and_sizes() {
    let s = shape(1, 2, 3, 4);
    let x = rand_qkv(s, 1);
    assert!(matches!(attention_forward(s, 0, None, x.clone()), Err(ModelError::Config(_))));
    let zero_dim = shape(1, 2, 3, 0);
    let empty: Qkv<f64> = Qkv { q: vec![], k: vec![], v: vec![] };
    assert!(matches!(attention_forward(zero_dim, 4, None, empty), Err(ModelError::Config(_))));
    let mut short = x.clone();
    short.k.pop();
    assert!(matches!(attention_forward(s, 2, None, short), Err(ModelError::Shape { .. })));
    let saved = attention_forward(s, 2, None, x).unwrap();
    assert!(matches!(attention_backward(&saved, &[0.0; 5]), Err(ModelError::Shape { .. })));
    assert!(split_qkv(s, &[0.0f64; 7]).is_err());
    assert!(merge_heads(s, &[0.0f64; 7]).is_err());
    assert!(merge_heads_backward(s, &[0.0f64; 7]).is_err());
    let g = AttnGrads { dq: vec![0.0f64; 24], dk: vec![0.0; 24], dv: vec![0.0; 23] };
    assert!(split_qkv_backward(s, &g).is_err());
    // An empty batch is a valid call with empty results.
    let none = shape(0, 2, 3, 4);
    let saved =
        attention_forward(none, 2, None, Qkv { q: vec![0.0f64; 0], k: vec![], v: vec![] }).unwrap();
    assert!(saved.output().is_empty() && saved.logsumexp().is_empty());
}
