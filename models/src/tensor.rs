//! Dense tensors: a shape, an element type ([`DType`]) and where the values live
//! ([`Placement`]), over contiguous row-major storage.
//!
//! Layers and modules take and return [`Tensor`]s, never bare slices, so that another element
//! type (bf16) or device memory is a new storage variant, not a new public API: a kernel asks
//! for the view it can compute on ([`Tensor::as_f32`], [`Tensor::as_u32`]) and a tensor of
//! another type answers [`ModelError::DType`] instead of being misread (every tensor lives on
//! the host or in a device's memory; [`crate::placement`]).
//!
//! Invariants:
//! - `TENSOR-1`: a tensor's storage always holds `shape.iter().product()` elements; every
//!   constructor checks it, and [`Tensor::reshape`] keeps it.
//! - `TENSOR-2`: a typed view of the wrong element type is an error naming both types, never
//!   a reinterpretation of the bytes.
//! - `TENSOR-3`: a clone shares the values (no copy: a residual connection keeps its input
//!   while the branch's first layer saves the same tensor); a write through
//!   [`Tensor::as_f32_mut`] to shared values copies them first, so no other tensor ever sees
//!   the change.
//! - `TENSOR-4`: a tensor is placed where the thread that made it computes
//!   ([`placement::current`]), and its values are read or written only there: a typed view
//!   from anywhere else is [`ModelError::Placement`] naming both places, never a read of
//!   another memory. Shape, type and placement are readable anywhere.

use std::sync::Arc;

use crate::error::ModelError;
use crate::meter::Metered;
use crate::placement::{self, Placement};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE 754 single precision: activations, parameters, gradients.
    F32,
    /// Unsigned 32-bit integers: token ids and class labels.
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::U32 => "u32",
        })
    }
}

/// Shared by clones, copied on a write while shared (TENSOR-3); charged to the meter of
/// the thread that made it (METER-1).
#[derive(Clone, Debug, PartialEq)]
enum Storage {
    F32(Arc<Metered<f32>>),
    U32(Arc<Metered<u32>>),
}

impl Default for Storage {
    fn default() -> Self {
        Storage::F32(Arc::new(Metered::new(Vec::new())))
    }
}

impl Storage {
    fn f32(v: Vec<f32>) -> Self {
        Storage::F32(Arc::new(Metered::new(v)))
    }
    fn u32(v: Vec<u32>) -> Self {
        Storage::U32(Arc::new(Metered::new(v)))
    }
    fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.values.len(),
            Storage::U32(v) => v.values.len(),
        }
    }
    fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::U32(_) => DType::U32,
        }
    }
}

/// A dense, contiguous, row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
    placement: Placement,
}

fn check(what: &str, shape: &[usize], len: usize) -> Result<(), ModelError> {
    let n: usize = shape.iter().product();
    if n != len {
        return Err(ModelError::shape(what, format!("{n} values for {shape:?}"), len));
    }
    Ok(())
}

impl Default for Tensor {
    /// An empty `f32` tensor, placed where this thread computes (TENSOR-4).
    fn default() -> Self {
        Tensor { shape: Vec::new(), storage: Storage::default(), placement: placement::current() }
    }
}

impl Tensor {
    /// An `f32` tensor from a shape and data; fails when the lengths disagree
    /// (TENSOR-1).
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self, ModelError> {
        check("Tensor::new", &shape, data.len())?;
        Ok(Tensor { shape, storage: Storage::f32(data), placement: placement::current() })
    }

    /// A `u32` tensor (token ids, labels) from a shape and data (TENSOR-1), placed where
    /// this thread computes (TENSOR-4).
    pub fn from_u32(shape: Vec<usize>, data: Vec<u32>) -> Result<Self, ModelError> {
        check("Tensor::from_u32", &shape, data.len())?;
        Ok(Tensor { shape, storage: Storage::u32(data), placement: placement::current() })
    }

