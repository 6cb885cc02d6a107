//! The job's data sets, by their `--dataset` name: the bundled digits, synthetic data, text
//! corpora for `gpt`, and data read from files (`shardline_models::data::source`), shaped
//! for the model (DATA-6). Errors in a file name the flag and the file.

use crate::error::{Result, RuntimeError};
use crate::train::{TrainConfig, GPT_DEFAULTS};
use shardline_models::data::source::FileData;
use shardline_models::text::{Split, TextCorpus};
use shardline_models::Dataset;

/// The text corpus of `--dataset text[:PATH]` (the bundled one without a path); errors
/// name the path.
pub fn load_corpus(dataset: &str) -> Result<TextCorpus> {
    match dataset.strip_prefix("text:") {
        Some(path) => TextCorpus::open(std::path::Path::new(path))
            .map_err(|e| RuntimeError::config(format!("--dataset {dataset}: {e}"))),
        None => Ok(TextCorpus::bundled()),
    }
}

/// Loads the data set named in the config: (train, test), samples shaped for an image model
/// when `image` (DATA-6).
pub fn load_data(cfg: &TrainConfig, image: bool) -> Result<(Dataset, Dataset)> {
    load_data_with_origin(cfg, image).map(|(train, test, _)| (train, test))
}

/// [`load_data`], and for data read from files where it came from and how its test split
/// was made (the job's header says it). Errors in a file name the flag and the file.
pub fn load_data_with_origin(
    cfg: &TrainConfig,
    image: bool,
) -> Result<(Dataset, Dataset, Option<String>)> {
    if let Some(src) = FileData::parse(&cfg.dataset) {
        let src = src.map_err(RuntimeError::config)?;
        let flag = |e: shardline_models::ModelError| {
            RuntimeError::config(format!("--dataset {}: {e}", cfg.dataset))
        };
        let l = src.load(cfg.data_scale.unwrap_or(1.0)).map_err(flag)?;
        let train = l.train.shaped_for(image, &cfg.dataset).map_err(flag)?;
        let test = l.test.shaped_for(image, &cfg.dataset).map_err(flag)?;
        return Ok((train, test, Some(l.origin)));
    }
    load_named(cfg, image).map(|(train, test)| (train, test, None))
}

/// The data sets that are no files: text corpora, digits, synthetic.
fn load_named(cfg: &TrainConfig, image: bool) -> Result<(Dataset, Dataset)> {
    if cfg.dataset == "text" || cfg.dataset.starts_with("text:") {
        let corpus = load_corpus(&cfg.dataset)?;
        let block = cfg.block_size.unwrap_or(GPT_DEFAULTS.3);
        if block == 0 {
            return Err(RuntimeError::config("--block-size must be at least 1"));
        }
        corpus.check_block(block).map_err(|e| {
            RuntimeError::config(format!(
                // Not "--block-size": eval takes its block size from the checkpoint.
                "--dataset {} with block size {block}: {e}",
                cfg.dataset
            ))
        })?;
        // An epoch draws about one window per `block` training tokens (each token seen about
        // once per epoch), at least one global batch.
        let n = (corpus.split(Split::Train).len() / block).max(cfg.batch_size);
        let data = |split, n| {
            Dataset::from_text(&corpus, split, block, n, cfg.seed).map_err(RuntimeError::from_model)
        };
        let train = data(Split::Train, n)?;
        let test = if corpus.has_validation() {
            data(Split::Validation, usize::MAX)?
        } else {
            data(Split::Train, 0)?
        };
        return Ok((train, test));
    }
    match cfg.dataset.as_str() {
        "digits" => {
            let d = Dataset::digits(image).map_err(RuntimeError::from_model)?;
            Ok(d.split(0.2, 1234))
        }
        "synthetic" => {
            let n = cfg.samples + cfg.samples / 4;
            let d = Dataset::synthetic(n, cfg.input_dim, cfg.classes, cfg.seed ^ 0xDA7A)
                .and_then(|d| d.shaped_for(image, "synthetic"))
                .map_err(|e| RuntimeError::config(format!("--dataset synthetic: {e}")))?;
            Ok(d.split(0.2, 1234))
        }
        other => Err(RuntimeError::config(format!(
            "unknown dataset '{other}' (choose digits, synthetic, fashion-mnist, idx:DIR, \
             csv:PATH, npy:X.npy,Y.npy, text or text:PATH)"
        ))),
    }
}
