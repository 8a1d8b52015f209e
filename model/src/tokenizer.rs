//! Tokenizers: byte-level by default (token = byte, vocabulary 256), or a Hugging Face
//! `tokenizer.json` (through the `tokenizers` crate, pure-Rust regex backend).

use std::path::Path;

use anyhow::{anyhow, Result};

/// Turns text into tokens and back.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// One token per byte of UTF-8.
    Bytes,
    /// A Hugging Face `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("tokenizer {}: {e}", path.display()))?;
        Ok(Tokenizer::Hf(Box::new(t)))
    }

    /// The vocabulary size the model must have at least.
    pub fn vocab(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// Tokens of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Hf(t) => Ok(t
                .encode(text, false)
                .map_err(|e| anyhow!("tokenizing: {e}"))?
                .get_ids()
                .to_vec()),
        }
    }

    /// Text of `tokens` (invalid UTF-8 replaced; special tokens kept).
    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Tokenizer::Bytes => String::from_utf8_lossy(
                &tokens
                    .iter()
                    .filter_map(|&t| u8::try_from(t).ok())
                    .collect::<Vec<u8>>(),
            )
            .into_owned(),
            Tokenizer::Hf(t) => t.decode(tokens, false).unwrap_or_default(),
        }
    }
}
