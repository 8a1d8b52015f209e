//! The TCP data plane's wire format (SPEC §10, "Data plane (TCP)"), sans I/O: request
//! headers, the ranges and MAC trailer after them, response statuses, padding and CRC
//! tables. The daemon's data server and TCP transport read and write sockets with these;
//! the fuzz target and the tests build requests with them.
//!
//! ```text
//! request  = "KVDX" u8:version(3, or 4 for a checked write) u8:op(1 read, 2 write) u16:flags u64:handle u64:token
//!            u64:src_incarnation u64:dst_incarnation u32:nranges u32:0      (48 bytes)
//!            nranges × (u64:offset u64:len)   -- offsets in the server's pool
//!            u64:unix_ms u64:nonce [32]u8:mac -- MAC over all of the above (SPEC §10.1)
//!            pad
//!            [write: the ranges' bytes, in order;
//!             crc flag (version 4): nranges × u32:crc32c pad]
//! response = u8:status(0 ok, 1 error) [3]u8:0 u32:msg_len [56]u8:0      (64 bytes)
//!            [error: msg ("code: text") pad]
//!            [read and ok: the ranges' bytes, in order;
//!             crc flag: nranges × u32:crc32c pad]
//! ```
//!
//! Everything around the block bytes is a multiple of [`ALIGN`] so that the bytes keep
//! the alignment they have in the pool all the way into the kernel's socket buffers: the
//! kernel copies a stream whose payload sits 8 bytes off a cache line about half as fast
//! (measured on this project's VMs: one stream 1.2-1.5 GB/s misaligned, 2.6-2.8 aligned).

use crate::auth::DATA_TRAILER_BYTES;
use crate::{ErrorCode, WireError};

/// A request's first bytes.
pub const MAGIC: &[u8; 4] = b"KVDX";
/// 4: a write may carry the CRC table too (flag crc); 3: every part around the block
/// bytes padded to [`ALIGN`], the CRCs of a checked read in one table after the bytes;
/// 2: requests end with the MAC trailer (SPEC §10.1); version 1 had none. A request is
/// sent with the lowest version that has what it uses ([`DataHeader::version`]), so a
/// version-3 server still serves this daemon's reads and unchecked writes, and refuses
/// its checked writes instead of misreading their table.
pub const VERSION: u8 = 4;
/// The oldest version a server accepts.
pub const OLDEST_VERSION: u8 = 3;
/// Requests, statuses, messages and CRC tables are padded to multiples of this, so block
/// bytes stay cache-line aligned in the byte stream.
pub const ALIGN: usize = 64;
/// A response's status, padded.
pub const STATUS_BYTES: usize = ALIGN;
/// The longest refusal message a reader accepts.
pub const MAX_STATUS_MSG: usize = 4096;
/// A request header's length.
pub const HEADER_BYTES: usize = 48;
/// Most ranges in one data-plane request.
pub const MAX_RANGES: u32 = 65_536;
/// Request flag: after the ranges' bytes, the sender appends a table of their CRC-32Cs
/// (u32 LE each, padded), which the receiver checks: the server for a write (version 4),
/// the requester for a read's answer.
pub const FLAG_CRC: u16 = 1;

/// What a request asks for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DataOp {
    /// The server's bytes to the requester.
    Read = 1,
    /// The requester's bytes into the server's pool.
    Write = 2,
}

/// Zero bytes that bring `len` to a multiple of [`ALIGN`].
pub fn pad_for(len: usize) -> usize {
    (ALIGN - len % ALIGN) % ALIGN
}

/// A CRC table (a checked read's answer, a checked write's end): one CRC-32C per range, u32 LE, padded.
pub fn crc_table(crcs: &[u32]) -> Vec<u8> {
    let mut t: Vec<u8> = crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
    t.resize(t.len() + pad_for(t.len()), 0);
    t
}

