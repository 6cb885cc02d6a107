//! Data sets: the digits set shipped in the repository, a synthetic teacher-labelled set,
//! data read from files ([`idx`], [`csv`], [`npy`]; named by `--dataset` in [`source`]),
//! Fashion-MNIST ([`fashion`]), deterministic splits, and the distributed sampler.
//!
//! Invariants:
//! - `DATA-1`: in every epoch the sampler's rank slices partition the data set: each sample
//!   appears in exactly one global batch and in exactly one rank's slice of it (none dropped,
//!   none duplicated; the last batch may be short, and a rank's slice may be empty).
//! - `DATA-2`: rank slices are contiguous in global-batch order (rank r's slice comes
//!   before rank r+1's), so concatenating the ranks' slices gives the global batch.
//! - `DATA-3`: the order depends only on (seed, epoch); the split only on the seed.
//! - `DATA-4`: a token data set's sample is `block` input ids and their `block` next tokens
//!   (each target is the input one position later in the text); a batch gives the ids as a
//!   `u32` tensor `[n, block]` and the targets as `[n, block]`.
//! - `DATA-5`: a data set's labels are below its `classes`: the largest label + 1 unless the
//!   data declares its classes (digits and Fashion-MNIST: 10), when a label at or past the
//!   declared count is an error; a training and a test split read from files carry the same
//!   `classes` (the larger of the two).
//! - `DATA-6`: an image model gets samples `[C, H, W]` (`[H, W]` and a square number of
//!   values become `[1, H, W]`); any other model gets them flat (`[C * H * W]`); the values
//!   and their order are unchanged.
//! - `DATA-7`: every sample value read from a file is a finite number; a NaN or an infinity
//!   (before or after the scale) is an error naming the file and where it is, since the
//!   layers would turn it into a loss that looks sound (a ReLU maps NaN to 0).

pub mod csv;
pub mod fashion;
pub mod idx;
pub mod npy;
pub mod source;

use crate::error::ModelError;
use crate::rng::SplitMix64;
use crate::tensor::Tensor;

/// The digits CSV shipped in `models/data/` (see its README for the attribution).
pub const DIGITS_CSV: &str = include_str!("../../data/digits.csv");

/// A labelled data set held in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Samples, row-major, `len() * sample_numel()` values.
    pub x: Vec<f32>,
    /// Labels in `0..classes`.
    pub y: Vec<u32>,
    /// Shape of one sample (`[64]`, `[1, 8, 8]`).
    pub sample_shape: Vec<usize>,
    /// Number of classes (the vocabulary of a token data set).
    pub classes: usize,
    /// Feature vectors with one label each, or token windows with one target per token.
    pub kind: SampleKind,
}

