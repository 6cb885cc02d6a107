//! Text for language models: a corpus of tokens, a held-out split, and seeded random windows.
//!
//! A corpus is bytes (vocabulary 256) read from a file or from every file of a folder (in
//! name order, concatenated), or a nanoGPT-style token file (`.bin`: little-endian `uint16`
//! ids, as nanoGPT's `prepare.py` writes them), which is for training only. The bundled
//! corpus ([`TextCorpus::bundled`]) is the license texts Debian ships in
//! `/usr/share/common-licenses/` (see `models/data/text/README.md`).
//!
//! Invariants:
//! - `TEXT-1`: the held-out split of a byte corpus is its last 10% of tokens; training
//!   windows lie wholly before it and validation windows wholly inside it. A `.bin` corpus
//!   has no held-out split.
//! - `TEXT-2`: the window of sample `i` of the global batch of step `s` starts at a position
//!   drawn from `(seed, split, s, i)` alone, so the global batch is the same at every world
//!   size and a rank's samples (a range of `i`) are a slice of it, and a resumed run draws
//!   the windows it would have drawn.
//! - `TEXT-3`: a window is `block + 1` consecutive tokens: the inputs are its first `block`,
//!   the targets its last `block` (each input's next token).

use std::ops::Range;
use std::path::Path;

use crate::error::ModelError;
use crate::rng::SplitMix64;

/// The bundled corpus: the license texts of Debian's `/usr/share/common-licenses/`.
pub const BUNDLED_TEXT: &str = include_str!("../data/text/common-licenses.txt");

/// Which part of a corpus windows come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The first 90% (all of a `.bin` corpus).
    Train,
    /// The last 10% of a byte corpus (TEXT-1).
    Validation,
}

/// A corpus of token ids.
#[derive(Clone, Debug)]
pub struct TextCorpus {
    /// Where it came from, for messages.
    pub name: String,
    tokens: Vec<u16>,
    /// Ids are below this (256 for bytes).
    pub vocab: usize,
    /// Where the held-out split starts (`tokens.len()` when there is none).
    held_out: usize,
}

fn data_err(name: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Data { source_name: name.to_string(), msg: msg.into() }
}

impl TextCorpus {
    /// A byte corpus (vocabulary 256) with its last 10% held out.
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<Self, ModelError> {
        if bytes.is_empty() {
            return Err(data_err(name, "no text (empty)"));
        }
        let tokens: Vec<u16> = bytes.iter().map(|&b| u16::from(b)).collect();
        let held_out = tokens.len() - tokens.len() / 10;
        Ok(TextCorpus { name: name.to_string(), tokens, vocab: 256, held_out })
    }

    /// The bundled corpus.
    pub fn bundled() -> Self {
        Self::from_bytes("bundled common-licenses text", BUNDLED_TEXT.as_bytes())
            .expect("the bundled text is not empty")
    }

