//! Tokenizers: byte-level by default (token = byte, vocabulary 256), or a Hugging Face
//! `tokenizer.json` whose model is a plain vocabulary (`WordLevel`/`BPE` vocab read as
//! whole-word lookups is not attempted: only byte-level is built in; see
//! [`Tokenizer::from_file`]).

use anyhow::{bail, Result};

/// Turns text into tokens and back.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// One token per byte of UTF-8.
    Bytes,
}

impl Tokenizer {
    /// The vocabulary size the model must have at least.
    pub fn vocab(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
        }
    }

    /// Tokens of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Bytes => text.bytes().map(u32::from).collect(),
        }
    }

    /// The bytes of one token (tokens outside the byte range give none).
    pub fn token_bytes(&self, token: u32) -> Vec<u8> {
        match self {
            Tokenizer::Bytes => u8::try_from(token).map(|b| vec![b]).unwrap_or_default(),
        }
    }

    /// Text of `tokens` (invalid UTF-8 replaced).
    pub fn decode(&self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens.iter().flat_map(|&t| self.token_bytes(t)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// A tokenizer from a file: only the byte-level one is built in.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        bail!(
            "tokenizer file {}: only the byte-level tokenizer is built in",
            path.display()
        )
    }
}