/// What a sample of a [`Dataset`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SampleKind {
    /// `f32` features of `sample_shape`, one class label.
    #[default]
    Features,
    /// `sample_shape = [block]` token ids (held as exact `f32`, given out as `u32`) and
    /// `block` next-token targets (DATA-4).
    Tokens,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len() / self.targets_per_sample().max(1)
    }

    /// Targets per sample: 1 label, or one per token.
    pub fn targets_per_sample(&self) -> usize {
        match self.kind {
            SampleKind::Features => 1,
            SampleKind::Tokens => self.sample_numel(),
        }
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// Values per sample.
    pub fn sample_numel(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// Checks that every label is below `classes`, the count the data declares (DATA-5);
    /// errors name `source_name`.
    pub fn check_labels(&self, classes: usize, source_name: &str) -> Result<(), ModelError> {
        match self.y.iter().enumerate().find(|(_, &l)| l as usize >= classes) {
            None => Ok(()),
            Some((i, &l)) => Err(ModelError::Data {
                source_name: source_name.to_string(),
                msg: format!(
                    "label {l} of sample {i} is not below the {classes} classes the data declares"
                ),
            }),
        }
    }

    /// The samples shaped for an image model (`[C, H, W]`) when `image`, else flat (DATA-6);
    /// samples that are no image (neither 2-D, 3-D nor a square number of values) are an
    /// error for an image model, naming `source_name`.
    pub fn shaped_for(mut self, image: bool, source_name: &str) -> Result<Self, ModelError> {
        if self.kind != SampleKind::Features {
            return Ok(self);
        }
        let numel = self.sample_numel();
        self.sample_shape = match (image, self.sample_shape.as_slice()) {
            (false, _) => vec![numel],
            (true, [_, _, _]) => self.sample_shape,
            (true, [h, w]) => vec![1, *h, *w],
            (true, [n]) if n.isqrt() * n.isqrt() == *n => vec![1, n.isqrt(), n.isqrt()],
            (true, other) => {
                return Err(ModelError::Data {
                    source_name: source_name.to_string(),
                    msg: format!(
                        "samples of shape {other:?} are no image: an image model needs [C, H, W], \
                         [H, W] or a square number of values"
                    ),
                })
            }
        };
        Ok(self)
    }

    /// The digits set (1,797 8x8 images, pixels / 16 in [0, 1], 10 classes); `image`
    /// gives samples the shape `[1, 8, 8]`, otherwise `[64]`.
    pub fn digits(image: bool) -> Result<Self, ModelError> {
        let shape = if image { vec![1, 8, 8] } else { vec![64] };
        let mut d = Self::from_csv(DIGITS_CSV, "digits.csv", shape, 16.0)?;
        d.classes = 10;
        Ok(d)
    }

    /// `n` Gaussian inputs of `input_dim` values labelled by a fixed random teacher network
    /// (`input_dim -> 32 tanh -> classes`, argmax); everything derived from `seed`.
    pub fn synthetic(
        n: usize,
        input_dim: usize,
        classes: usize,
        seed: u64,
    ) -> Result<Self, ModelError> {
        if classes == 0 || input_dim == 0 {
            return Err(ModelError::Config(
                "synthetic data needs input_dim > 0 and classes > 0".into(),
            ));
        }
        const H: usize = 32;
        let mut t = SplitMix64::derive(seed, 1);
        let w1: Vec<f32> =
            (0..H * input_dim).map(|_| t.normal() / (input_dim as f32).sqrt()).collect();
        let w2: Vec<f32> = (0..classes * H).map(|_| t.normal() / (H as f32).sqrt()).collect();
        let b2: Vec<f32> = (0..classes).map(|_| 0.1 * t.normal()).collect();
        let mut g = SplitMix64::derive(seed, 2);
        let x: Vec<f32> = (0..n * input_dim).map(|_| g.normal()).collect();
        let mut y = Vec::with_capacity(n);
        let mut h = [0.0f32; H];
        for s in x.chunks_exact(input_dim) {
            for (j, hv) in h.iter_mut().enumerate() {
                *hv = w1[j * input_dim..(j + 1) * input_dim]
                    .iter()
                    .zip(s)
                    .map(|(a, b)| a * b)
                    .sum::<f32>()
                    .tanh();
            }
            let mut best = (0, f32::NEG_INFINITY);
            for c in 0..classes {
                let v =
                    b2[c] + w2[c * H..(c + 1) * H].iter().zip(&h).map(|(a, b)| a * b).sum::<f32>();
                if v > best.1 {
                    best = (c, v);
                }
            }
            y.push(best.0 as u32);
        }
        Ok(Dataset { x, y, sample_shape: vec![input_dim], classes, kind: SampleKind::Features })
    }

    /// The samples at `idx`, as a batch tensor `[len, ...sample_shape]` and labels.
    pub fn batch(&self, idx: &[usize]) -> (Tensor, Vec<u32>) {
        let (k, t) = (self.sample_numel(), self.targets_per_sample());
        let mut x = Vec::with_capacity(idx.len() * k);
        let mut y = Vec::with_capacity(idx.len() * t);
        for &i in idx {
            x.extend_from_slice(&self.x[i * k..(i + 1) * k]);
            y.extend_from_slice(&self.y[i * t..(i + 1) * t]);
        }
        let mut shape = vec![idx.len()];
        shape.extend_from_slice(&self.sample_shape);
        let x = match self.kind {
            SampleKind::Features => Tensor::new(shape, x),
            SampleKind::Tokens => Tensor::from_u32(shape, x.iter().map(|&v| v as u32).collect()),
        };
        (x.expect("batch: sample shape times count"), y)
    }

    /// [`Dataset::batch`] with the targets as a tensor: labels `[n]`, or next tokens
    /// `[n, block]`.
    pub fn batch_tensors(&self, idx: &[usize]) -> (Tensor, Tensor) {
        let (x, y) = self.batch(idx);
        let shape = match self.kind {
            SampleKind::Features => vec![idx.len()],
            SampleKind::Tokens => vec![idx.len(), self.targets_per_sample()],
        };
        (x, Tensor::from_u32(shape, y).expect("targets per sample times count"))
    }

    /// `windows` windows of `block + 1` tokens of a corpus split as a token data set
    /// (DATA-4): training windows at seeded random positions (TEXT-2, step 0), validation
    /// windows side by side from the split's start (every held-out token scored once).
    pub fn from_text(
        corpus: &crate::text::TextCorpus,
        split: crate::text::Split,
        block: usize,
        windows: usize,
        seed: u64,
    ) -> Result<Dataset, ModelError> {
        let (inputs, targets) = match split {
            crate::text::Split::Train => corpus.batch(split, block, seed, 0, 0..windows)?,
            crate::text::Split::Validation => {
                corpus.check_block(block)?;
                let tokens = corpus.split(split);
                let n = windows.min((tokens.len() - 1) / block);
                let (mut i, mut t) = (Vec::new(), Vec::new());
                for w in 0..n {
                    let s = &tokens[w * block..w * block + block + 1];
                    i.extend(s[..block].iter().map(|&v| u32::from(v)));
                    t.extend(s[1..].iter().map(|&v| u32::from(v)));
                }
                (i, t)
            }
        };
        Ok(Dataset {
            x: inputs.iter().map(|&v| v as f32).collect(),
            y: targets,
            sample_shape: vec![block],
            classes: corpus.vocab,
            kind: SampleKind::Tokens,
        })
    }

    fn subset(&self, idx: &[usize]) -> Dataset {
        let (x, y) = self.batch(idx);
        let x = match self.kind {
            SampleKind::Features => x.into_f32().expect("an f32 batch"),
            SampleKind::Tokens => {
                x.as_u32().expect("a token batch").iter().map(|&v| v as f32).collect()
            }
        };
        Dataset {
            x,
            y,
            sample_shape: self.sample_shape.clone(),
            classes: self.classes,
            kind: self.kind,
        }
    }

    /// Stratified split: within each class, a seeded shuffle puts `round(test_fraction *
    /// class size)` samples in the test set (DATA-3). Returns `(train, test)`.
    pub fn split(&self, test_fraction: f64, seed: u64) -> (Dataset, Dataset) {
        let mut rng = SplitMix64::derive(seed, 3);
        let (mut train, mut test) = (Vec::new(), Vec::new());
        for c in 0..self.classes as u32 {
            let mut idx: Vec<usize> = (0..self.len()).filter(|&i| self.y[i] == c).collect();
            rng.shuffle(&mut idx);
            let k = (idx.len() as f64 * test_fraction).round() as usize;
            test.extend_from_slice(&idx[..k]);
            train.extend_from_slice(&idx[k..]);
        }
        train.sort_unstable();
        test.sort_unstable();
        (self.subset(&train), self.subset(&test))
    }
}

/// Splits each global batch of a per-epoch shuffled order among the ranks (DATA-1..3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    global_batch: usize,
    seed: u64,
    shuffle: bool,
}

