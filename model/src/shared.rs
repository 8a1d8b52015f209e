//! KV cache memory another process can open: the buffers the daemon's GPU tier copies
//! blocks in and out of (SPEC §13), so an engine stores and loads through the daemon
//! instead of copying itself. The only unsafe code of the CPU side: one shared mapping.
//!
//! - CPU: a file in the host stand-in's directory (`gpu.host_dir`), mapped shared; the
//!   daemon reads and writes it with `pread`/`pwrite`, the kernels see it as `[f32]`.
//! - CUDA (`crate::cuda`): a `cuMemAlloc` allocation and its CUDA IPC handle.
//!
//! The file is removed when the buffer drops.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};

/// What another process needs to open one shared buffer: the GPU tier's region handle (a
/// CUDA IPC handle, or the file's name in the stand-in's directory) and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedRegion {
    /// The handle `gpu_register` takes.
    pub handle: Vec<u8>,
    /// Bytes.
    pub size: u64,
}

/// `len` f32s in a file, mapped shared.
pub struct SharedF32 {
    map: memmap2::MmapMut,
    len: usize,
    path: PathBuf,
}

impl std::fmt::Debug for SharedF32 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedF32({} f32 in {})", self.len, self.path.display())
    }
}

impl SharedF32 {
    /// A new zeroed file `dir/name` of `len` f32s (refused if it exists), mapped.
    pub fn create(dir: &Path, name: &str, len: usize) -> Result<(SharedF32, SharedRegion)> {
        ensure!(
            !name.contains('/') && !name.is_empty(),
            "a shared buffer's name is a file name, not {name:?}"
        );
        let path = dir.join(name);
        let bytes = len.checked_mul(4).context("shared buffer too large")?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let out = (|| -> Result<SharedF32> {
            file.set_len(bytes.max(1) as u64)?;
            // SAFETY: a file this call created (create_new), sized above and never
            // truncated while mapped. The daemon writes it only through GPU-tier copies,
            // which the engine runs while it reads none of those bytes (it waits for
            // each copy), as with the pool's shared mapping in the client.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .len(bytes.max(1))
                    .map_mut(&file)?
            };
            ensure!(
                bytemuck::try_cast_slice::<u8, f32>(&map[..bytes]).is_ok(),
                "the mapping is not f32-aligned"
            );
            Ok(SharedF32 {
                map,
                len,
                path: path.clone(),
            })
        })();
        match out {
            Ok(s) => Ok((
                s,
                SharedRegion {
                    handle: name.as_bytes().to_vec(),
                    size: bytes as u64,
                },
            )),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// The f32s.
    pub fn as_slice(&self) -> &[f32] {
        // Page-aligned (checked at creation) and `len * 4` bytes long.
        bytemuck::cast_slice(&self.map[..self.len * 4])
    }

    /// The f32s, writable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(&mut self.map[..self.len * 4])
    }
}

impl Drop for SharedF32 {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_buffer_is_its_file_and_goes_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, r) = SharedF32::create(dir.path(), "kv-0", 1000).unwrap();
        assert_eq!(
            r,
            SharedRegion {
                handle: b"kv-0".to_vec(),
                size: 4000
            }
        );
        s.as_mut_slice()[999] = 2.5;
        let bytes = std::fs::read(dir.path().join("kv-0")).unwrap();
        assert_eq!(&bytes[3996..], &2.5f32.to_ne_bytes());
        // Another process's write through the file is what the kernels see.
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("kv-0"))
            .unwrap();
        f.write_all_at(&7.0f32.to_ne_bytes(), 0).unwrap();
        assert_eq!(s.as_slice()[0], 7.0);
        assert!(
            SharedF32::create(dir.path(), "kv-0", 10).is_err(),
            "an existing file"
        );
        assert!(SharedF32::create(dir.path(), "../x", 10).is_err());
        drop(s);
        assert!(!dir.path().join("kv-0").exists());
    }
}