    /// Reads `path`: a `.bin` token file, a text file, or a folder of text files (its
    /// regular files in name order; subfolders are not read).
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let name = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| data_err(&name, e.to_string()))?;
        if meta.is_dir() {
            let mut files: Vec<_> = std::fs::read_dir(path)
                .map_err(|e| data_err(&name, e.to_string()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(data_err(&name, "the folder holds no files"));
            }
            let mut bytes = Vec::new();
            for f in &files {
                let b = std::fs::read(f)
                    .map_err(|e| data_err(&f.display().to_string(), e.to_string()))?;
                bytes.extend_from_slice(&b);
            }
            return Self::from_bytes(&name, &bytes);
        }
        let bytes = std::fs::read(path).map_err(|e| data_err(&name, e.to_string()))?;
        if path.extension().is_some_and(|e| e == "bin") {
            return Self::from_token_file(&name, &bytes);
        }
        Self::from_bytes(&name, &bytes)
    }

    /// A nanoGPT token file: little-endian `uint16` ids, training only (TEXT-1).
    pub fn from_token_file(name: &str, bytes: &[u8]) -> Result<Self, ModelError> {
        if bytes.is_empty() {
            return Err(data_err(name, "no tokens (empty)"));
        }
        if !bytes.len().is_multiple_of(2) {
            return Err(data_err(
                name,
                format!("{} bytes: a .bin token file holds 2-byte (uint16) ids", bytes.len()),
            ));
        }
        let tokens: Vec<u16> =
            bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        let vocab = tokens.iter().copied().max().map_or(0, |m| m as usize + 1);
        let held_out = tokens.len();
        Ok(TextCorpus { name: name.to_string(), tokens, vocab, held_out })
    }

    /// The tokens of a split (TEXT-1); empty for the validation split of a `.bin` corpus.
    pub fn split(&self, split: Split) -> &[u16] {
        match split {
            Split::Train => &self.tokens[..self.held_out],
            Split::Validation => &self.tokens[self.held_out..],
        }
    }

    /// Whether the corpus has a held-out split.
    pub fn has_validation(&self) -> bool {
        self.held_out < self.tokens.len()
    }

    /// Checks that windows of `block + 1` tokens fit in every split the corpus has.
    pub fn check_block(&self, block: usize) -> Result<(), ModelError> {
        for (split, what) in [(Split::Train, "training"), (Split::Validation, "held-out")] {
            let n = self.split(split).len();
            if (split == Split::Train || self.has_validation()) && n < block + 1 {
                return Err(data_err(
                    &self.name,
                    format!(
                        "its {what} split has {n} tokens, fewer than block_size + 1 = {}",
                        block + 1
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Where the windows of samples `samples` of the global batch of step `step` start in
    /// the split (TEXT-2).
    pub fn window_starts(
        &self,
        split: Split,
        block: usize,
        seed: u64,
        step: u64,
        samples: Range<usize>,
    ) -> Result<Vec<usize>, ModelError> {
        self.check_block(block)?;
        let n = self.split(split).len();
        if split == Split::Validation && !self.has_validation() {
            return Err(data_err(&self.name, "a .bin token file has no held-out split"));
        }
        let positions = (n - block) as u64;
        let tag = match split {
            Split::Train => 0,
            Split::Validation => 1,
        };
        Ok(samples
            .map(|i| {
                let stream = (tag << 62) ^ (step << 24) ^ i as u64;
                let mut g = SplitMix64::derive(seed ^ step.rotate_left(32), stream);
                // Multiply-shift: uniform in [0, positions) without a modulo bias worth
                // caring about for corpora below 2^32 tokens.
                (((g.next_u64() >> 32) * positions) >> 32) as usize
            })
            .collect())
    }

    /// Inputs and targets (each `samples.len() x block`, row-major) of samples `samples` of
    /// the global batch of step `step` (TEXT-2, TEXT-3).
    pub fn batch(
        &self,
        split: Split,
        block: usize,
        seed: u64,
        step: u64,
        samples: Range<usize>,
    ) -> Result<(Vec<u32>, Vec<u32>), ModelError> {
        let starts = self.window_starts(split, block, seed, step, samples)?;
        let tokens = self.split(split);
        let mut inputs = Vec::with_capacity(starts.len() * block);
        let mut targets = Vec::with_capacity(starts.len() * block);
        for s in starts {
            let w = &tokens[s..s + block + 1];
            inputs.extend(w[..block].iter().map(|&t| u32::from(t)));
            targets.extend(w[1..].iter().map(|&t| u32::from(t)));
        }
        Ok((inputs, targets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> TextCorpus {
        let text: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        TextCorpus::from_bytes("t", &text).unwrap()
    }

    #[test]
    fn the_last_tenth_is_held_out_and_windows_stay_in_their_split_text_1() {
        let c = corpus();
        assert_eq!((c.split(Split::Train).len(), c.split(Split::Validation).len()), (900, 100));
        let block = 16;
        for step in 0..50 {
            for s in c.window_starts(Split::Train, block, 3, step, 0..8).unwrap() {
                assert!(s + block < 900, "training window at {s} reaches the held-out split");
            }
            for s in c.window_starts(Split::Validation, block, 3, step, 0..8).unwrap() {
                assert!(s + block < 100);
            }
        }
        // The token at position p of the validation split is byte 900 + p of the text.
        let (x, _) = c.batch(Split::Validation, block, 3, 0, 0..1).unwrap();
        let s = c.window_starts(Split::Validation, block, 3, 0, 0..1).unwrap()[0];
        assert_eq!(x[0], ((900 + s) % 251) as u32);
    }

    #[test]
    fn a_ranks_samples_are_its_slice_of_the_global_batch_text_2() {
        let c = corpus();
        let (whole_x, whole_y) = c.batch(Split::Train, 8, 5, 17, 0..12).unwrap();
        for world in [2usize, 3, 4] {
            let mut xs = Vec::new();
            let mut ys = Vec::new();
            for r in 0..world {
                let per = 12 / world;
                let (x, y) = c.batch(Split::Train, 8, 5, 17, r * per..(r + 1) * per).unwrap();
                xs.extend(x);
                ys.extend(y);
            }
            assert_eq!((xs, ys), (whole_x.clone(), whole_y.clone()), "world {world}");
        }
        // Another step or seed draws other windows.
        assert_ne!(c.batch(Split::Train, 8, 5, 18, 0..12).unwrap().0, whole_x);
        assert_ne!(c.batch(Split::Train, 8, 6, 17, 0..12).unwrap().0, whole_x);
    }

    #[test]
    fn targets_are_the_next_tokens_text_3() {
        let c = corpus();
        let (x, y) = c.batch(Split::Train, 10, 1, 2, 0..4).unwrap();
        for r in 0..4 {
            assert_eq!(x[r * 10 + 1..r * 10 + 10], y[r * 10..r * 10 + 9], "sample {r}");
        }
    }

    #[test]
    fn windows_cover_the_split_roughly_uniformly() {
        let c = corpus();
        let starts = c.window_starts(Split::Train, 60, 9, 0, 0..8000).unwrap();
        let positions = 900 - 60;
        let mut buckets = [0usize; 8];
        for s in starts {
            assert!(s < positions);
            buckets[s * 8 / positions] += 1;
        }
        // 1000 expected per bucket; 5 standard deviations is about 150.
        assert!(buckets.iter().all(|&b| (850..1150).contains(&b)), "{buckets:?}");
    }

    #[test]
    fn bad_corpora_are_errors_naming_them() {
        let e = TextCorpus::from_bytes("empty.txt", b"").unwrap_err().to_string();
        assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");
        let small = TextCorpus::from_bytes("small.txt", &[b'a'; 50]).unwrap();
        let e = small.check_block(64).unwrap_err().to_string();
        assert!(e.contains("small.txt") && e.contains("block_size"), "{e}");
        let e = TextCorpus::from_token_file("odd.bin", &[1, 2, 3]).unwrap_err().to_string();
        assert!(e.contains("odd.bin") && e.contains("uint16"), "{e}");
        let e = TextCorpus::open(Path::new("/nonexistent/corpus.txt")).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/corpus.txt"), "{e}");
    }

    #[test]
    fn token_files_and_folders_are_read() {
        let dir = std::env::temp_dir().join(format!("shardline-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ids: Vec<u16> = vec![5, 300, 7, 65535, 0];
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(dir.join("train.bin"), &bytes).unwrap();
        let c = TextCorpus::open(&dir.join("train.bin")).unwrap();
        assert_eq!((c.split(Split::Train), c.vocab, c.has_validation()), (&ids[..], 65536, false));
        assert!(c.window_starts(Split::Validation, 2, 0, 0, 0..1).is_err());
        let texts = dir.join("texts");
        std::fs::create_dir_all(&texts).unwrap();
        std::fs::write(texts.join("b.txt"), "world").unwrap();
        std::fs::write(texts.join("a.txt"), "hello ").unwrap();
        let c = TextCorpus::open(&texts).unwrap();
        let all: Vec<u8> = [Split::Train, Split::Validation]
            .iter()
            .flat_map(|&s| c.split(s).iter().map(|&t| t as u8))
            .collect();
        assert_eq!(all, b"hello world");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_bundled_text_is_large_enough_for_nanogpt_windows() {
        let c = TextCorpus::bundled();
        assert!(c.split(Split::Train).len() > 200_000, "{}", c.split(Split::Train).len());
        c.check_block(256).unwrap();
    }
}