impl DistributedSampler {
    /// A sampler over `len` samples, `world` ranks, `global_batch` samples per step.
    pub fn new(
        len: usize,
        world: usize,
        global_batch: usize,
        seed: u64,
        shuffle: bool,
    ) -> Result<Self, ModelError> {
        if world == 0 || global_batch == 0 {
            return Err(ModelError::Config("sampler needs world > 0 and global batch > 0".into()));
        }
        Ok(DistributedSampler { len, world, global_batch, seed, shuffle })
    }

    /// The most samples one rank gets from a global batch.
    pub fn per_rank_batch(&self) -> usize {
        self.global_batch.div_ceil(self.world)
    }

    /// Steps per epoch (the last batch may be short).
    pub fn batches_per_epoch(&self) -> usize {
        self.len.div_ceil(self.global_batch)
    }

    /// The epoch's sample order.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            SplitMix64::derive(self.seed, 0x5EED_0000 + epoch).shuffle(&mut idx);
        }
        idx
    }

    /// Rank `rank`'s contiguous slice of a batch of `n` samples: the first `n % world` ranks
    /// get one more sample than the others.
    pub fn slice_range(n: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
        let (base, extra) = (n / world, n % world);
        let start = rank * base + rank.min(extra);
        start..start + base + usize::from(rank < extra)
    }

    /// For each step of the epoch: `(global batch size, this rank's sample indices)`.
    pub fn rank_batches(&self, epoch: u64, rank: usize) -> Vec<(usize, Vec<usize>)> {
        let order = self.epoch_order(epoch);
        order
            .chunks(self.global_batch)
            .map(|b| (b.len(), b[Self::slice_range(b.len(), self.world, rank)].to_vec()))
            .collect()
    }
}

