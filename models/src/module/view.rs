//! Views of a module's parameters, buffers and gradients inside its unit's flat buffers.
//!
//! A view carries the element type of what it shows, as a [`Tensor`](crate::Tensor) does,
//! so that a module computes on `f32` through [`Params::f32`] today and a bf16 or device
//! view is a new variant, not a new signature.

use std::ops::Range;

use crate::error::ModelError;

fn sub<'b, T>(v: &'b [T], r: Range<usize>, what: &str) -> Result<&'b [T], ModelError> {
    let len = v.len();
    v.get(r.clone())
        .ok_or_else(|| ModelError::shape(what, format!("a range within {len}"), format!("{r:?}")))
}

/// A module's parameters (read-only).
#[derive(Clone, Copy, Debug)]
pub struct Params<'a> {
    data: &'a [f32],
}

impl<'a> Params<'a> {
    /// A view of `data`, laid out as a module's [`Module::params`](super::Module::params).
    pub fn new(data: &'a [f32]) -> Self {
        Params { data }
    }

    /// The values as `f32`.
    pub fn f32(&self) -> Result<&'a [f32], ModelError> {
        Ok(self.data)
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The elements `r` (a child's parameters).
    pub fn slice(&self, r: Range<usize>) -> Result<Params<'a>, ModelError> {
        Ok(Params { data: sub(self.data, r, "params view")? })
    }
}

/// A module's buffers (running statistics), written by a training forward.
#[derive(Debug)]
pub struct Buffers<'a> {
    data: &'a mut [f32],
}

impl<'a> Buffers<'a> {
    /// A view of `data`, laid out as a module's [`Module::buffers`](super::Module::buffers).
    pub fn new(data: &'a mut [f32]) -> Self {
        Buffers { data }
    }

    /// No buffers.
    pub fn none() -> Buffers<'static> {
        Buffers { data: &mut [] }
    }

    /// The values as `f32`.
    pub fn f32_mut(&mut self) -> Result<&mut [f32], ModelError> {
        Ok(self.data)
    }

    /// The elements `r` (a child's buffers).
    pub fn slice(&mut self, r: Range<usize>) -> Result<Buffers<'_>, ModelError> {
        let len = self.data.len();
        let data = self.data.get_mut(r.clone()).ok_or_else(|| {
            ModelError::shape("buffers view", format!("a range within {len}"), format!("{r:?}"))
        })?;
        Ok(Buffers { data })
    }
}

/// A module's parameter gradients, laid out as its parameters; backward ADDS into them.
#[derive(Debug)]
pub struct Grads<'a> {
    data: &'a mut [f32],
}

impl<'a> Grads<'a> {
    /// A view of `data`.
    pub fn new(data: &'a mut [f32]) -> Self {
        Grads { data }
    }

    /// The values as `f32`.
    pub fn f32_mut(&mut self) -> Result<&mut [f32], ModelError> {
        Ok(self.data)
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The elements `r` (a child's gradients).
    pub fn slice(&mut self, r: Range<usize>) -> Result<Grads<'_>, ModelError> {
        let len = self.data.len();
        let data = self.data.get_mut(r.clone()).ok_or_else(|| {
            ModelError::shape("grads view", format!("a range within {len}"), format!("{r:?}"))
        })?;
        Ok(Grads { data })
    }
}
