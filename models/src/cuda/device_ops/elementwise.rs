//! The elementwise ops a lowered module tree adds (a copy, an add, a multiply, the
//! activation that saves its derivative) and the two cross-entropy losses on the CUDA device:
//! `memcpy_dtod` on the views, the grid-stride kernels `add_f32`, `mul_f32`,
//! `act_fwd_deriv_f32` of `ops.cu`, and its `xent_rows_f32`, `xent_loss_f32` pair. The op's
//! check (CUDADEV-2) made every buffer of an elementwise op as long as the first read, the
//! length the kernels bound their indices by (DEVOP-2).
//!
//! Where they differ from their host reference: the GELU of `ActivationSavingDerivative` is
//! `erff`'s and `expf`'s (the host's vectorised `f32` path is within 4 ulp of the exact
//! values, ACTIV-5), so the two agree to rounding; a target `>= classes`, which the host
//! refuses, gives that row a NaN loss (so the total shows it) and a zero gradient row, as
//! `Op::CrossEntropy`.

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, PushKernelArg};
use shardline_collectives::device::{DeviceError, Result};

use super::{activation_kind, elems, one_block, per_row, rows_of, CudaDevice};
use crate::cuda::device::u64_of;
use crate::ops::Op;

/// How the cross-entropy kernels scale: the gradient rows by `scale`, the loss as
/// `(sum of the row losses / div) * mul` (`div` 0: a zero loss).
struct XentScale {
    scale: f32,
    div: f64,
    mul: f32,
}

impl CudaDevice {
    /// Enqueues a copy, add, multiply, saving activation or cross-entropy op on `cs` over
    /// its (checked) views; `rl` are the reads' lengths.
    pub(super) fn run_elementwise(
        &self,
        op: &Op,
        cs: &Arc<CudaStream>,
        r: &[CudaView<'_, f32>],
        w: &mut [CudaViewMut<'_, f32>],
        rl: &[usize],
    ) -> Result<()> {
        let name = op.label();
        let what = |step: &str| format!("{name}: {step}");
        let k = &self.k;
        let writes = |n: usize| DeviceError::Invalid(format!("{name}: {n} writes expected"));
        match op {
            Op::Copy => {
                let [y] = w else { return Err(writes(1)) };
                if r[0].len() != y.len() {
                    return Err(DeviceError::Invalid(format!(
                        "{name}: {} elements into {}",
                        r[0].len(),
                        y.len()
                    )));
                }
                if !y.is_empty() {
                    // Bit for bit, as the host's copy_from_slice.
                    cs.memcpy_dtod(&r[0], &mut *y).map_err(|e| self.fail(&what("memcpy"), e))?;
                }
            }
            Op::Add | Op::Mul => {
                let n = u64_of(rl[0]);
                let f = if matches!(op, Op::Add) { &k.add } else { &k.mul };
                if n > 0 {
                    kernel!(self, what("kernel"), cs, f, elems(n), &r[0], &r[1], &mut w[0], &n)?;
                }
            }
            Op::ActivationSavingDerivative(a) => {
                let (n, kind) = (u64_of(rl[0]), activation_kind(*a));
                let [y, d] = w else { return Err(writes(2)) };
                if n > 0 {
                    kernel!(
                        self,
                        what("kernel"),
                        cs,
                        &k.act_fwd_deriv,
                        elems(n),
                        &r[0],
                        &mut *y,
                        &mut *d,
                        &kind,
                        &n,
                    )?;
                }
            }
            Op::CrossEntropy { vocab, dloss } => {
                let rows = rows_of(rl[0], *vocab);
                // As the host: dloss / rows in f32; the mean of the row losses, times dloss.
                let scale = if rows == 0 { 0.0 } else { dloss / (rows as f64) as f32 };
                let s = XentScale { scale, div: rows as f64, mul: *dloss };
                self.cross_entropy(name, cs, r, w, rows, *vocab, s)?;
            }
            Op::SoftmaxCrossEntropy { classes, global } => {
                let rows = rows_of(rl[0], *classes);
                // LOSS-1: this rank's share of the mean over `global` rows (at least `rows`,
                // the check made sure; 0 only with no row).
                let scale = if *global == 0 { 0.0 } else { (1.0 / *global as f64) as f32 };
                let s = XentScale { scale, div: *global as f64, mul: 1.0 };
                self.cross_entropy(name, cs, r, w, rows, *classes, s)?;
            }
            _ => return Err(DeviceError::Invalid(format!("{name}: not an elementwise op"))),
        }
        Ok(())
    }

    /// Reads `logits [rows, classes]`, `targets [rows]`; writes `loss [1]` and `dlogits`:
    /// per-row losses and gradient rows (`xent_rows_f32`), then one block sums the row
    /// losses in a fixed order (`xent_loss_f32`).
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy(
        &self,
        name: &str,
        cs: &Arc<CudaStream>,
        r: &[CudaView<'_, f32>],
        w: &mut [CudaViewMut<'_, f32>],
        rows: usize,
        classes: usize,
        s: XentScale,
    ) -> Result<()> {
        let what = |step: &str| format!("{name}: {step}");
        let k = &self.k;
        let (rows64, classes64) = (u64_of(rows), u64_of(classes));
        let [loss, dlogits] = w else {
            return Err(DeviceError::Invalid(format!("{name}: two writes expected")));
        };
        let (mut row_loss, _counted) = self.scratch::<f32>(cs, rows, "cross entropy rows")?;
        if rows > 0 {
            kernel!(
                self,
                what("rows"),
                cs,
                &k.xent_rows,
                per_row(rows64),
                &r[0],
                &r[1],
                &mut *dlogits,
                &mut row_loss,
                &rows64,
                &classes64,
                &s.scale,
            )?;
        }
        kernel!(
            self,
            what("loss"),
            cs,
            &k.xent_loss,
            one_block(),
            &row_loss,
            &mut *loss,
            &rows64,
            &s.div,
            &s.mul,
        )
    }
}
