//! The NVMe tier's fault hook (issue 47): a faulty device where the kernel offers none.
//!
//! `kvd-bench integrity` injects disk faults where device-mapper's `error` and `flakey`
//! targets are not available (the VMs this project is built on have no device-mapper):
//! with `KVD_NVME_FAULTS` set, the `kvd-uring` thread changes what the kernel answered
//! as a faulty device would have, before anything else sees it:
//!
//! | key | what a completion becomes, with that probability |
//! |---|---|
//! | `write_error` | a write fails with `EIO` |
//! | `short_write` | a write moved half its bytes |
//! | `read_error` | a read fails with `EIO` |
//! | `read_corrupt` | a read succeeded, and one bit of the bytes it put in the slot is flipped |
//!
//! e.g. `KVD_NVME_FAULTS=write_error=0.05,short_write=0.02,read_error=0.02,read_corrupt=0.05,seed=7`.
//! The daemon says so in a warning at start. For tests and benches only: a daemon that
//! has it set loses or refuses what it says it does, never serves a wrong byte (a
//! corrupted read fails the block's checksum and is dropped, SPEC §17).

use crate::uring::{IoKind, IoOp};
use kvd_store::pool::Pool;

/// A `$KVD_NVME_FAULTS` that asks for nothing this module injects.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FaultsError {
    /// A part that is not `key=value`.
    #[error("KVD_NVME_FAULTS: {0:?} is not key=value")]
    NotKeyValue(String),
    /// A seed that is not a number.
    #[error("KVD_NVME_FAULTS: seed {0:?} is not a number")]
    Seed(String),
    /// A fault whose value is not a probability.
    #[error("KVD_NVME_FAULTS: {key} = {value:?} is not a probability")]
    Probability {
        /// The fault.
        key: String,
        /// What was given.
        value: String,
    },
    /// A fault this module does not know.
    #[error("KVD_NVME_FAULTS: unknown fault {0:?}")]
    Unknown(String),
}

/// See the module docs.
#[derive(Debug)]
pub struct Faults {
    write_error: f64,
    short_write: f64,
    read_error: f64,
    read_corrupt: f64,
    rng: u64,
}

impl Faults {
    /// The faults `$KVD_NVME_FAULTS` asks for, if it is set (unknown keys and bad values
    /// are refused: a typo must not silently test nothing).
    pub fn from_env() -> Result<Option<Faults>, FaultsError> {
        let Ok(spec) = std::env::var("KVD_NVME_FAULTS") else {
            return Ok(None);
        };
        let mut f = Faults {
            write_error: 0.0,
            short_write: 0.0,
            read_error: 0.0,
            read_corrupt: 0.0,
            rng: 1,
        };
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| FaultsError::NotKeyValue(part.to_owned()))?;
            if k == "seed" {
                f.rng = v.parse().map_err(|_| FaultsError::Seed(v.to_owned()))?;
                continue;
            }
            let p: f64 = v
                .parse()
                .ok()
                .filter(|p: &f64| (0.0..=1.0).contains(p))
                .ok_or_else(|| FaultsError::Probability {
                    key: k.to_owned(),
                    value: v.to_owned(),
                })?;
            match k {
                "write_error" => f.write_error = p,
                "short_write" => f.short_write = p,
                "read_error" => f.read_error = p,
                "read_corrupt" => f.read_corrupt = p,
                _ => return Err(FaultsError::Unknown(k.to_owned())),
            }
        }
        Ok(Some(f))
    }

    /// SplitMix64, uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The kernel's result `res` of `op` as the faulty device answers it; a corrupted
    /// read also flips one bit of the slot it filled in `pool`.
    pub fn apply(&mut self, op: &IoOp, res: i32, pool: &Pool) -> i32 {
        const EIO: i32 = 5;
        if res < 0 || res as u32 != op.len {
            return res; // a real failure stays as it is
        }
        match op.kind {
            IoKind::Write if self.uniform() < self.write_error => -EIO,
            IoKind::Write if self.uniform() < self.short_write => res / 2,
            IoKind::Read if self.uniform() < self.read_error => -EIO,
            IoKind::Read if op.crc_len > 0 && self.uniform() < self.read_corrupt => {
                let at = op.pool_offset + (self.uniform() * f64::from(op.crc_len)) as u64;
                let bit = 1u8 << ((self.uniform() * 8.0) as u32 & 7);
                if let Ok(b) = pool.read(at, 1).map(|b| b.first().copied().unwrap_or(0)) {
                    let _ = pool.write(at, &[b ^ bit]);
                }
                res
            }
            _ => res,
        }
    }
}
