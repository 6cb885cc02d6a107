//! LOWER-1..3: lowered calls run op by op on host buffers (each op's host reference,
//! OPS-2) against the modules' own forward and backward.

use std::collections::HashMap;

use super::{Buf, Exec, LowerCtx, Program, Step};
use crate::backend::Cpu;
use crate::model::Ctx;
use crate::module::{
    Activation, ClassCrossEntropy, Dropout, LayerNorm, Linear, Relu, Residual, Sequential,
};
use crate::network::{CallBackward, ModuleNet, Network};
use crate::nn::GptConfig;
use crate::rng::SplitMix64;
use crate::tensor::Tensor;
use crate::{DType, WrapPolicy};

/// Host buffers of one call: the values, the unit's parameters and gradients.
struct HostRun<'a> {
    prog: &'a Program,
    params: &'a [f32],
    buffers: Vec<f32>,
    grads: Vec<f32>,
    vals: HashMap<Buf, Vec<f32>>,
}

impl HostRun<'_> {
    fn run(&mut self, steps: &[Step]) {
        for s in steps {
            let reads: Vec<Vec<f32>> = s
                .reads
                .iter()
                .map(|b| match *b {
                    Buf::Params { at, len } => self.params[at..at + len].to_vec(),
                    Buf::Buffers { at, len } => self.buffers[at..at + len].to_vec(),
                    b => self.vals.get(&b).unwrap_or_else(|| panic!("{b:?} unset")).clone(),
                })
                .collect();
            let mut writes: Vec<Vec<f32>> = s
                .writes
                .iter()
                .map(|b| match *b {
                    Buf::Grads { at, len } => self.grads[at..at + len].to_vec(),
                    Buf::Buffers { at, len } => self.buffers[at..at + len].to_vec(),
                    // Fresh values hold garbage: an op must write all it owns (OPS-3).
                    b => vec![f32::NAN; self.prog.len_of(b).unwrap()],
                })
                .collect();
            let r: Vec<&[f32]> = reads.iter().map(|v| &v[..]).collect();
            let mut w: Vec<&mut [f32]> = writes.iter_mut().map(|v| &mut v[..]).collect();
            let (rl, wl): (Vec<usize>, Vec<usize>) =
                (r.iter().map(|v| v.len()).collect(), w.iter().map(|v| v.len()).collect());
            s.exec.check_lens(&rl, &wl).unwrap();
            match &s.exec {
                Exec::Op(op) => op.host(&r, &mut w).unwrap(),
                // One rank: a gather or a sum of itself.
                _ => w[0].copy_from_slice(r[0]),
            }
            for (b, v) in s.writes.iter().zip(writes) {
                match *b {
                    Buf::Grads { at, len } => self.grads[at..at + len].copy_from_slice(&v),
                    Buf::Buffers { at, len } => self.buffers[at..at + len].copy_from_slice(&v),
                    b => {
                        self.vals.insert(b, v);
                    }
                }
            }
        }
    }
}

