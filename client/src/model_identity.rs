//! The identity of a model's weights (SPEC §3.1, "Model identity"): what an engine puts in
//! its layout's `model` field so that two engines share KV blocks exactly when they run
//! the same weights, wherever the checkpoint sits.
//!
//! A local path is the wrong identity both ways: two paths to one checkpoint (a copy, a
//! bind mount, another cache directory) never share, and one path whose weights were
//! replaced in place would serve KV computed by the old weights. The identity is a digest
//! of what determines the KV instead: the model's `config.json` and its weight files —
//! each file's name and size, a safetensors file's whole header (every tensor's name,
//! dtype, shape and offsets), and 64 samples of 4 KiB spread over the file's data. Any
//! retrained or fine-tuned checkpoint changes every tensor, so it changes the samples;
//! an edit of a few bytes between samples is not seen (name such weights with an
//! explicit model id).
//!
//! Cost: a few hundred KiB read per weight file (its header and samples), whatever the
//! file's size. Measured on a 4 GiB safetensors file on this project's 2-core VM: 9.3 ms
//! with the page cache dropped, 0.3 ms warm (the Python package's `kvd.model_identity`,
//! which calls this; the connectors log the time at start).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use blake2::digest::consts::U16;
use blake2::{Blake2b, Digest};

/// The prefix of every identity this version computes.
pub const MODEL_ID_PREFIX: &str = "kvd-model-v1:";

const LABEL: &[u8] = b"kvd.model.v1\0";
const SAMPLES: u64 = 64;
const SAMPLE_BYTES: u64 = 4096;
/// Bytes hashed whole at the start of a weight file that is not safetensors.
const HEAD_BYTES: u64 = 64 * 1024;
/// Largest `config.json` or safetensors header read whole.
const MAX_META_BYTES: u64 = 100 << 20;
/// File name endings of weight files.
const WEIGHTS: [&str; 5] = [".safetensors", ".bin", ".pt", ".pth", ".gguf"];

/// The identity of the checkpoint at `path`: a directory (its `config.json`, if any, and
/// every weight file directly in it, in file-name byte order) or one weight file. An
/// error when there is no weight file to digest, or a file cannot be read.
pub fn model_identity(path: &Path) -> io::Result<String> {
    let files = checkpoint_files(path)?;
    if !files.iter().any(|(name, _)| is_weights(name)) {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "{}: no weight file ({}) to digest",
                path.display(),
                WEIGHTS.join(", ")
            ),
        ));
    }
    let single = files.len() == 1 && !std::fs::metadata(path)?.is_dir();
    let mut h = Blake2b::<U16>::new();
    h.update(LABEL);
    for (name, p) in &files {
        // One file given alone is named by nothing but its kind: a copy under another
        // name is the same checkpoint.
        let hashed = if single { "" } else { name.as_str() };
        digest_file(&mut h, hashed, name, p)?;
    }
    Ok(format!("{MODEL_ID_PREFIX}{}", hex(&h.finalize())))
}

fn is_weights(name: &str) -> bool {
    WEIGHTS.iter().any(|w| name.ends_with(w))
}

/// `(file name, path)` of the files the identity covers, sorted by name.
fn checkpoint_files(path: &Path) -> io::Result<Vec<(String, PathBuf)>> {
    let name_of = |p: &Path| -> io::Result<String> {
        p.file_name()
            .and_then(|n| n.to_str())
            .map(str::to_string)
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "a file name that is not UTF-8")
            })
    };
    if !std::fs::metadata(path)?.is_dir() {
        return Ok(vec![(name_of(path)?, path.to_path_buf())]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path)? {
        let p = entry?.path();
        let Ok(name) = name_of(&p) else { continue };
        if (name == "config.json" || is_weights(&name)) && std::fs::metadata(&p)?.is_file() {
            files.push((name, p));
        }
    }
    files.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    Ok(files)
}

/// Digests one file under the name `hashed`; `name` (its real name) says its kind.
fn digest_file(h: &mut Blake2b<U16>, hashed: &str, name: &str, path: &Path) -> io::Result<()> {
    let mut f = File::open(path)?;
    let size = f.metadata()?.len();
    h.update((hashed.len() as u32).to_le_bytes());
    h.update(hashed.as_bytes());
    h.update(size.to_le_bytes());
    let too_big = |what: &str, n: u64| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: {what} of {n} bytes (at most {MAX_META_BYTES})",
                path.display()
            ),
        )
    };
    if name == "config.json" {
        if size > MAX_META_BYTES {
            return Err(too_big("a config", size));
        }
        h.update(read_at(&mut f, 0, size)?);
        return Ok(());
    }
    let data_start = if name.ends_with(".safetensors") {
        let len_bytes = read_at(&mut f, 0, 8.min(size))?;
        let header_len = match <[u8; 8]>::try_from(&len_bytes[..]) {
            Ok(b) => u64::from_le_bytes(b),
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: not a safetensors file", path.display()),
                ))
            }
        };
        if header_len > MAX_META_BYTES || header_len > size - 8 {
            return Err(too_big("a safetensors header", header_len));
        }
        h.update(&len_bytes);
        h.update(read_at(&mut f, 8, header_len)?);
        8 + header_len
    } else {
        let head = HEAD_BYTES.min(size);
        h.update(read_at(&mut f, 0, head)?);
        head
    };
    for (off, len) in samples(data_start, size) {
        h.update(read_at(&mut f, off, len)?);
    }
    Ok(())
}