/// The `n` CRCs of a CRC table (`table`: `n` × u32 LE and its padding), refused when
/// the padding is not zeros or the table is short.
pub fn parse_crc_table(table: &[u8], n: usize) -> Result<Vec<u32>, WireError> {
    let (crcs, pad) = table
        .split_at_checked(n.saturating_mul(4))
        .ok_or_else(|| WireError::new(ErrorCode::Malformed, "short CRC table"))?;
    if pad.iter().any(|&b| b != 0) {
        return Err(WireError::new(
            ErrorCode::Malformed,
            "malformed CRC table (padding is not zeros)",
        ));
    }
    Ok(crcs
        .chunks_exact(4)
        .map(|c| {
            <[u8; 4]>::try_from(c)
                .map(u32::from_le_bytes)
                .unwrap_or_default()
        })
        .collect())
}

/// A request header.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DataHeader {
    /// 1 read, 2 write ([`DataOp`]); any other byte is refused by [`check_header`].
    pub op: u8,
    /// [`FLAG_CRC`] or 0.
    pub flags: u16,
    /// The grant's handle on the server.
    pub handle: u64,
    /// The grant's token (XOR the transfer tag).
    pub token: u64,
    /// The requester's incarnation.
    pub src_inc: u64,
    /// The server's incarnation, as the requester knows it.
    pub dst_inc: u64,
    /// Ranges that follow.
    pub nranges: u32,
}

impl DataHeader {
    /// The version this request is sent with: 4 for a checked write, else 3.
    pub fn version(&self) -> u8 {
        if self.op == DataOp::Write as u8 && self.flags & FLAG_CRC != 0 {
            VERSION
        } else {
            OLDEST_VERSION
        }
    }

    /// The header then `ranges` (`(offset in the server's pool, len)`) into `out`
    /// (cleared first): what the MAC trailer covers.
    pub fn encode(&self, ranges: impl IntoIterator<Item = (u64, u64)>, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(MAGIC);
        out.push(self.version());
        out.push(self.op);
        out.extend_from_slice(&self.flags.to_le_bytes());
        for v in [self.handle, self.token, self.src_inc, self.dst_inc] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.nranges.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for (off, len) in ranges {
            out.extend_from_slice(&off.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
    }

    fn decode(b: &[u8; HEADER_BYTES]) -> Result<DataHeader, WireError> {
        if &b[0..4] != MAGIC {
            return Err(WireError::new(ErrorCode::Malformed, "bad magic"));
        }
        if !(OLDEST_VERSION..=VERSION).contains(&b[4]) {
            return Err(WireError::new(
                ErrorCode::Malformed,
                format!("data-plane version {} not supported", b[4]),
            ));
        }
        let u64at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let h = DataHeader {
            op: b[5],
            flags: u16::from_le_bytes([b[6], b[7]]),
            handle: u64at(8),
            token: u64at(16),
            src_inc: u64at(24),
            dst_inc: u64at(32),
            nranges: u32::from_le_bytes([b[40], b[41], b[42], b[43]]),
        };
        if b[4] < h.version() {
            // A version-3 writer never sends a table: its flag would make the server read
            // the next request's bytes as one.
            return Err(WireError::new(
                ErrorCode::Malformed,
                format!("a checked write needs data-plane version {}", h.version()),
            ));
        }
        Ok(h)
    }
}

/// Checks a request header as the server does: its op, and how many bytes of ranges,
/// MAC trailer and padding follow it.
pub fn check_header(hdr: &[u8; HEADER_BYTES]) -> Result<(DataHeader, DataOp, usize), WireError> {
    let h = DataHeader::decode(hdr)?;
    let op = match h.op {
        1 => DataOp::Read,
        2 => DataOp::Write,
        other => {
            return Err(WireError::new(
                ErrorCode::UnknownOp,
                format!("data-plane op {other}"),
            ))
        }
    };
    if h.nranges == 0 || h.nranges > MAX_RANGES {
        return Err(WireError::new(
            ErrorCode::TooLarge,
            format!("{} ranges (1..={MAX_RANGES})", h.nranges),
        ));
    }
    let rest = h.nranges as usize * 16 + DATA_TRAILER_BYTES;
    Ok((h, op, rest + pad_for(HEADER_BYTES + rest)))
}

/// Splits what follows a request header (`rest` of [`check_header`]) off a whole
/// request: `(head, trailer)` — the header and ranges the MAC covers, and the MAC trailer
/// — once the padding after the trailer is proved to be zeros.
pub fn split_request(all: &[u8]) -> Result<(&[u8], &[u8]), WireError> {
    let malformed = |m: &str| WireError::new(ErrorCode::Malformed, m.to_string());
    let nranges = all
        .get(40..44)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| malformed("short request"))? as usize;
    let end = HEADER_BYTES + nranges * 16 + DATA_TRAILER_BYTES;
    let (used, pad) = all
        .split_at_checked(end)
        .ok_or_else(|| malformed("short request"))?;
    if pad.len() != pad_for(end) || pad.iter().any(|&b| b != 0) {
        return Err(malformed("request padding is not zeros"));
    }
    Ok(used.split_at(end - DATA_TRAILER_BYTES))
}

/// The `(offset, len)` ranges of a request head (header, then the ranges) into `out`.
pub fn ranges_of(head: &[u8], out: &mut Vec<(u64, u64)>) {
    out.clear();
    for c in head
        .get(HEADER_BYTES..)
        .unwrap_or_default()
        .chunks_exact(16)
    {
        let (o, l) = c.split_at(8);
        let le = |b: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        };
        out.push((le(o), le(l)));
    }
}

