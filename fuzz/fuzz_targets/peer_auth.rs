//! Any bytes as a peer message's envelope and auth frame: checking it never panics, and a
//! frame that opens was made with the key over exactly that envelope.
#![no_main]
use kvd_protocol::auth::{stamp_of, ClusterKey};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = ClusterKey::from_secret(&[b'k'; 32]).expect("32-byte secret");
    let cut = data.first().map_or(0, |&b| b as usize).min(data.len());
    let (env, auth) = data.split_at(cut);
    let _ = stamp_of(auth);
    if let Ok(stamp) = key.open_request(env, auth) {
        assert_eq!(&key.seal_request(stamp, env)[..], auth);
    }
    let _ = key.open_data(env, auth);
    let _ = ClusterKey::from_secret(data);
});