/// The sampled ranges of `[start, end)`: all of it when it holds at most 64 samples,
/// else 64 ranges of 4 KiB, the first at `start`, the last ending at `end`, evenly spaced.
fn samples(start: u64, end: u64) -> Vec<(u64, u64)> {
    let span = end.saturating_sub(start);
    if span <= SAMPLES * SAMPLE_BYTES {
        return if span == 0 {
            Vec::new()
        } else {
            vec![(start, span)]
        };
    }
    let room = span - SAMPLE_BYTES;
    (0..SAMPLES)
        .map(|i| (start + i * room / (SAMPLES - 1), SAMPLE_BYTES))
        .collect()
}

fn read_at(f: &mut File, off: u64, len: u64) -> io::Result<Vec<u8>> {
    f.seek(SeekFrom::Start(off))?;
    let mut buf = vec![0u8; usize::try_from(len).map_err(io::Error::other)?];
    f.read_exact(&mut buf)?;
    Ok(buf)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny safetensors file: one F32 tensor `w` of `n` values from `seed`.
    fn safetensors(n: usize, seed: u32) -> Vec<u8> {
        let header = format!(
            "{{\"w\":{{\"dtype\":\"F32\",\"shape\":[{n}],\"data_offsets\":[0,{}]}}}}",
            n * 4
        );
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        for i in 0..n as u32 {
            b.extend_from_slice(&(i.wrapping_mul(2654435761) ^ seed).to_le_bytes());
        }
        b
    }

    fn checkpoint(dir: &Path, weights: &[u8]) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), br#"{"model_type": "llama"}"#).unwrap();
        std::fs::write(dir.join("model.safetensors"), weights).unwrap();
        std::fs::write(dir.join("README.md"), b"not part of the identity").unwrap();
    }

    #[test]
    fn two_paths_to_one_checkpoint_share_and_changed_weights_do_not() {
        let d = tempfile::tempdir().unwrap();
        let w = safetensors(100_000, 7); // 400 KB: sampled
        checkpoint(&d.path().join("a"), &w);
        checkpoint(&d.path().join("b/c"), &w);
        let a = model_identity(&d.path().join("a")).unwrap();
        assert!(
            a.starts_with(MODEL_ID_PREFIX) && a.len() == MODEL_ID_PREFIX.len() + 32,
            "{a}"
        );
        assert_eq!(a, model_identity(&d.path().join("b/c")).unwrap());
        std::os::unix::fs::symlink(d.path().join("a"), d.path().join("link")).unwrap();
        assert_eq!(a, model_identity(&d.path().join("link")).unwrap());
        // other files beside it change nothing
        std::fs::write(d.path().join("a/tokenizer.json"), b"{}").unwrap();
        assert_eq!(a, model_identity(&d.path().join("a")).unwrap());
        // retrained weights of the same shapes, in place
        checkpoint(&d.path().join("a"), &safetensors(100_000, 8));
        assert_ne!(a, model_identity(&d.path().join("a")).unwrap());
        // another config
        checkpoint(&d.path().join("e"), &w);
        std::fs::write(
            d.path().join("e/config.json"),
            br#"{"model_type": "llama", "rope_theta": 1e6}"#,
        )
        .unwrap();
        assert_ne!(a, model_identity(&d.path().join("e")).unwrap());
        // one weight file alone is a checkpoint too (no config), whatever its name
        let single = model_identity(&d.path().join("b/c/model.safetensors")).unwrap();
        assert_ne!(single, a);
        std::fs::write(d.path().join("renamed.safetensors"), &w).unwrap();
        assert_eq!(
            single,
            model_identity(&d.path().join("renamed.safetensors")).unwrap()
        );
    }

    #[test]
    fn a_checkpoint_without_weights_or_with_a_bad_header_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("config.json"), b"{}").unwrap();
        let e = model_identity(d.path()).unwrap_err();
        assert!(e.to_string().contains("no weight file"), "{e}");
        std::fs::write(d.path().join("x.safetensors"), u64::MAX.to_le_bytes()).unwrap();
        assert!(model_identity(d.path()).is_err());
        std::fs::write(d.path().join("x.safetensors"), b"abc").unwrap();
        assert!(model_identity(d.path()).is_err());
        assert!(model_identity(&d.path().join("absent")).is_err());
    }

    #[test]
    fn samples_cover_small_regions_whole_and_span_large_ones() {
        assert_eq!(samples(10, 10), vec![]);
        assert_eq!(samples(8, 8 + 100), vec![(8, 100)]);
        let s = samples(100, 100 + 1_000_000);
        assert_eq!(s.len(), 64);
        assert_eq!(s[0], (100, 4096));
        assert_eq!(s[63].0 + s[63].1, 100 + 1_000_000);
    }

    /// SPEC §3.1 vector: `config.json` = `{"model_type": "llama"}` and `model.safetensors`
    /// = [`safetensors`]`(100_000, 7)`, computed here and independently in Python
    /// (`hashlib.blake2b(digest_size=16)`) from the SPEC's text.
    #[test]
    fn spec_vector() {
        let d = tempfile::tempdir().unwrap();
        checkpoint(d.path(), &safetensors(100_000, 7));
        assert_eq!(model_identity(d.path()).unwrap(), SPEC_VECTOR);
    }

    const SPEC_VECTOR: &str = "kvd-model-v1:598dc877a1d39c9fe03a8e9d16f5012d";
}
