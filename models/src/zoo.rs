//! The model zoo: `mlp-bn`, `convnet-bn`, `wide-mlp`.

use crate::batchnorm::BatchNorm;
use crate::conv::Conv2d;
use crate::error::ModelError;
use crate::layers::Linear;
use crate::model::{Block, Layer, Model, Node};

fn node(name: &str, layer: Layer) -> Node {
    Node { name: name.to_string(), layer }
}

/// `mlp-bn`: input -> depth x [Linear(hidden), BatchNorm1d, ReLU] -> Linear(classes).
/// Parameter names: `blocks.{i}.linear.*`, `blocks.{i}.bn.*`, `head.linear.*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlpBn {
    /// Input features.
    pub input_dim: usize,
    /// Width of every hidden block.
    pub hidden: usize,
    /// Number of hidden blocks.
    pub depth: usize,
    /// Output classes.
    pub classes: usize,
}

impl MlpBn {
    /// The digits configuration: 64 inputs, 2 blocks of 128, 10 classes.
    pub fn digits() -> Self {
        MlpBn { input_dim: 64, hidden: 128, depth: 2, classes: 10 }
    }

    /// Builds the model (one unit per block).
    pub fn build(&self) -> Model {
        let mut blocks = Vec::with_capacity(self.depth + 1);
        let mut width = self.input_dim;
        for i in 0..self.depth {
            blocks.push(Block {
                name: format!("blocks.{i}"),
                main: vec![
                    node("linear", Layer::Linear(Linear::new(width, self.hidden))),
                    node("bn", Layer::BatchNorm(BatchNorm::d1(self.hidden))),
                    node("relu", Layer::Relu),
                ],
                shortcut: None,
                post: vec![],
            });
            width = self.hidden;
        }
        blocks.push(Block {
            name: "head".into(),
            main: vec![node("linear", Layer::Linear(Linear::new(width, self.classes)))],
            shortcut: None,
            post: vec![],
        });
        Model::new("mlp-bn", vec![self.input_dim], self.classes, blocks)
    }
}

/// `convnet-bn`: a small ResNet. Stem conv3x3-BN-ReLU, then residual blocks
/// (conv3x3-BN-ReLU-conv3x3-BN + shortcut, ReLU); a block that changes width or stride has
/// a conv1x1+BN downsampling shortcut; then global average pooling and a linear head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvNetBn {
    /// Input channels, height, width.
    pub input: [usize; 3],
    /// Channels of the stem and of each stage (each stage after the first halves H and W).
    pub widths: Vec<usize>,
    /// Output classes.
    pub classes: usize,
}

impl ConvNetBn {
    /// The digits configuration: 1x8x8 input, widths 16 and 32, 10 classes.
    pub fn digits() -> Self {
        ConvNetBn { input: [1, 8, 8], widths: vec![16, 32], classes: 10 }
    }

    /// Builds the model (one unit per block).
    pub fn build(&self) -> Result<Model, ModelError> {
        let first = *self
            .widths
            .first()
            .ok_or_else(|| ModelError::Config("convnet-bn needs at least one width".into()))?;
        let conv = |i, o, k, s, p| {
            Layer::Conv2d(Conv2d {
                in_channels: i,
                out_channels: o,
                kernel: k,
                stride: s,
                padding: p,
                bias: false,
            })
        };
        let mut blocks = vec![Block {
            name: "stem".into(),
            main: vec![
                node("conv", conv(self.input[0], first, 3, 1, 1)),
                node("bn", Layer::BatchNorm(BatchNorm::d2(first))),
                node("relu", Layer::Relu),
            ],
            shortcut: None,
            post: vec![],
        }];
        let mut c_in = first;
        for (i, &c) in self.widths.iter().enumerate() {
            let stride = if i == 0 { 1 } else { 2 };
            let shortcut = if stride != 1 || c != c_in {
                vec![
                    node("downsample.conv", conv(c_in, c, 1, stride, 0)),
                    node("downsample.bn", Layer::BatchNorm(BatchNorm::d2(c))),
                ]
            } else {
                vec![]
            };
            blocks.push(Block {
                name: format!("blocks.{i}"),
                main: vec![
                    node("conv1", conv(c_in, c, 3, stride, 1)),
                    node("bn1", Layer::BatchNorm(BatchNorm::d2(c))),
                    node("relu1", Layer::Relu),
                    node("conv2", conv(c, c, 3, 1, 1)),
                    node("bn2", Layer::BatchNorm(BatchNorm::d2(c))),
                ],
                shortcut: Some(shortcut),
                post: vec![node("relu", Layer::Relu)],
            });
            c_in = c;
        }
        blocks.push(Block {
            name: "head".into(),
            main: vec![
                node("pool", Layer::GlobalAvgPool),
                node("flatten", Layer::Flatten),
                node("fc", Layer::Linear(Linear::new(c_in, self.classes))),
            ],
            shortcut: None,
            post: vec![],
        });
        Ok(Model::new("convnet-bn", self.input.to_vec(), self.classes, blocks))
    }
}

