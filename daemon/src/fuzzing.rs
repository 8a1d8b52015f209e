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
