//! Any bytes as a peer message's envelope and auth frame: checking it never panics, and a
//! frame that opens was made with the key over exactly that envelope.
#![no_main]
use kvd_protocol::auth::{stamp_of, trim_secret, ClusterKey, Receiver};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = ClusterKey::from_secret(&[b'k'; 32]).expect("32-byte secret");
    let cut = data.first().map_or(0, |&b| b as usize).min(data.len());
    let (env, auth) = data.split_at(cut);
    let _ = stamp_of(auth);
    let me = Receiver("tcp://10.0.0.5:7101".into());
    if let Ok(stamp) = key.open_request(&me, env, auth) {
        assert_eq!(&key.seal_request(stamp, &me.0, env)[..], auth);
    }
    let _ = key.open_data(&me, env, auth);
    let _ = ClusterKey::from_secret(data);
    // the trimmed secret is a slice of the input with no white space at either end
    let t = trim_secret(data);
    let ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n');
    assert!(t.first().is_none_or(|b| !ws(b)) && t.last().is_none_or(|b| !ws(b)));
});
