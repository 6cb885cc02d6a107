//! Dense tensors: a shape and contiguous row-major `f32` storage in host memory.

use crate::error::ModelError;

/// A dense, contiguous, row-major tensor.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Tensor {
    /// Dimensions, outermost first (NCHW for images, NC for features).
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor from a shape and data; fails when the lengths disagree.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self, ModelError> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(ModelError::shape(
                "Tensor::new",
                format!("{n} values for {shape:?}"),
                data.len(),
            ));
        }
        Ok(Tensor { shape, data })
    }

    /// A zero tensor.
    pub fn zeros(shape: &[usize]) -> Self {
        Tensor { shape: shape.to_vec(), data: vec![0.0; shape.iter().product()] }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Size of the leading (batch) dimension; 0 for a scalar.
    pub fn batch(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }

    /// Same data, another shape with the same number of elements.
    pub fn reshape(mut self, shape: Vec<usize>) -> Result<Self, ModelError> {
        let n: usize = shape.iter().product();
        if n != self.data.len() {
            return Err(ModelError::shape(
                "Tensor::reshape",
                format!("{} values", self.data.len()),
                format!("{shape:?}"),
            ));
        }
        self.shape = shape;
        Ok(self)
    }

    /// Largest absolute elementwise difference (for tests and diagnostics).
    pub fn max_abs_diff(&self, other: &Tensor) -> f32 {
        assert_eq!(self.shape, other.shape, "max_abs_diff: shapes differ");
        self.data.iter().zip(&other.data).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
    }
}
