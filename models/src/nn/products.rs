//! The matrix products a thread makes, recorded: `shardline plan` prices each of a model's
//! products by its own shape and form, so one microbatch run once lists them (shapes, not
//! timings), and the machine profile times those shapes through the same entry points.
//!
//! Every product through [`super::Gemm::gemm`], [`super::Gemm::gemm_view`] or
//! [`crate::Cpu`]'s matrix multiply (the same route, GEMM-1) is recorded on the calling
//! thread while a [`record`] guard is alive; nothing is recorded otherwise, and the check is
//! one thread-local read.
//!
//! Invariants:
//! - PROD-1: with a recorder installed, every product of the thread is recorded once, in
//!   call order, with its `m x n x k` and its form (which operands are stored transposed,
//!   or a strided view); [`record`]'s guard returns them and restores the recorder installed
//!   before it (a nested record sees only its own products).

use std::cell::RefCell;

use serde::{Deserialize, Serialize};

/// How a product's operands are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Form {
    /// `a b`, both row-major (a linear's input gradient `dy W`).
    Nn,
    /// `a b^T` (a linear's forward `x W^T`).
    Nt,
    /// `a^T b` (a linear's weight gradient `dy^T x`).
    Tn,
    /// `a^T b^T`.
    Tt,
    /// [`super::Gemm::gemm_view`] with `b`'s rows contiguous (attention's `P V`, its
    /// gradients).
    View,
    /// [`super::Gemm::gemm_view`] with `b` stored as the rows of its transpose (attention's
    /// scores `Q K^T`, copied to rows first).
    ViewT,
}

impl Form {
    /// The form of a [`crate::GemmShape`]'s transposes.
    pub fn of(trans_a: bool, trans_b: bool) -> Self {
        match (trans_a, trans_b) {
            (false, false) => Form::Nn,
            (false, true) => Form::Nt,
            (true, false) => Form::Tn,
            (true, true) => Form::Tt,
        }
    }

    /// Every form, for probes.
    pub const ALL: [Form; 6] = [Form::Nn, Form::Nt, Form::Tn, Form::Tt, Form::View, Form::ViewT];
}

/// One product `m x n x k` of a form; `accumulate` when it adds into its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Product {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// How the operands are stored.
    pub form: Form,
    /// Whether it adds into its output (a weight gradient) rather than writing it.
    #[serde(default)]
    pub accumulate: bool,
}

impl Product {
    /// Floating-point operations: two per multiply-add.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

thread_local! {
    static LOG: RefCell<Option<Vec<Product>>> = const { RefCell::new(None) };
}

/// Records this thread's products until [`Recording::finish`] (PROD-1).
#[must_use = "products are recorded while the guard lives"]
pub struct Recording {
    previous: Option<Option<Vec<Product>>>,
}

/// Starts recording this thread's products.
pub fn record() -> Recording {
    let previous = LOG.with(|l| l.borrow_mut().replace(Vec::new()));
    Recording { previous: Some(previous) }
}

impl Recording {
    /// The products recorded since [`record`], in call order; the recorder before it is
    /// restored.
    pub fn finish(mut self) -> Vec<Product> {
        self.restore()
    }

    fn restore(&mut self) -> Vec<Product> {
        match self.previous.take() {
            Some(previous) => LOG.with(|l| std::mem::replace(&mut *l.borrow_mut(), previous)),
            None => None,
        }
        .unwrap_or_default()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.restore();
    }
}

/// Records one product when a recorder is installed.
pub(crate) fn note(m: usize, n: usize, k: usize, form: Form, accumulate: bool) {
    LOG.with(|l| {
        if let Some(v) = l.borrow_mut().as_mut() {
            v.push(Product { m, n, k, form, accumulate });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gemm::{Gemm, View};
    use crate::{Backend, Cpu, GemmShape};

    /// PROD-1: each entry point records its product once with its form; nested records see
    /// their own; nothing is recorded without a recorder.
    #[test]
    fn every_product_is_recorded_once_prod_1() {
        let (a, b) = (vec![1.0f32; 64], vec![1.0f32; 64]);
        let mut c = vec![0.0f32; 64];
        let sh = |trans_a, trans_b| GemmShape { m: 4, n: 2, k: 8, trans_a, trans_b };
        f32::gemm(sh(false, false), &a, &b, &mut c, false);
        let outer = record();
        f32::gemm(sh(false, true), &a, &b, &mut c, false);
        let inner = record();
        f32::gemm(sh(true, false), &a, &b, &mut c, true);
        Cpu::new().gemm(sh(true, true), &a, &b, &mut c, false).unwrap();
        let inner = inner.finish();
        let rows = |n| View::rows(0, n);
        f32::gemm_view((2, 3, 4), (&a, rows(4)), (&b, rows(3)), (&mut c, rows(3)), false);
        f32::gemm_view((2, 3, 4), (&a, rows(4)), (&b, rows(4).t()), (&mut c, rows(3)), false);
        let outer = outer.finish();
        let p = |m, n, k, form, accumulate| Product { m, n, k, form, accumulate };
        assert_eq!(inner, vec![p(4, 2, 8, Form::Tn, true), p(4, 2, 8, Form::Tt, false)]);
        assert_eq!(
            outer,
            vec![
                p(4, 2, 8, Form::Nt, false),
                p(2, 3, 4, Form::View, false),
                p(2, 3, 4, Form::ViewT, false)
            ]
        );
        f32::gemm(sh(false, false), &a, &b, &mut c, false);
        assert!(record().finish().is_empty(), "nothing outside a recording");
    }
}
