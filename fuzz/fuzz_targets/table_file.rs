//! Any bytes as a kept pool's block table (SPEC §15) as a new daemon reads it: no panic,
//! nothing adopted that names a slot outside the pool.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvd_daemon::fuzzing::table_file(data);
});