/// A response status (and, for a refusal, its padded message, cut at
/// [`MAX_STATUS_MSG`] bytes).
pub fn status_bytes(err: Option<&WireError>) -> Vec<u8> {
    let mut msg = err.map(|e| e.to_string()).unwrap_or_default();
    if msg.len() > MAX_STATUS_MSG {
        let mut cut = MAX_STATUS_MSG;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
    }
    let mut b = Vec::with_capacity(STATUS_BYTES + msg.len() + ALIGN);
    b.push(u8::from(err.is_some()));
    b.extend_from_slice(&[0, 0, 0]);
    b.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    b.resize(STATUS_BYTES, 0);
    b.extend_from_slice(msg.as_bytes());
    b.resize(b.len() + pad_for(b.len()), 0);
    b
}

/// What a response status says: `Ok(None)` ok, `Ok(Some(n))` a refusal whose message of
/// `n` bytes (then its padding) follows, `Err` a status no server sends.
pub fn parse_status(b: &[u8; STATUS_BYTES]) -> Result<Option<usize>, &'static str> {
    let [status, 0, 0, 0, l0, l1, l2, l3, ref pad @ ..] = *b else {
        return Err("malformed data-plane status");
    };
    let len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
    if status > 1 || pad.iter().any(|&x| x != 0) || (status == 0 && len != 0) {
        return Err("malformed data-plane status");
    }
    if status == 0 {
        return Ok(None);
    }
    if len > MAX_STATUS_MSG {
        return Err("data-plane refusal message too long");
    }
    Ok(Some(len))
}

