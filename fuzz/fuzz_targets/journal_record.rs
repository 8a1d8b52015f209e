//! Any bytes as an NVMe journal record (what recovery reads back from disk after a crash),
//! both as they come (nearly always refused by the record's CRC) and with a valid CRC over
//! their first 60 bytes, so that the fields behind the checksum are exercised too.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvd_daemon::fuzzing::journal_record(data);
    if data.len() >= 60 {
        let mut rec = [0u8; 64];
        rec[..60].copy_from_slice(&data[..60]);
        rec[..4].copy_from_slice(b"KVJ1");
        let crc = crc32c::crc32c(&rec[..60]);
        rec[60..].copy_from_slice(&crc.to_le_bytes());
        kvd_daemon::fuzzing::journal_record(&rec);
    }
});
