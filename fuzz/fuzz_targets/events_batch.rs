//! Any bytes as a KV event batch payload (SPEC §14), decoded as `kvd ctl events` and a
//! router decode what a publisher sends; what decodes re-encodes to the same events.
#![no_main]
use kvd_protocol::events::{decode_batch, encode_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(b) = decode_batch(data) {
        let again = decode_batch(&encode_batch(b.ts, &b.events)).expect("round trip");
        assert_eq!(again.events, b.events);
    }
});