/// One rank's batches of the current epoch, computed once per epoch: shuffling the whole
/// data set's order for every step would cost O(samples) per step.
#[derive(Debug, Default)]
pub struct RankBatches {
    epoch: Option<u64>,
    batches: Vec<(usize, Vec<usize>)>,
}

impl RankBatches {
    /// Step `index` of `epoch` for `rank`: `(global batch size, this rank's sample indices)`,
    /// as [`DistributedSampler::rank_batches`] gives it; `None` past the epoch's last step.
    pub fn get(
        &mut self,
        sampler: &DistributedSampler,
        epoch: u64,
        rank: usize,
        index: usize,
    ) -> Option<&(usize, Vec<usize>)> {
        if self.epoch != Some(epoch) {
            self.batches = sampler.rank_batches(epoch, rank);
            self.epoch = Some(epoch);
        }
        self.batches.get(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rank_batches_cache_follows_the_epochs() {
        let s = DistributedSampler::new(50, 3, 8, 7, true).unwrap();
        let mut c = RankBatches::default();
        // Forward across an epoch boundary, then back to an earlier epoch (a resume).
        for (epoch, index) in [(0u64, 0usize), (0, 6), (1, 0), (1, 3), (0, 2), (2, 6)] {
            let want = s.rank_batches(epoch, 1)[index].clone();
            assert_eq!(c.get(&s, epoch, 1, index), Some(&want), "epoch {epoch} step {index}");
        }
        assert_eq!(c.get(&s, 2, 1, 7), None);
    }

    #[test]
    fn digits_load_with_expected_shape_and_range() {
        let d = Dataset::digits(true).unwrap();
        assert_eq!(d.len(), 1797);
        assert_eq!(d.sample_shape, vec![1, 8, 8]);
        assert_eq!(d.x.len(), 1797 * 64);
        assert!(d.x.iter().all(|&v| (0.0..=1.0).contains(&v)));
        assert!(d.y.iter().all(|&y| y < 10));
        let (train, test) = d.split(0.2, 1);
        assert_eq!(train.len() + test.len(), d.len());
        assert!((test.len() as f64 - 0.2 * 1797.0).abs() < 10.0);
        for c in 0..10u32 {
            let n = test.y.iter().filter(|&&y| y == c).count();
            assert!((30..=42).contains(&n), "class {c}: {n} in test");
        }
        assert_eq!(d.split(0.2, 1), (train, test), "DATA-3: split is deterministic");
    }

    #[test]
    fn token_windows_target_the_next_token_data_4() {
        let text: Vec<u8> = (0..500u32).map(|i| (i * 7 % 256) as u8).collect();
        let c = crate::text::TextCorpus::from_bytes("t", &text).unwrap();
        let d = Dataset::from_text(&c, crate::text::Split::Train, 8, 20, 3).unwrap();
        assert_eq!((d.len(), d.classes, d.targets_per_sample()), (20, 256, 8));
        let (x, y) = d.batch_tensors(&[4, 0]);
        assert_eq!((x.shape(), y.shape()), (&[2usize, 8][..], &[2usize, 8][..]));
        let (x, y) = (x.as_u32().unwrap(), y.as_u32().unwrap());
        for r in 0..2 {
            // Consecutive bytes of the text differ by 7 (mod 256): targets are inputs + 1 position.
            for t in 0..8 {
                assert_eq!(y[r * 8 + t], (x[r * 8 + t] + 7) % 256, "DATA-4");
            }
        }
        let v = Dataset::from_text(&c, crate::text::Split::Validation, 8, usize::MAX, 3).unwrap();
        assert_eq!(v.len(), 49 / 8, "held-out windows side by side");
    }

    #[test]
    fn image_models_get_chw_and_others_flat_data_6() {
        let d = Dataset::synthetic(3, 16, 2, 1).unwrap();
        let img = d.clone().shaped_for(true, "s").unwrap();
        assert_eq!((img.sample_shape.clone(), &img.x), (vec![1, 4, 4], &d.x));
        assert_eq!(img.clone().shaped_for(false, "s").unwrap().sample_shape, vec![16]);
        let hw = Dataset { sample_shape: vec![2, 8], ..d.clone() }.shaped_for(true, "s").unwrap();
        assert_eq!(hw.sample_shape, vec![1, 2, 8]);
        let odd = Dataset::synthetic(3, 12, 2, 1).unwrap();
        let e = odd.shaped_for(true, "odd.npy").unwrap_err().to_string();
        assert!(e.contains("odd.npy") && e.contains("[12] are no image"), "{e}");
    }

    #[test]
    fn labels_past_the_declared_classes_are_errors_data_5() {
        let d = Dataset::synthetic(50, 4, 3, 2).unwrap();
        assert!(d.check_labels(3, "s").is_ok());
        let e = d.check_labels(2, "s.csv").unwrap_err().to_string();
        assert!(
            e.contains("s.csv") && e.contains("label 2 of sample") && e.contains("2 classes"),
            "{e}"
        );
    }

    #[test]
    fn synthetic_is_deterministic_and_uses_every_class() {
        let a = Dataset::synthetic(500, 12, 4, 9).unwrap();
        assert_eq!(a, Dataset::synthetic(500, 12, 4, 9).unwrap());
        assert_ne!(a.y, Dataset::synthetic(500, 12, 4, 10).unwrap().y);
        for c in 0..4u32 {
            assert!(a.y.iter().filter(|&&y| y == c).count() > 10, "class {c} is rare");
        }
    }

    proptest! {
        #[test]
        fn sampler_partitions_every_epoch(len in 0usize..200, world in 1usize..9, gb in 1usize..40, seed in 0u64..1000, epoch in 0u64..3) {
            // DATA-1, DATA-2
            let s = DistributedSampler::new(len, world, gb, seed, true).unwrap();
            let per_rank: Vec<_> = (0..world).map(|r| s.rank_batches(epoch, r)).collect();
            let order = s.epoch_order(epoch);
            let mut seen = Vec::new();
            for step in 0..s.batches_per_epoch() {
                let mut global = Vec::new();
                for rb in per_rank.iter() {
                    prop_assert_eq!(rb[step].0, order.chunks(gb).nth(step).map_or(0, |c| c.len()));
                    global.extend_from_slice(&rb[step].1);
                }
                prop_assert_eq!(&global[..], order.chunks(gb).nth(step).unwrap_or(&[]));
                seen.extend(global);
            }
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..len).collect::<Vec<_>>());
        }
    }

    #[test]
    fn epochs_reshuffle() {
        let s = DistributedSampler::new(100, 4, 10, 3, true).unwrap();
        assert_ne!(s.epoch_order(0), s.epoch_order(1));
        assert_eq!(s.epoch_order(1), s.epoch_order(1));
    }
}
