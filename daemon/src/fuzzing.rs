//! Entry points for the fuzz targets (`fuzz/`), built only under `cfg(fuzzing)`: the
//! daemon's own decoders of untrusted bytes, which are not part of the protocol crate.

use std::sync::OnceLock;

use kvd_protocol::auth::ClusterKey;

fn key() -> &'static ClusterKey {
    static K: OnceLock<ClusterKey> = OnceLock::new();
    K.get_or_init(|| ClusterKey::from_secret(&[b'f'; 32]).expect("a 32-byte secret"))
}

/// A data-plane request as the server reads it: header, ranges, MAC trailer.
pub fn data_request(b: &[u8]) {
    let _ = crate::transfer::dataplane::parse_request(b, key());
}

/// One NVMe journal record as recovery reads it.
pub fn journal_record(b: &[u8]) {
    let _ = crate::nvme::parse_record(b);
}

/// Any bytes as the body of a kept pool's block table (after a valid header, so that the
/// layouts, out-bits and entries are read) as a new daemon opens it: no panic, and only
/// entries that pass their own check and name a slot inside the pool are adopted.
pub fn table_file(b: &[u8]) {
    use crate::table::{BlockTable, PoolIdentity};
    let dir = std::path::PathBuf::from(format!("/dev/shm/kvd-fuzz-table-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let pool = dir.join("p.pool");
    let table = dir.join("p.table");
    if !pool.exists() {
        let _ = std::fs::write(&pool, b"");
    }
    let Ok(id) = PoolIdentity::of(&pool, 4096 + 16 * 65536, 4096, 65536) else {
        return;
    };
    if BlockTable::open(&table, &id, false).is_err() {
        return;
    }
    let Ok(mut bytes) = std::fs::read(&table) else {
        return;
    };
    if !b.is_empty() {
        // the body from the input, repeated: layouts, out-bits, the first entries
        for (i, x) in bytes.iter_mut().enumerate().skip(4096) {
            *x = b[i % b.len()];
        }
    }
    if std::fs::write(&table, &bytes).is_err() {
        return;
    }
    if let Ok((_, Some(found), _)) = BlockTable::open(&table, &id, true) {
        for blk in found.blocks {
            assert!(blk.offset >= id.data_offset);
            assert!(blk.offset + u64::from(blk.len) <= id.size);
        }
    }
}