/// The refusal a status message (`"code: text"`) carries; an unknown code is
/// `transfer_failed`.
pub fn refusal(msg: &[u8]) -> WireError {
    let text = String::from_utf8_lossy(msg).into_owned();
    let (code, rest) = text.split_once(": ").unwrap_or(("transfer_failed", &text));
    let code = match ErrorCode::from_name(code) {
        ErrorCode::Other => ErrorCode::TransferFailed,
        c => c,
    };
    WireError::new(code, format!("peer refused: {rest}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC §10 vectors: a read of one range `(4096, 8192)` with flags 0 is 112 bytes then
    /// 16 zero bytes; the ok status is 64 zero bytes; three CRCs are 12 bytes and 52 zeros.
    #[test]
    fn spec_vectors() {
        let h = DataHeader {
            op: 1,
            flags: 0,
            handle: 1,
            token: 2,
            src_inc: 3,
            dst_inc: 4,
            nranges: 1,
        };
        let mut b = Vec::new();
        h.encode([(4096, 8192)], &mut b);
        assert_eq!(b.len() + DATA_TRAILER_BYTES, 112);
        assert_eq!(pad_for(112), 16);
        assert_eq!(status_bytes(None), vec![0u8; 64]);
        let t = crc_table(&[1, 2, 3]);
        assert_eq!(t.len(), 64);
        assert!(t[12..].iter().all(|&x| x == 0));
    }

    #[test]
    fn headers_round_trip_and_bad_ones_are_refused() {
        let h = DataHeader {
            op: 2,
            flags: FLAG_CRC,
            handle: 7,
            token: 8,
            src_inc: 9,
            dst_inc: 10,
            nranges: 2,
        };
        let mut b = Vec::new();
        h.encode([(0, 1), (64, 2)], &mut b);
        let hdr: [u8; HEADER_BYTES] = b[..HEADER_BYTES].try_into().unwrap();
        let (got, op, rest) = check_header(&hdr).unwrap();
        assert_eq!((got, op), (h, DataOp::Write));
        assert_eq!(
            rest,
            32 + DATA_TRAILER_BYTES + pad_for(HEADER_BYTES + 32 + DATA_TRAILER_BYTES)
        );
        let mut ranges = Vec::new();
        ranges_of(&b, &mut ranges);
        assert_eq!(ranges, vec![(0, 1), (64, 2)]);
        assert_eq!(b[4], 4, "a checked write goes as version 4");
        for (at, v, code) in [
            (0usize, b'X', ErrorCode::Malformed),
            (4, 2, ErrorCode::Malformed),
            (4, 5, ErrorCode::Malformed),
            // a version-3 write with the crc flag: its table would be misread
            (4, 3, ErrorCode::Malformed),
            (5, 3, ErrorCode::UnknownOp),
            (40, 0, ErrorCode::TooLarge),
        ] {
            let mut bad = hdr;
            bad[at] = v;
            if at == 40 {
                bad[40..44].copy_from_slice(&0u32.to_le_bytes());
            }
            assert_eq!(check_header(&bad).unwrap_err().code, code, "byte {at}");
        }
    }

    /// Reads and unchecked writes go as version 3 (a version-3 server serves them).
    #[test]
    fn requests_take_the_lowest_version_that_has_what_they_use() {
        for (op, flags, v) in [(1, 0, 3), (1, FLAG_CRC, 3), (2, 0, 3), (2, FLAG_CRC, 4)] {
            let h = DataHeader {
                op,
                flags,
                handle: 1,
                token: 2,
                src_inc: 3,
                dst_inc: 4,
                nranges: 1,
            };
            let mut b = Vec::new();
            h.encode([(0, 64)], &mut b);
            assert_eq!(b[4], v, "op {op} flags {flags}");
            let hdr: [u8; HEADER_BYTES] = b[..HEADER_BYTES].try_into().unwrap();
            assert_eq!(check_header(&hdr).unwrap().0, h);
        }
    }

    #[test]
    fn statuses_parse_as_the_server_writes_them() {
        let ok: [u8; STATUS_BYTES] = status_bytes(None).try_into().unwrap();
        assert_eq!(parse_status(&ok), Ok(None));
        let e = WireError::new(ErrorCode::NotOwner, "wrong token");
        let b = status_bytes(Some(&e));
        let head: [u8; STATUS_BYTES] = b[..STATUS_BYTES].try_into().unwrap();
        let n = parse_status(&head).unwrap().unwrap();
        let r = refusal(&b[STATUS_BYTES..STATUS_BYTES + n]);
        assert_eq!(r.code, ErrorCode::NotOwner);
        assert!(r.message.contains("wrong token"), "{r:?}");
        for (at, v) in [(1usize, 1u8), (0, 2), (63, 9), (4, 1)] {
            let mut st = ok;
            st[at] = v;
            assert!(parse_status(&st).is_err(), "status with byte {at} = {v}");
        }
        let long = WireError::new(ErrorCode::Internal, "x".repeat(10_000));
        assert_eq!(
            status_bytes(Some(&long)).len(),
            STATUS_BYTES + MAX_STATUS_MSG
        );
    }
}
