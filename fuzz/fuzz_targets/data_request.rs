//! Any bytes as a data-plane request head (header, ranges, MAC trailer), parsed as the
//! daemon's data server parses what arrives on its TCP port.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvd_daemon::fuzzing::data_request(data);
});