fn f32_values(t: &Tensor) -> Vec<f32> {
    match t.dtype() {
        DType::U32 => t.as_u32().unwrap().iter().map(|&v| f32::from_bits(v)).collect(),
        _ => t.as_f32().unwrap().to_vec(),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut r = SplitMix64::new(seed);
    (0..n).map(|_| r.normal()).collect()
}

/// LOWER-2: every call of `net` lowered and run on host buffers equals its host forward and
/// backward bitwise (output, input gradient, parameter gradients); returns the calls checked.
fn lowered_equals_host(net: &dyn Network, x: Tensor) -> usize {
    let be = Cpu::new();
    let ctx = Ctx::new(&be, true, x.batch());
    let spec = net.spec();
    let mut x = x;
    for (call, &u) in net.calls().iter().enumerate() {
        let params = net.init_params(u, 3).unwrap();
        let mut buffers = net.init_buffers(u).unwrap();
        let prog = net.lower_call(call, x.shape(), &LowerCtx::training()).unwrap();
        prog.check((params.len(), buffers.len()), x.numel()).unwrap(); // LOWER-1
        let mut h = HostRun {
            prog: &prog,
            params: &params,
            buffers: buffers.clone(),
            grads: vec![0.0; params.len()],
            vals: HashMap::new(),
        };
        let (y, saved) = net.forward_call(call, &params, &mut buffers, x.clone(), &ctx).unwrap();
        h.vals.insert(Buf::Input, f32_values(&x));
        for (i, c) in prog.consts.iter().enumerate() {
            h.vals.insert(Buf::Const(i), c.clone());
        }
        h.run(&prog.forward);
        let out = h.vals[&Buf::Fwd(prog.output.0)].clone();
        assert_eq!(prog.output.1, y.shape(), "call {call}: output shape");
        assert_eq!(bits(&h.buffers), bits(&buffers), "call {call}: running statistics");
        assert_eq!(
            bits(&out),
            bits(y.as_f32().unwrap()),
            "call {call} ({}): output",
            spec.units[u].name
        );
        let dy = Tensor::new(y.shape().to_vec(), randn(y.numel(), call as u64 + 11)).unwrap();
        h.vals.insert(Buf::GradOut, dy.as_f32().unwrap().to_vec());
        h.run(&prog.backward);
        let mut grads = vec![0.0; params.len()];
        let b = CallBackward {
            params: &params,
            saved,
            grad_output: dy,
            grads_out: &mut grads,
            input_grad: call > 0,
        };
        let dx = net.backward_call(call, b, &ctx).unwrap().finish(&be, &params).unwrap();
        assert_eq!(bits(&h.grads), bits(&grads), "call {call}: parameter gradients");
        // Not vacuous: finite values, some of them non-zero.
        for v in [&out, &h.grads] {
            assert!(v.iter().all(|x| x.is_finite()) && v.iter().any(|&x| x != 0.0), "call {call}");
        }
        match (dx, prog.input_grad) {
            (Some(dx), Some(i)) if call > 0 => {
                assert_eq!(
                    bits(&h.vals[&Buf::Bwd(i)]),
                    bits(dx.as_f32().unwrap()),
                    "call {call}: dx"
                )
            }
            (_, None) => {}
            (dx, g) => {
                panic!("call {call}: input gradient {:?} vs lowered {g:?}", dx.map(|t| t.numel()))
            }
        }
        x = y;
    }
    net.calls().len()
}

fn gpt_cfg(bias: bool) -> GptConfig {
    GptConfig {
        vocab_size: 13,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        bias,
        layernorm_eps: 1e-5,
        dropout: 0.0,
    }
}

#[test]
fn gpt_calls_lowered_equal_the_modules_bitwise_lower_1_lower_2() {
    for bias in [true, false] {
        let net = crate::module::gpt::gpt(&gpt_cfg(bias)).unwrap();
        for t in [8, 5] {
            let ids: Vec<u32> = (0..3 * t).map(|i| (i * 7 % 13) as u32).collect();
            let x = Tensor::from_u32(vec![3, t], ids).unwrap();
            assert_eq!(lowered_equals_host(&net, x), 4);
        }
    }
}

fn mlp() -> ModuleNet {
    let block = Sequential::new()
        .push("ln", LayerNorm::new(6, true))
        .push("fc", Linear::new(6, 6, true))
        .push("act", Activation::Silu);
    ModuleNet::new("mlp", ClassCrossEntropy)
        .push("0", Linear::new(5, 6, true))
        .push("1", Relu)
        .push("2", Residual::new(block))
        .push(
            "3",
            Sequential::new()
                .push("gelu", Activation::GeluTanh)
                .push("out", Linear::new(6, 4, false)),
        )
        .push("4", Dropout { p: 0.0, layer: 0 })
        .wrap(WrapPolicy::ByParams(40))
}

#[test]
fn an_mlp_with_residual_lowered_equals_the_modules_bitwise_lower_2() {
    let x = Tensor::new(vec![7, 5], randn(35, 5)).unwrap();
    assert!(lowered_equals_host(&mlp(), x) >= 2);
}

#[test]
fn the_zoo_wide_mlp_lowered_equals_its_blocks_bitwise_lower_2() {
    // Linear and ReLU blocks, the head a linear: the zoo's own layer code on the host.
    let m = crate::zoo::WideMlp { input_dim: 12, hidden: 16, depth: 3, classes: 5 }.build();
    let x = Tensor::new(vec![6, 12], randn(72, 8)).unwrap();
    assert_eq!(lowered_equals_host(&m, x), 4);
}

#[test]
fn the_losses_lower_to_the_engines_loss_lower_2() {
    let logits = randn(3 * 4 * 13, 9);
    let targets: Vec<u32> = (0..12).map(|i| (i * 5 % 13) as u32).collect();
    let net = crate::module::gpt::gpt(&gpt_cfg(true)).unwrap();
    let out = Tensor::new(vec![3, 4, 13], logits.clone()).unwrap();
    let y = Tensor::from_u32(vec![3, 4], targets.clone()).unwrap();
    let (want, grad) = net.loss().forward_backward(&out, &y, 6).unwrap();
    let op = net.loss().lower(out.shape(), 6).unwrap();
    let t: Vec<f32> = targets.iter().map(|&v| f32::from_bits(v)).collect();
    let (mut l, mut g) = (vec![0.0f32], vec![0.0f32; logits.len()]);
    op.host(&[&logits, &t], &mut [&mut l, &mut g]).unwrap();
    assert_eq!((l[0].to_bits(), bits(&g)), (want.to_bits(), bits(grad.as_f32().unwrap())));
}

#[test]
fn what_cannot_be_lowered_is_named_lower_3() {
    let mut c = gpt_cfg(true);
    c.dropout = 0.1;
    let net = crate::module::gpt::gpt(&c).unwrap();
    let e = net.lower_call(0, &[2, 8], &LowerCtx::training()).unwrap_err().to_string();
    assert!(e.contains("transformer.drop"), "{e}");
    let e = net.lower_call(1, &[2, 8, 8], &LowerCtx::training()).unwrap_err().to_string();
    assert!(e.contains("dropout while training"), "{e}");
    // Evaluation drops nothing: every call lowers.
    for call in 0..net.calls().len() {
        let shape: &[usize] = if call == 0 { &[2, 8] } else { &[2, 8, 8] };
        net.lower_call(call, shape, &EVAL).unwrap();
    }
    // A module of another crate that does not lower itself.
    #[derive(Debug)]
    struct Opaque;
    impl crate::module::Module for Opaque {
        fn params(&self) -> Vec<crate::module::Param> {
            Vec::new()
        }
        fn forward(
            &self,
            _: crate::module::Params<'_>,
            _: crate::module::Buffers<'_>,
            x: Tensor,
            _: &Ctx,
        ) -> Result<(Tensor, crate::module::Saved), crate::ModelError> {
            Ok((x, Box::new(())))
        }
        fn backward(
            &self,
            _: crate::module::Params<'_>,
            _: crate::module::Saved,
            dy: Tensor,
            _: crate::module::Grads<'_>,
            _: &Ctx,
        ) -> Result<Tensor, crate::ModelError> {
            Ok(dy)
        }
    }
    let net = ModuleNet::new("opaque", ClassCrossEntropy)
        .push("0", Linear::new(4, 4, true))
        .push("1", Opaque)
        .wrap(WrapPolicy::ByParams(1000));
    let e = net.lower_call(0, &[3, 4], &LowerCtx::training()).unwrap_err().to_string();
    assert!(e.contains("Opaque") && e.contains("cannot be lowered"), "{e}");
}

#[test]
fn a_program_that_reads_before_writing_is_refused_lower_1() {
    let net = mlp();
    let mut p = net.lower_call(0, &[7, 5], &LowerCtx::training()).unwrap();
    p.check((net.init_params(0, 1).unwrap().len(), 0), 35).unwrap();
    p.forward.swap(0, 1);
    let n = net.init_params(0, 1).unwrap().len();
    assert!(p.check((n, 0), 35).unwrap_err().to_string().contains("before it is written"));
    let mut p = net.lower_call(0, &[7, 5], &LowerCtx::training()).unwrap();
    p.forward[0].writes[0] = Buf::Params { at: 0, len: 6 };
    let e = p.check((n, 0), 35).unwrap_err().to_string();
    assert!(e.contains("writes Params"), "{e}");
}

const EVAL: LowerCtx = LowerCtx { training: false, sync_bn: false, world: 1 };

/// LOWER-2 for the zoo's convolutional and BatchNorm models, training (outputs, gradients,
/// running statistics) and evaluation (outputs) on one rank.
#[test]
fn the_zoo_bn_and_conv_models_lowered_equal_their_blocks_bitwise_lower_2() {
    let mlp = crate::zoo::by_name("mlp-bn", &[16], 3, 0).unwrap();
    let x = Tensor::new(vec![6, 16], randn(96, 4)).unwrap();
    assert!(lowered_equals_host(&mlp, x.clone()) >= 2);
    // resnet-bn as modules: BatchNorm's buffers at their offsets, downsampling shortcuts.
    let cfg = crate::module::resnet::ResNetConfig {
        in_channels: 1,
        classes: 3,
        width: 4,
        blocks: [1, 1, 1, 1],
    };
    let resnet = crate::module::resnet::resnet_bn(&cfg).unwrap();
    let xr = Tensor::new(vec![2, 1, 16, 16], randn(512, 7)).unwrap();
    assert!(lowered_equals_host(&resnet, xr) >= 2);
    let conv = crate::zoo::by_name("convnet-bn", &[1, 8, 8], 3, 0).unwrap();
    let xc = Tensor::new(vec![4, 1, 8, 8], randn(256, 6)).unwrap();
    assert!(lowered_equals_host(&conv, xc.clone()) >= 2);
    // Evaluation: the running statistics normalise, nothing is saved, no backward.
    let be = Cpu::new();
    for (net, x) in [(&mlp as &dyn Network, x), (&conv, xc)] {
        let ctx = Ctx::new(&be, false, x.batch());
        let mut x = x;
        for (call, &u) in net.calls().iter().enumerate() {
            let params = net.init_params(u, 3).unwrap();
            let mut buffers = net.init_buffers(u).unwrap();
            let prog = net.lower_call(call, x.shape(), &EVAL).unwrap();
            assert!(prog.backward.is_empty() && prog.input_grad.is_none());
            let mut h = HostRun {
                prog: &prog,
                params: &params,
                buffers: buffers.clone(),
                grads: Vec::new(),
                vals: HashMap::new(),
            };
            h.vals.insert(Buf::Input, f32_values(&x));
            h.run(&prog.forward);
            let (y, _) = net.forward_call(call, &params, &mut buffers, x, &ctx).unwrap();
            assert_eq!(bits(&h.vals[&Buf::Fwd(prog.output.0)]), bits(y.as_f32().unwrap()));
            x = y;
        }
    }
}
