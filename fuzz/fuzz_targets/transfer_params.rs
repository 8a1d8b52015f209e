//! Any bytes as `kv_transfer_params` (what routers and engines carry opaquely).
#![no_main]
use kvd_protocol::TransferParams;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = TransferParams::from_msgpack(data) {
        let back = TransferParams::from_msgpack(&p.to_msgpack()).expect("round trip");
        assert_eq!(back, p);
        let _ =
            kvd_protocol::transfer_tag(&p.transfer_id, &p.keys, p.offsets.iter().map(|&o| Some(o)));
    }
});
