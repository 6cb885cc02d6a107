//! Activations in device memory: the data, each call's output, the loss gradient and each
//! gradient flowing back are device buffers, allocated when their kernel is enqueued and
//! freed (stream-ordered) once the kernel that reads them is. A kernel knows the size of
//! what it will write before it runs because the call's output shapes are probed once, on
//! the host, with a one-sample input ([`Shapes::probe`]): outputs are batch-major, so a
//! batch of `b` gives `b` times the probe's per-sample size.
//!
//! Token ids (`u32`) travel as their bits in the device's `f32` elements; every copy keeps
//! bits, so they come back unchanged.
//!
//! Invariant:
//! - DACT-1: a value written to an activation buffer and read back as a tensor is bitwise
//!   the tensor written, with its shape and element type.

use shardline_models::{Backend, Ctx, DType, ModelError, Network, Tensor};

use super::DeviceError;
use shardline_collectives::device::DeviceBuffer;

/// An activation (or a gradient flowing back) in device memory.
pub(crate) struct Act {
    pub(crate) buf: DeviceBuffer,
    /// Its shape, the batch first.
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
}

/// The tensor stored in `values` (DACT-1).
pub(crate) fn read(values: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor, ModelError> {
    let shape = shape.to_vec();
    match dtype {
        DType::F32 => Tensor::new(shape, values.to_vec()),
        DType::U32 => Tensor::from_u32(shape, values.iter().map(|v| v.to_bits()).collect()),
        other => Err(ModelError::Config(format!("no device layout for {other} activations"))),
    }
}

/// Writes `t` into `out` (its length, DACT-1).
pub(crate) fn write(t: &Tensor, out: &mut [f32]) -> Result<(), DeviceError> {
    let bad = |what: String| DeviceError::Invalid(what);
    if t.numel() != out.len() {
        return Err(bad(format!(
            "a kernel produced {} values of shape {:?} for a buffer of {} (the probed shape)",
            t.numel(),
            t.shape(),
            out.len()
        )));
    }
    match t.dtype() {
        DType::F32 => out.copy_from_slice(t.as_f32().map_err(|e| bad(e.to_string()))?),
        DType::U32 => {
            let v = t.as_u32().map_err(|e| bad(e.to_string()))?;
            out.iter_mut().zip(v).for_each(|(o, x)| *o = f32::from_bits(*x));
        }
        other => return Err(bad(format!("no device layout for {other} activations"))),
    }
    Ok(())
}

/// The values of `t` as device elements (DACT-1).
pub(crate) fn values(t: &Tensor) -> Result<Vec<f32>, DeviceError> {
    let mut v = vec![0.0; t.numel()];
    write(t, &mut v)?;
    Ok(v)
}

/// Per call, the per-sample shape and element type of its input and output.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Shapes {
    /// The data's per-sample shape and type.
    input: (Vec<usize>, DType),
    /// Each call's output.
    out: Vec<(Vec<usize>, DType)>,
}

impl Shapes {
    /// Runs one sample of zeros shaped like `x`'s samples through every call (evaluation
    /// mode, initial parameters) and records the shapes.
    pub(crate) fn probe(
        model: &dyn Network,
        x: &Tensor,
        seed: u64,
        backend: &dyn Backend,
    ) -> Result<Self, String> {
        let per = x.shape().get(1..).unwrap_or(&[]).to_vec();
        let one: Vec<usize> = std::iter::once(1).chain(per.iter().copied()).collect();
        let n: usize = per.iter().product();
        let mut t = match x.dtype() {
            DType::U32 => Tensor::from_u32(one, vec![0; n]),
            _ => Tensor::new(one, vec![0.0; n]),
        }
        .map_err(|e| e.to_string())?;
        let units = model.spec().units.len();
        let params: Vec<Vec<f32>> = (0..units)
            .map(|u| model.init_params(u, seed))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let mut buffers: Vec<Vec<f32>> = (0..units)
            .map(|u| model.init_buffers(u))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let ctx = Ctx { training: false, ..Ctx::new(backend, false, 1) };
        let mut out = Vec::new();
        for (c, &u) in model.calls().iter().enumerate() {
            let (y, _) = model
                .forward_call(c, &params[u], &mut buffers[u], t, &ctx)
                .map_err(|e| format!("probing call {c}'s output shape: {e}"))?;
            out.push((y.shape().get(1..).unwrap_or(&[]).to_vec(), y.dtype()));
            t = y;
        }
        Ok(Shapes { input: (per, x.dtype()), out })
    }

    /// Whether these shapes were probed for inputs shaped like `x`'s samples.
    pub(crate) fn fits(&self, x: &Tensor) -> bool {
        x.shape().get(1..).unwrap_or(&[]) == self.input.0.as_slice() && x.dtype() == self.input.1
    }

    /// The shape of call `call`'s output for a batch of `batch`, and its type.
    pub(crate) fn output(&self, call: usize, batch: usize) -> (Vec<usize>, DType) {
        let (s, d) = &self.out[call];
        (std::iter::once(batch).chain(s.iter().copied()).collect(), *d)
    }

    /// The shape of call `call`'s input for a batch of `batch`, and its type.
    pub(crate) fn input(&self, call: usize, batch: usize) -> (Vec<usize>, DType) {
        if call == 0 {
            let (s, d) = &self.input;
            (std::iter::once(batch).chain(s.iter().copied()).collect(), *d)
        } else {
            self.output(call - 1, batch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DACT-1: f32 and u32 tensors (u32 values that are NaN patterns as f32 too) come back
    /// bitwise, with their shapes; a buffer of the wrong size is refused.
    #[test]
    fn tensors_round_trip_through_device_values_dact_1() {
        let f =
            Tensor::new(vec![2, 3], vec![1.5, -0.0, f32::MIN_POSITIVE, 7.0, -2.25, 1e30]).unwrap();
        let u =
            Tensor::from_u32(vec![3, 2], vec![0, 1, 0x7fc0_0001, u32::MAX, 255, 65_535]).unwrap();
        for t in [f, u] {
            let v = values(&t).unwrap();
            let back = read(&v, t.shape(), t.dtype()).unwrap();
            assert_eq!(back.shape(), t.shape());
            assert_eq!(back.dtype(), t.dtype());
            match t.dtype() {
                DType::F32 => {
                    let bits = |x: &Tensor| -> Vec<u32> {
                        x.as_f32().unwrap().iter().map(|v| v.to_bits()).collect()
                    };
                    assert_eq!(bits(&back), bits(&t));
                }
                _ => assert_eq!(back.as_u32().unwrap(), t.as_u32().unwrap()),
            }
            assert!(write(&t, &mut [0.0; 5]).is_err());
        }
    }
}
