//! Framing of the local stream transport (SPEC §1.1): the same multipart messages as
//! over ZMQ (envelope frame, then payload frames), carried on a Unix stream socket for
//! engines on the daemon's node, which skips libzmq's I/O threads on both sides.
//!
//! ```text
//! message = frame_count: u32 LE  (1 ..= limits.max_frames)
//!           frame_count × ( length: u32 LE (≤ limits.max_frame_bytes), bytes[length] )
//! ```
//!
//! The sum of a message's frame lengths is at most `limits.max_message_bytes`. A receiver
//! that reads a message breaking a limit cannot find the next message boundary: it
//! closes the connection (SPEC §1.1). Sans-IO like the rest of the crate: [`decode`]
//! looks at the bytes received so far and says where the next message's frames are.

use std::ops::Range;

/// Bytes of the frame-count prefix and of each length prefix.
pub const PREFIX_BYTES: usize = 4;

/// What a receiver accepts in one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLimits {
    /// Most frames (envelope + payloads).
    pub max_frames: u32,
    /// Largest frame.
    pub max_frame_bytes: u32,
    /// Largest sum of the frames' lengths.
    pub max_message_bytes: u64,
}

/// A message that breaks the framing or a limit: the connection cannot go on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// `frame_count` is 0.
    #[error("a message has no frames")]
    NoFrames,
    /// Too many frames.
    #[error("{0} frames in one message (at most {1})")]
    TooManyFrames(u32, u32),
    /// One frame too large.
    #[error("a frame of {0} bytes (at most {1})")]
    FrameTooLarge(u32, u32),
    /// The whole message too large.
    #[error("a message of more than {0} bytes")]
    MessageTooLarge(u64),
}

/// Where the frames of one complete message lie in the receive buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Framed {
    /// Byte ranges of the frames, in order (the first is the envelope).
    pub frames: Vec<Range<usize>>,
    /// Bytes of the buffer the message takes, prefixes included.
    pub consumed: usize,
}

