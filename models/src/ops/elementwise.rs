//! The length rules and host references of the ops a lowered module tree adds to the
//! layers' kernels (`crate::lower`): a copy, an add and a multiply, the activation that
//! saves its derivative, and the engine's classification loss. The host references are the
//! module code's own arithmetic (OPS-2): `add_into`'s `a + b`, the activation module's
//! `dy * d`, [`Activation::forward_saving_derivative`], [`softmax_cross_entropy`].

use super::{ids_of, len_is, rows_of, want, Op};
use crate::loss::softmax_cross_entropy;
use crate::tensor::Tensor;

/// OPS-1 for [`Op::Copy`], [`Op::Add`], [`Op::Mul`], [`Op::ActivationSavingDerivative`]:
/// every buffer as long as the first read.
pub(super) fn check(op: &Op, r: &[usize], w: &[usize]) -> Result<(), String> {
    let name = op.label();
    let (reads, writes) = match op {
        Op::Copy => (1, 1),
        Op::Add | Op::Mul => (2, 1),
        _ => (1, 2),
    };
    want(&format!("{name} reads"), r, reads)?;
    want(&format!("{name} writes"), w, writes)?;
    for (i, &len) in r.iter().chain(w).enumerate().skip(1) {
        len_is(&format!("{name} buffer {i}"), len, r[0])?;
    }
    Ok(())
}

/// The host references of the ops [`check`] covers.
pub(super) fn host(op: &Op, r: &[&[f32]], w: &mut [&mut [f32]]) -> Result<(), String> {
    match op {
        Op::Copy => w[0].copy_from_slice(r[0]),
        Op::Add => w[0].iter_mut().zip(r[0].iter().zip(r[1])).for_each(|(c, (a, b))| *c = a + b),
        Op::Mul => w[0].iter_mut().zip(r[0].iter().zip(r[1])).for_each(|(c, (a, b))| *c = a * b),
        Op::ActivationSavingDerivative(a) => {
            let [y, d] = w else { unreachable!("checked: two writes") };
            d.copy_from_slice(r[0]);
            a.forward_saving_derivative(d, y).map_err(|e| e.to_string())?;
        }
        other => unreachable!("{} is not elementwise", other.label()),
    }
    Ok(())
}

/// [`softmax_cross_entropy`]: this rank's share of the mean over `global` rows, and its
/// gradient.
pub(super) fn softmax_xent_host(
    classes: usize,
    global: usize,
    r: &[&[f32]],
    w: &mut [&mut [f32]],
) -> Result<(), String> {
    let rows = rows_of("softmax cross entropy logits", r[0].len(), classes)?;
    let logits = Tensor::new(vec![rows, classes], r[0].to_vec()).map_err(|e| e.to_string())?;
    let (loss, grad) =
        softmax_cross_entropy(&logits, &ids_of(r[1]), global).map_err(|e| e.to_string())?;
    w[0][0] = loss;
    w[1].copy_from_slice(grad.as_f32().map_err(|e| e.to_string())?);
    Ok(())
}
