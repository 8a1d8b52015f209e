//! Any bytes as a request envelope (the daemon's first decoder of every client and peer
//! message) and as a reply (what clients and peer links decode): never a panic, never an
//! allocation beyond the frame.
#![no_main]
use kvd_protocol::{codec, decode_reply, decode_request, PeerAck, StatsResp};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((_, req)) = decode_request(data, 4 << 20) {
        // a decoded request re-encodes and decodes to itself
        let again = codec::encode_request(7, &req);
        let (id, back) = decode_request(&again, usize::MAX).expect("re-encoded request decodes");
        assert_eq!(id, 7);
        assert_eq!(back, req);
    }
    let _ = codec::salvage_id(data);
    let _ = codec::reply_id(data);
    let _ = decode_reply::<PeerAck>(data);
    let _ = decode_reply::<StatsResp>(data);
});