    /// A zero `f32` tensor, placed where this thread computes (TENSOR-4).
    pub fn zeros(shape: &[usize]) -> Self {
        let n = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            storage: Storage::f32(vec![0.0; n]),
            placement: placement::current(),
        }
    }

    /// Dimensions, outermost first (NCHW for images, NC for features, `[batch, seq]` for
    /// tokens).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Where the values live.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// Bytes of the values.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype().size()
    }

    /// Size of the leading (batch) dimension; 0 for a scalar.
    pub fn batch(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }

    fn wrong(&self, want: DType) -> ModelError {
        ModelError::DType { expected: want, got: self.dtype() }
    }

    /// TENSOR-4: the values are reachable only where the tensor is placed.
    fn here(&self) -> Result<(), ModelError> {
        let here = placement::current();
        if self.placement == here {
            Ok(())
        } else {
            Err(ModelError::Placement { tensor: self.placement, here })
        }
    }

    /// The values as `f32`, or [`ModelError::DType`] for another type (TENSOR-2), or
    /// [`ModelError::Placement`] away from where they live (TENSOR-4).
    pub fn as_f32(&self) -> Result<&[f32], ModelError> {
        self.here()?;
        match &self.storage {
            Storage::F32(v) => Ok(&v.values),
            _ => Err(self.wrong(DType::F32)),
        }
    }

    /// Whether a clone shares the values, so that a write through [`Tensor::as_f32_mut`]
    /// would copy them first (TENSOR-3).
    pub fn is_shared(&self) -> bool {
        match &self.storage {
            Storage::F32(v) => Arc::strong_count(v) > 1,
            Storage::U32(v) => Arc::strong_count(v) > 1,
        }
    }

    /// The values as mutable `f32` (TENSOR-2); values shared with a clone are copied first
    /// (TENSOR-3).
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32], ModelError> {
        self.here()?;
        let got = self.storage.dtype();
        match &mut self.storage {
            Storage::F32(v) => Ok(Arc::make_mut(v).values.as_mut_slice()),
            _ => Err(ModelError::DType { expected: DType::F32, got }),
        }
    }

    /// The `f32` values, taking the tensor (TENSOR-2); copied only when a clone shares them
    /// (TENSOR-3).
    pub fn into_f32(self) -> Result<Vec<f32>, ModelError> {
        self.here()?;
        match self.storage {
            Storage::F32(v) => Ok(Arc::unwrap_or_clone(v).into_values()),
            s => Err(ModelError::DType { expected: DType::F32, got: s.dtype() }),
        }
    }

    /// The values as `u32` (TENSOR-2, TENSOR-4).
    pub fn as_u32(&self) -> Result<&[u32], ModelError> {
        self.here()?;
        match &self.storage {
            Storage::U32(v) => Ok(&v.values),
            _ => Err(self.wrong(DType::U32)),
        }
    }

    /// Same values, another shape with the same number of elements (TENSOR-1).
    pub fn reshape(mut self, shape: Vec<usize>) -> Result<Self, ModelError> {
        let n: usize = shape.iter().product();
        if n != self.numel() {
            return Err(ModelError::shape(
                "Tensor::reshape",
                format!("{} values", self.numel()),
                format!("{shape:?}"),
            ));
        }
        self.shape = shape;
        Ok(self)
    }

    /// Rows `a..b` of the leading dimension, copied where the tensor lives (TENSOR-4).
    pub fn rows(&self, a: usize, b: usize) -> Result<Tensor, ModelError> {
        self.here()?;
        if a > b || b > self.batch() {
            return Err(ModelError::shape(
                "Tensor::rows",
                format!("rows within {}", self.batch()),
                format!("{a}..{b}"),
            ));
        }
        let per: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = b - a;
        let storage = match &self.storage {
            Storage::F32(v) => Storage::f32(v.values[a * per..b * per].to_vec()),
            Storage::U32(v) => Storage::u32(v.values[a * per..b * per].to_vec()),
        };
        Ok(Tensor { shape, storage, placement: self.placement })
    }

    /// Largest absolute elementwise difference of two `f32` tensors of one shape (for tests
    /// and diagnostics); infinite when they are not comparable.
    pub fn max_abs_diff(&self, other: &Tensor) -> f32 {
        match (self.as_f32(), other.as_f32()) {
            (Ok(a), Ok(b)) if self.shape == other.shape => {
                a.iter().zip(b).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
            }
            _ => f32::INFINITY,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_1_constructors_check_the_element_count() {
        // TENSOR-1
        assert!(Tensor::new(vec![2, 3], vec![0.0; 5]).is_err());
        assert!(Tensor::from_u32(vec![4], vec![1; 3]).is_err());
        let t = Tensor::new(vec![2, 3], vec![1.0; 6]).unwrap();
        assert!(t.clone().reshape(vec![4]).is_err());
        assert_eq!(t.reshape(vec![3, 2]).unwrap().shape(), &[3, 2]);
        let r = Tensor::from_u32(vec![3, 2], (0..6).collect()).unwrap().rows(1, 3).unwrap();
        assert_eq!((r.shape(), r.as_u32().unwrap()), (&[2usize, 2][..], &[2u32, 3, 4, 5][..]));
    }

    #[test]
    fn tensor_2_a_view_of_the_wrong_type_is_an_error() {
        // TENSOR-2
        let ids = Tensor::from_u32(vec![2], vec![7, 9]).unwrap();
        let e = ids.as_f32().unwrap_err().to_string();
        assert!(e.contains("f32") && e.contains("u32"), "{e}");
        assert!(Tensor::zeros(&[2]).as_u32().is_err());
        assert_eq!(ids.dtype(), DType::U32);
        assert_eq!(ids.placement(), Placement::Host);
        assert_eq!(ids.nbytes(), 8);
    }

    #[test]
    fn tensor_3_clones_share_until_written() {
        // TENSOR-3: a clone shares the values; a write copies them first.
        let a = Tensor::new(vec![3], vec![1.0, 2.0, 3.0]).unwrap();
        assert!(!a.is_shared());
        let mut b = a.clone();
        assert_eq!(a.as_f32().unwrap().as_ptr(), b.as_f32().unwrap().as_ptr(), "shared");
        assert!(a.is_shared() && b.is_shared());
        b.as_f32_mut().unwrap()[0] = 9.0;
        assert!(!a.is_shared() && !b.is_shared(), "the write copied");
        assert_eq!(a.as_f32().unwrap(), &[1.0, 2.0, 3.0], "the other clone is unchanged");
        assert_eq!(b.as_f32().unwrap(), &[9.0, 2.0, 3.0]);
        // Unshared values are written in place, and taken without a copy.
        let p = b.as_f32().unwrap().as_ptr();
        b.as_f32_mut().unwrap()[1] = 8.0;
        assert_eq!(b.as_f32().unwrap().as_ptr(), p);
        let taken = b.into_f32().unwrap();
        assert_eq!(taken.as_ptr(), p);
        let c = a.clone();
        assert_eq!(c.into_f32().unwrap(), vec![1.0, 2.0, 3.0], "a shared value is copied out");
        assert_eq!(a.as_f32().unwrap(), &[1.0, 2.0, 3.0]);
    }

    #[test]
    fn tensor_4_values_are_reached_only_where_they_live() {
        // TENSOR-4
        let host = Tensor::new(vec![2], vec![1.0, 2.0]).unwrap();
        assert_eq!(host.placement(), Placement::Host);
        let (dev, ids) = {
            let _on = placement::enter(Placement::Device(7));
            assert!(host.as_f32().is_err(), "a kernel cannot read host memory");
            let d = Tensor::new(vec![2], vec![3.0, 4.0]).unwrap();
            assert_eq!(d.as_f32().unwrap(), &[3.0, 4.0]);
            assert_eq!(Tensor::zeros(&[1]).placement(), Placement::Device(7));
            assert_eq!(Tensor::default().placement(), Placement::Device(7));
            (d, Tensor::from_u32(vec![1], vec![5]).unwrap())
        };
        assert_eq!(dev.placement(), Placement::Device(7));
        let e = dev.as_f32().unwrap_err().to_string();
        assert!(e.contains("device 7") && e.contains("the host"), "{e}");
        assert!(ids.as_u32().is_err(), "u32 views too");
        assert!(dev.rows(0, 1).is_err() && dev.clone().into_f32().is_err());
        assert!(dev.clone().as_f32_mut().is_err());
        assert_eq!((dev.shape(), dev.numel(), dev.dtype()), (&[2usize][..], 2, DType::F32));
        // Nor can another device's kernels.
        let _other = placement::enter(Placement::Device(8));
        assert!(dev.as_f32().is_err());
    }
}