/// Reads a `u32` LE at `at`, when the buffer holds it.
fn u32_at(buf: &[u8], at: usize) -> Option<u32> {
    let b = buf.get(at..at.checked_add(PREFIX_BYTES)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Looks for one complete message at the start of `buf`.
///
/// `Ok(None)`: more bytes are needed (what is there so far breaks no limit);
/// `Ok(Some(f))`: a message, whose frames lie at `f.frames`; `Err`: the bytes break the
/// framing or a limit, whatever follows. Never reads past `buf` and never allocates
/// more than one range per frame the prefix announced within the limits.
pub fn decode(buf: &[u8], limits: &StreamLimits) -> Result<Option<Framed>, FrameError> {
    let Some(count) = u32_at(buf, 0) else {
        return Ok(None);
    };
    if count == 0 {
        return Err(FrameError::NoFrames);
    }
    if count > limits.max_frames {
        return Err(FrameError::TooManyFrames(count, limits.max_frames));
    }
    let mut at = PREFIX_BYTES;
    let mut total: u64 = 0;
    let mut frames = Vec::with_capacity(count.min(64) as usize);
    for _ in 0..count {
        let Some(len) = u32_at(buf, at) else {
            return Ok(None);
        };
        if len > limits.max_frame_bytes {
            return Err(FrameError::FrameTooLarge(len, limits.max_frame_bytes));
        }
        total += u64::from(len);
        if total > limits.max_message_bytes {
            return Err(FrameError::MessageTooLarge(limits.max_message_bytes));
        }
        let start = at + PREFIX_BYTES;
        let end = start + len as usize;
        if end > buf.len() {
            return Ok(None);
        }
        frames.push(start..end);
        at = end;
    }
    Ok(Some(Framed {
        frames,
        consumed: at,
    }))
}

/// Bytes the prefixes of a message of `frames` frames take.
pub fn prefix_bytes(frames: usize) -> usize {
    PREFIX_BYTES * (frames + 1)
}

/// A frame count or a frame length as its prefix, `None` above `u32::MAX`.
pub fn prefix(n: usize) -> Option<[u8; PREFIX_BYTES]> {
    u32::try_from(n).ok().map(u32::to_le_bytes)
}

/// Appends one whole message to `out`. Returns `false` (and appends nothing) when a
/// count or length does not fit in 32 bits.
pub fn encode(frames: &[&[u8]], out: &mut Vec<u8>) -> bool {
    let Some(count) = prefix(frames.len()) else {
        return false;
    };
    if frames.iter().any(|f| prefix(f.len()).is_none()) {
        return false;
    }
    out.reserve(prefix_bytes(frames.len()) + frames.iter().map(|f| f.len()).sum::<usize>());
    out.extend_from_slice(&count);
    for f in frames {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    true
}

/// Bytes a receive buffer reads at least per call, and its size when idle.
pub const RECV_CHUNK: usize = 64 << 10;

/// A connection's receive side, sans-IO: the caller reads the socket into [`room`],
/// reports how much came with [`filled`], and takes whole messages out with [`next`].
/// Both ends of the stream transport use it.
///
/// [`room`]: RecvBuffer::room
/// [`filled`]: RecvBuffer::filled
/// [`next`]: RecvBuffer::next
#[derive(Debug)]
pub struct RecvBuffer {
    /// `buf[start..end]` is received and not yet taken.
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Default for RecvBuffer {
    fn default() -> Self {
        RecvBuffer {
            buf: vec![0; RECV_CHUNK],
            start: 0,
            end: 0,
        }
    }
}

impl RecvBuffer {
    /// Bytes received and not yet taken (a partial message when non-zero after `next`
    /// returned `Ok(None)`).
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// The next whole message's frames, copied out (`Ok(None)`: not all here yet).
    pub fn next(&mut self, limits: &StreamLimits) -> Result<Option<Vec<Vec<u8>>>, FrameError> {
        let pending = self.buf.get(self.start..self.end).unwrap_or_default();
        let Some(f) = decode(pending, limits)? else {
            return Ok(None);
        };
        let frames = f
            .frames
            .iter()
            .map(|r| pending.get(r.clone()).unwrap_or_default().to_vec())
            .collect();
        self.start += f.consumed;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(Some(frames))
    }

    /// Where the next read goes: at least [`RECV_CHUNK`] bytes, unless the buffer would
    /// pass `cap` (then what is left below it, possibly nothing). Keeps what is pending,
    /// moving it to the front when that makes room, and shrinks back to [`RECV_CHUNK`]
    /// when empty after a large message.
    pub fn room(&mut self, cap: usize) -> &mut [u8] {
        if self.start > 0 && (self.start == self.end || self.buf.len() - self.end < RECV_CHUNK) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == 0 && self.buf.len() > 16 * RECV_CHUNK {
            self.buf = vec![0; RECV_CHUNK];
        }
        if self.buf.len() - self.end < RECV_CHUNK {
            let want = (self.buf.len() * 2).max(self.end + RECV_CHUNK).min(cap);
            if want > self.buf.len() {
                self.buf.resize(want, 0);
            }
        }
        self.buf.get_mut(self.end..).unwrap_or_default()
    }

    /// `n` bytes were read into [`RecvBuffer::room`].
    pub fn filled(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }
}

/// The one-frame message the daemon writes first on every accepted connection: which
/// daemon this is. A client compares `incarnation` with its `hello`'s and uses the
/// connection only when they match (a socket path that leads to another daemon, or to
/// one restarted since, is never used).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Greeting {
    /// Protocol version, 1.
    pub v: u32,
    /// The daemon's incarnation (as in `hello`).
    pub incarnation: crate::Incarnation,
}

impl Greeting {
    /// The greeting's frame (a msgpack map).
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).expect("msgpack encoding of a plain struct is infallible")
    }

    /// Reads a greeting frame; `None` when it is not one.
    pub fn decode(frame: &[u8]) -> Option<Greeting> {
        crate::strict::from_slice::<Greeting>(frame)
            .ok()
            .filter(|g| g.v == crate::PROTOCOL_VERSION)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIM: StreamLimits = StreamLimits {
        max_frames: 4,
        max_frame_bytes: 100,
        max_message_bytes: 150,
    };

    #[test]
    fn round_trip_and_byte_by_byte_arrival() {
        let mut buf = Vec::new();
        assert!(encode(&[b"env", b"", b"payload"], &mut buf));
        assert!(encode(&[b"second"], &mut buf));
        for cut in 0..25 {
            assert_eq!(decode(&buf[..cut], &LIM), Ok(None), "cut at {cut}");
        }
        let f = decode(&buf, &LIM).unwrap().unwrap();
        let got: Vec<&[u8]> = f.frames.iter().map(|r| &buf[r.clone()]).collect();
        assert_eq!(got, vec![&b"env"[..], b"", b"payload"]);
        let rest = &buf[f.consumed..];
        let g = decode(rest, &LIM).unwrap().unwrap();
        assert_eq!(&rest[g.frames[0].clone()], b"second");
        assert_eq!(g.consumed, rest.len());
    }

    #[test]
    fn recv_buffer_hands_out_whole_messages_whatever_the_reads() {
        let mut wire = Vec::new();
        let big = vec![5u8; 20 * RECV_CHUNK];
        for i in 0..20u8 {
            assert!(encode(
                &[&[i], if i % 7 == 0 { &big } else { b"x" }],
                &mut wire
            ));
        }
        let lim = StreamLimits {
            max_frames: 2,
            max_frame_bytes: u32::MAX,
            max_message_bytes: u64::MAX,
        };
        let mut r = RecvBuffer::default();
        let mut got = Vec::new();
        let mut at = 0;
        for step in [1usize, 3, 1000, 70_000, 5, 200_000].iter().cycle() {
            while let Some(m) = r.next(&lim).unwrap() {
                got.push(m);
            }
            if at == wire.len() {
                break;
            }
            let room = r.room(usize::MAX);
            let n = (*step).min(room.len()).min(wire.len() - at);
            room[..n].copy_from_slice(&wire[at..at + n]);
            r.filled(n);
            at += n;
        }
        assert_eq!(got.len(), 20);
        for (i, m) in got.iter().enumerate() {
            assert_eq!(m[0], vec![i as u8]);
            assert_eq!(m[1].len(), if i % 7 == 0 { big.len() } else { 1 });
        }
        assert!(
            r.buf.len() > 16 * RECV_CHUNK,
            "it grew for the large messages"
        );
        assert_eq!(
            r.room(usize::MAX).len(),
            RECV_CHUNK,
            "and shrinks back once empty"
        );
        // The cap bounds the buffer: at the cap there is no room.
        let mut r = RecvBuffer::default();
        let n = r.room(RECV_CHUNK).len();
        r.filled(n);
        assert!(r.room(RECV_CHUNK).is_empty());
    }

    #[test]
    fn spec_vector() {
        // SPEC §9: ["\x81\xa1v\x01", "ab"] frames as these bytes.
        let mut buf = Vec::new();
        assert!(encode(&[&[0x81, 0xa1, 0x76, 0x01], b"ab"], &mut buf));
        assert_eq!(hex_of(&buf), "020000000400000081a17601020000006162");
    }

    #[test]
    fn limits_are_errors_as_soon_as_the_prefix_shows_them() {
        assert_eq!(decode(&0u32.to_le_bytes(), &LIM), Err(FrameError::NoFrames));
        assert_eq!(
            decode(&5u32.to_le_bytes(), &LIM),
            Err(FrameError::TooManyFrames(5, 4))
        );
        let mut b = 1u32.to_le_bytes().to_vec();
        b.extend_from_slice(&101u32.to_le_bytes());
        assert_eq!(decode(&b, &LIM), Err(FrameError::FrameTooLarge(101, 100)));
        let mut b = 2u32.to_le_bytes().to_vec();
        b.extend_from_slice(&100u32.to_le_bytes());
        b.extend_from_slice(&[0; 100]);
        b.extend_from_slice(&51u32.to_le_bytes());
        assert_eq!(decode(&b, &LIM), Err(FrameError::MessageTooLarge(150)));
        // A huge announced length is refused without waiting for (or allocating) it.
        let mut b = 1u32.to_le_bytes().to_vec();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&b, &LIM).is_err());
    }

    #[test]
    fn greeting_round_trip() {
        let g = Greeting {
            v: 1,
            incarnation: crate::Incarnation(0x0102030405060708),
        };
        // SPEC §9: {"v": 1, "incarnation": 0x0102030405060708}
        assert_eq!(
            hex_of(&g.encode()),
            "82a17601ab696e6361726e6174696f6ecf0102030405060708"
        );
        assert_eq!(Greeting::decode(&g.encode()), Some(g));
        assert_eq!(Greeting::decode(b"\x90"), None);
    }

    fn hex_of(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}
