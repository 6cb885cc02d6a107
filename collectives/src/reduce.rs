//! Element-wise reductions. Loops are written over zipped slices so that the compiler drops
//! bounds checks and vectorizes them.

/// Reduction applied element-wise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Sum divided by the world size.
    Avg,
    /// Maximum (`f32::max`: a NaN loses against a number).
    Max,
    /// Minimum (`f32::min`).
    Min,
    /// Sum of bf16 values packed two to an element ([`crate::bf16`]): each addition in `f32`,
    /// rounded to bf16 (BFLOAT-3). Every rank's buffer must hold packed values.
    SumBf16,
}

impl ReduceOp {
    /// Short lowercase name, used in op descriptions.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::SumBf16 => "sum-bf16",
        }
    }

    pub(crate) fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::SumBf16 => 4,
        }
    }

    pub(crate) fn from_code(c: u32) -> Option<Self> {
        Some(match c {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Avg,
            2 => ReduceOp::Max,
            3 => ReduceOp::Min,
            4 => ReduceOp::SumBf16,
            _ => return None,
        })
    }
}

/// `dst[i] = dst[i] (op) src[i]`; `Avg` accumulates like `Sum` (scaled once at the end).
///
/// Panics when lengths differ (a broken schedule invariant).
pub fn reduce_into(op: ReduceOp, dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d += *s;
            }
        }
        ReduceOp::Max => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = d.max(*s);
            }
        }
        ReduceOp::Min => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = d.min(*s);
            }
        }
        ReduceOp::SumBf16 => crate::bf16::add_packed(dst, src),
    }
}

/// `dst[i] = a[i] (op) b[i]`: [`reduce_into`] of `b` into a copy of `a`, bitwise, in one
/// pass.
///
/// Panics when lengths differ (a broken schedule invariant).
pub fn reduce_to(op: ReduceOp, dst: &mut [f32], a: &[f32], b: &[f32]) {
    assert!(dst.len() == a.len() && a.len() == b.len(), "reduce_to: length mismatch");
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
                *d = *x + *y;
            }
        }
        ReduceOp::Max => {
            for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
                *d = x.max(*y);
            }
        }
        ReduceOp::Min => {
            for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
                *d = x.min(*y);
            }
        }
        ReduceOp::SumBf16 => crate::bf16::add_packed_to(dst, a, b),
    }
}

/// Divides every element by `world` (the final step of `Avg`).
pub fn scale_avg(buf: &mut [f32], world: usize) {
    let w = world as f32;
    for x in buf.iter_mut() {
        *x /= w;
    }
}

/// How contributions are combined: a built-in op or a user fold over fixed-size records.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Combine {
    Op(ReduceOp),
    Records { len: usize, f: fn(&mut [f32], &[f32]) },
}

impl Combine {
    pub(crate) fn apply(self, dst: &mut [f32], src: &[f32]) {
        match self {
            Combine::Op(op) => reduce_into(op, dst, src),
            Combine::Records { len, f } => {
                assert_eq!(dst.len(), src.len(), "combine: length mismatch");
                for (d, s) in dst.chunks_exact_mut(len).zip(src.chunks_exact(len)) {
                    f(d, s);
                }
            }
        }
    }

    /// `dst = a (op) b`: bitwise [`Combine::apply`] of `b` into a copy of `a`.
    pub(crate) fn apply_to(self, dst: &mut [f32], a: &[f32], b: &[f32]) {
        match self {
            Combine::Op(op) => reduce_to(op, dst, a, b),
            Combine::Records { .. } => {
                dst.copy_from_slice(a);
                self.apply(dst, b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_match_scalar_definitions() {
        let a = [1.0f32, -2.0, 3.5, 0.0];
        let b = [0.5f32, -3.0, 4.0, -1.0];
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let mut d = a;
            reduce_into(op, &mut d, &b);
            for i in 0..4 {
                let want = match op {
                    ReduceOp::Sum => a[i] + b[i],
                    ReduceOp::Max => a[i].max(b[i]),
                    _ => a[i].min(b[i]),
                };
                assert_eq!(d[i].to_bits(), want.to_bits());
            }
        }
        let mut d = [3.0f32, 6.0];
        scale_avg(&mut d, 3);
        assert_eq!(d, [1.0, 2.0]);
    }
}
