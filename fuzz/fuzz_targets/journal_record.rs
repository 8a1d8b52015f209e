//! Any bytes as an NVMe journal record (what recovery reads back from disk after a crash).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvd_daemon::fuzzing::journal_record(data);
});
