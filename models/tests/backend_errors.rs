//! BACKEND-1 through the layers and a whole model: a backend that fails its N-th matrix
//! multiply makes the forward or backward that called it return that error, for every N.

use shardline_models::failing_backend::FailingBackend;
use shardline_models::{Backend, ConvNetBn, Ctx, Dataset, Linear, MlpBn, ModelError, Tensor};

fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i % 11) as f32 - 5.0) * 0.1).collect()
}

/// The error must be the backend's own, naming the failing call.
fn assert_names_gemm(r: Result<impl std::fmt::Debug, ModelError>, n: u64) {
    match r {
        Err(ModelError::Device(what)) => assert_eq!(what, FailingBackend::error_text(n)),
        other => panic!("expected the device error of gemm #{n}, got {other:?}"),
    }
}

#[test]
fn a_linear_layer_returns_the_failure_of_its_forward_or_backward_gemm_backend_1() {
    let l = Linear::new(6, 4);
    let p = ramp(l.num_params());
    let x = Tensor::new(vec![3, 6], ramp(18)).unwrap();
    let dy = Tensor::new(vec![3, 4], ramp(12)).unwrap();
    // Forward has one multiply.
    assert_names_gemm(l.forward(&FailingBackend::new(1), &p, x.clone()), 1);
    // Backward has two: the weight gradient, then the input gradient.
    for n in [2, 3] {
        let be = FailingBackend::new(n);
        let (_, saved) = l.forward(&be, &p, x.clone()).unwrap();
        let mut g = vec![0.0; l.num_params()];
        assert_names_gemm(l.backward(&be, &p, &saved, &dy, &mut g), n);
        assert_eq!(be.gemms(), n, "backward stops at the failed multiply");
    }
    // With no failure the layer computes as the CPU backend does.
    let be = FailingBackend::new(0);
    let (y, _) = l.forward(&be, &p, x.clone()).unwrap();
    let (want, _) = l.forward(&shardline_models::Cpu::new(), &p, x).unwrap();
    assert_eq!(y.as_f32().unwrap(), want.as_f32().unwrap());
}

/// One training step of `model` (forward, loss, backward) on `be`.
fn step(
    model: &shardline_models::Model,
    be: &dyn Backend,
    x: Tensor,
    y: &[u32],
) -> Result<(), ModelError> {
    let params: Vec<Vec<f32>> =
        (0..model.num_units()).map(|u| model.init_params(u, 3)).collect::<Result<_, _>>()?;
    let mut buffers: Vec<Vec<f32>> =
        (0..model.num_units()).map(|u| model.init_buffers(u)).collect::<Result<_, _>>()?;
    let ctx = Ctx::new(be, true, x.shape()[0]);
    model.loss_and_grads(&params, &mut buffers, x, y, &ctx).map(|_| ())
}

#[test]
fn every_gemm_of_a_model_step_fails_the_step_with_its_own_error_backend_1() {
    for (name, model, image) in [
        ("mlp-bn", MlpBn::digits().build(), false),
        ("convnet-bn", ConvNetBn::digits().build().unwrap(), true),
    ] {
        let (x, y) = Dataset::digits(image).unwrap().batch(&[0, 1, 2, 3]);
        let counter = FailingBackend::new(0);
        step(&model, &counter, x.clone(), &y).unwrap();
        let total = counter.gemms();
        assert!(total >= 3, "{name}: a step makes at least three multiplies, made {total}");
        // Forward and backward multiplies alike: the step ends with the failed call's error.
        for n in 1..=total {
            let be = FailingBackend::new(n);
            assert_names_gemm(step(&model, &be, x.clone(), &y), n);
            assert_eq!(be.gemms(), n, "{name}: nothing runs after gemm #{n} fails");
        }
    }
}
