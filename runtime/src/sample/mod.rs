//! Text generation from a byte-level `gpt` checkpoint (`shardline sample`).
//!
//! `load` rebuilds the decoder a run trained from its checkpoint; `pick` draws the next token
//! from a row of logits. Generation itself is nanoGPT's `generate`: the context is cropped to
//! the last `block_size` tokens, the logits of its last position give the next token, which
//! is appended, `tokens` times. `utf8` shows the bytes as text while they arrive.

mod load;
mod pick;
mod utf8;

pub use load::{load_decoder, Decoder};
pub use pick::Pick;
pub use utf8::LossyUtf8;

use shardline_models::rng::SplitMix64;

use crate::error::{Result, RuntimeError};

/// Tokens of a byte-level vocabulary: one per byte value.
pub const BYTE_VOCAB: usize = 256;

/// Context of an empty prompt: a newline, as at the start of a line of text.
pub const EMPTY_PROMPT_CONTEXT: u8 = b'\n';

/// What to generate and how.
#[derive(Clone, Copy, Debug)]
pub struct SampleOptions {
    /// Bytes to generate after the prompt (at least 1).
    pub tokens: usize,
    /// Draw settings.
    pub pick: Pick,
    /// Seed of the draws.
    pub seed: u64,
}

impl SampleOptions {
    /// Checks the options; errors name the flag.
    pub fn validate(&self) -> Result<()> {
        if self.tokens == 0 {
            return Err(RuntimeError::config("--tokens must be at least 1"));
        }
        let t = self.pick.temperature;
        if !(t > 0.0 && t.is_finite()) {
            return Err(RuntimeError::config(format!(
                "--temperature {t} must be a positive number"
            )));
        }
        if self.pick.top_k == Some(0) {
            return Err(RuntimeError::config("--top-k must be at least 1"));
        }
        Ok(())
    }
}

impl Decoder {
    /// The `opts.tokens` bytes that follow `prompt` (an empty prompt starts from
    /// [`EMPTY_PROMPT_CONTEXT`]). Byte-level decoders only (vocabulary of 256).
    pub fn generate(&self, prompt: &[u8], opts: &SampleOptions) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(opts.tokens);
        self.generate_each(prompt, opts, |b| {
            out.push(b);
            Ok(())
        })?;
        Ok(out)
    }

    /// As [`Decoder::generate`], handing each byte to `each` as soon as it is drawn, so that a
    /// long generation shows its progress; an error from `each` stops it.
    pub fn generate_each(
        &self,
        prompt: &[u8],
        opts: &SampleOptions,
        mut each: impl FnMut(u8) -> Result<()>,
    ) -> Result<()> {
        opts.validate()?;
        let g = &self.config;
        if g.vocab_size != BYTE_VOCAB {
            return Err(RuntimeError::config(format!(
                "the checkpoint's vocabulary has {} tokens; sampling reads and writes bytes \
                 ({BYTE_VOCAB} tokens)",
                g.vocab_size
            )));
        }
        let mut ctx: Vec<u32> = if prompt.is_empty() {
            vec![u32::from(EMPTY_PROMPT_CONTEXT)]
        } else {
            prompt.iter().map(|&b| u32::from(b)).collect()
        };
        let mut rng = SplitMix64::new(opts.seed);
        for _ in 0..opts.tokens {
            let window = &ctx[ctx.len().saturating_sub(g.block_size)..];
            let (logits, _) = g
                .forward::<f32, _>(&self.params, &[window])
                .map_err(|e| RuntimeError::Failed(format!("gpt forward: {e}")))?;
            let last = &logits[(window.len() - 1) * g.vocab_size..];
            let next = opts.pick.next(last, &mut rng);
            // The vocabulary is 256 tokens, so every token is a byte.
            let byte = u8::try_from(next).unwrap_or(u8::MAX);
            each(byte)?;
            ctx.push(u32::from(byte));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_models::nn::GptConfig;

    fn decoder(block_size: usize) -> Decoder {
        let config = GptConfig {
            vocab_size: BYTE_VOCAB,
            block_size,
            n_layer: 1,
            n_head: 2,
            n_embd: 8,
            bias: true,
            layernorm_eps: 1e-5,
            dropout: 0.0,
        };
        let mut rng = SplitMix64::new(1);
        let params = (0..config.num_params()).map(|_| 0.2 * rng.normal()).collect();
        Decoder { config, params, step: 0 }
    }

    fn opts(tokens: usize, top_k: Option<usize>, seed: u64) -> SampleOptions {
        SampleOptions { tokens, pick: Pick { temperature: 1.0, top_k }, seed }
    }

    #[test]
    fn generates_the_requested_bytes_deterministically() {
        let d = decoder(4);
        // Longer than the block: the context is cropped, not refused.
        let prompt = b"hello world";
        let a = d.generate(prompt, &opts(10, None, 5)).unwrap();
        assert_eq!(a.len(), 10);
        assert_eq!(a, d.generate(prompt, &opts(10, None, 5)).unwrap());
        assert_ne!(a, d.generate(prompt, &opts(10, None, 6)).unwrap());
        // Greedy decoding ignores the seed (SAMPLE-1).
        let g = d.generate(prompt, &opts(6, Some(1), 1)).unwrap();
        assert_eq!(g, d.generate(prompt, &opts(6, Some(1), 2)).unwrap());
        // An empty prompt is a newline.
        assert_eq!(
            d.generate(b"", &opts(6, Some(1), 0)).unwrap(),
            d.generate(b"\n", &opts(6, Some(1), 0)).unwrap()
        );
    }

    #[test]
    fn bad_options_name_the_flag() {
        let d = decoder(4);
        let err = |o: SampleOptions| d.generate(b"x", &o).unwrap_err().to_string();
        assert!(err(opts(0, None, 0)).contains("--tokens"));
        assert!(err(opts(1, Some(0), 0)).contains("--top-k"));
        for t in [0.0, -1.0, f32::NAN] {
            let o =
                SampleOptions { pick: Pick { temperature: t, top_k: None }, ..opts(1, None, 0) };
            assert!(err(o).contains("--temperature"));
        }
    }
}