/// `wide-mlp`: input -> depth x [Linear(hidden), ReLU] -> Linear(classes), sized by a
/// parameter count, for memory and throughput tests. Building it (and its spec) allocates
/// no parameter memory (MODEL-3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WideMlp {
    /// Input features.
    pub input_dim: usize,
    /// Width of every hidden block.
    pub hidden: usize,
    /// Number of hidden blocks.
    pub depth: usize,
    /// Output classes.
    pub classes: usize,
}

impl WideMlp {
    /// Depth 4, input 1024, 10 classes, and the hidden width (a multiple of 8) that brings
    /// the parameter count closest to `target`.
    ///
    /// ```
    /// let m = shardline_models::zoo::WideMlp::with_params(50_000_000);
    /// let n = m.num_params() as f64;
    /// assert!((n - 5e7).abs() / 5e7 < 0.01);
    /// ```
    pub fn with_params(target: usize) -> Self {
        let (input_dim, depth, classes) = (1024usize, 4usize, 10usize);
        let count =
            |h: usize| input_dim * h + h + (depth - 1) * (h * h + h) + h * classes + classes;
        // (depth-1) h^2 + (input + depth + classes) h + classes = target
        let a = (depth - 1) as f64;
        let b = (input_dim + depth + classes) as f64;
        let h = ((-b + (b * b + 4.0 * a * target as f64).sqrt()) / (2.0 * a)).max(8.0);
        let lo = ((h / 8.0).floor() as usize).max(1) * 8;
        let hidden =
            [lo, lo + 8].into_iter().min_by_key(|&h| count(h).abs_diff(target)).unwrap_or(lo);
        WideMlp { input_dim, hidden, depth, classes }
    }

    /// Trainable parameters.
    pub fn num_params(&self) -> usize {
        let h = self.hidden;
        self.input_dim * h
            + h
            + (self.depth.saturating_sub(1)) * (h * h + h)
            + h * self.classes
            + self.classes
    }

    /// Builds the model (one unit per block).
    pub fn build(&self) -> Model {
        let mut blocks = Vec::with_capacity(self.depth + 1);
        let mut width = self.input_dim;
        for i in 0..self.depth {
            blocks.push(Block {
                name: format!("blocks.{i}"),
                main: vec![
                    node("linear", Layer::Linear(Linear::new(width, self.hidden))),
                    node("relu", Layer::Relu),
                ],
                shortcut: None,
                post: vec![],
            });
            width = self.hidden;
        }
        blocks.push(Block {
            name: "head".into(),
            main: vec![node("linear", Layer::Linear(Linear::new(width, self.classes)))],
            shortcut: None,
            post: vec![],
        });
        Model::new("wide-mlp", vec![self.input_dim], self.classes, blocks)
    }
}

/// Builds a zoo model by name for a given input shape and class count (`mlp-bn` takes a
/// flat input; `convnet-bn` a `[C, H, W]` one). `wide_params` sizes `wide-mlp`.
pub fn by_name(
    name: &str,
    input_shape: &[usize],
    classes: usize,
    wide_params: usize,
) -> Result<Model, ModelError> {
    match name {
        "mlp-bn" => {
            let input_dim = input_shape.iter().product();
            Ok(MlpBn { input_dim, classes, ..MlpBn::digits() }.build())
        }
        "convnet-bn" => match input_shape {
            [c, h, w] => ConvNetBn { input: [*c, *h, *w], classes, ..ConvNetBn::digits() }.build(),
            _ => Err(ModelError::Config(format!(
                "convnet-bn needs a [C, H, W] input, got {input_shape:?}"
            ))),
        },
        "wide-mlp" => Ok(WideMlp::with_params(wide_params).build()),
        _ => Err(ModelError::Config(format!(
            "unknown model {name:?} (mlp-bn, convnet-bn, wide-mlp)"
        ))),
    }
}
