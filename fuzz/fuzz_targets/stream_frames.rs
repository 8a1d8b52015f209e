//! Any bytes as the start of a stream-transport connection (SPEC §1.1), under small
//! limits taken from the input: the decoder never reads past the buffer, never yields
//! more frames or bytes than the limits allow, and what it yields re-encodes to exactly
//! the bytes it consumed. Then the greeting decoder on the same bytes.
#![no_main]
use kvd_protocol::stream::{decode, encode, Greeting, StreamLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&[a, b, c], rest)) = data.split_first_chunk::<3>() else {
        return;
    };
    let limits = StreamLimits {
        max_frames: u32::from(a % 16) + 1,
        max_frame_bytes: u32::from(b) * 16,
        max_message_bytes: u64::from(c) * 64,
    };
    let mut buf = rest;
    while let Ok(Some(f)) = decode(buf, &limits) {
        assert!(f.consumed <= buf.len());
        assert!(!f.frames.is_empty() && f.frames.len() <= limits.max_frames as usize);
        let frames: Vec<&[u8]> = f.frames.iter().map(|r| &buf[r.clone()]).collect();
        assert!(frames.iter().all(|x| x.len() <= limits.max_frame_bytes as usize));
        assert!(frames.iter().map(|x| x.len() as u64).sum::<u64>() <= limits.max_message_bytes);
        let mut again = Vec::new();
        assert!(encode(&frames, &mut again));
        assert_eq!(&again[..], &buf[..f.consumed]);
        buf = &buf[f.consumed..];
        if f.consumed == 0 {
            break;
        }
    }
    let _ = Greeting::decode(rest);
});
