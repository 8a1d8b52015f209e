//! Peer authentication: a cluster secret and a MAC over every daemon-to-daemon message
//! (SPEC §10.1).
//!
//! The vendored libzmq has no CURVE, so daemons authenticate each other themselves. Every
//! daemon of a cluster holds the same secret ([`ClusterKey`], read from a file). A peer
//! request travels as two ZMQ frames, the envelope and an *auth frame*:
//!
//! ```text
//! auth = "KVA1" u64 unix_ms  u64 nonce  [32] mac        -- 52 bytes, integers LE
//! request mac = BLAKE2b-256(key; "kvd.peer.req.v2"   || unix_ms || nonce || to || envelope)
//! reply   mac = BLAKE2b-256(key; "kvd.peer.reply.v1" || unix_ms || nonce || envelope)
//! to          = u32 len || the receiver's node name (its control endpoint, as advertised)
//! ```
//!
//! A request names its receiver inside the MAC, so a request captured on its way to one
//! daemon is refused by every other daemon of the cluster; the receiver checks `to`
//! against its own name ([`Receiver`]). A reply's auth frame repeats its request's
//! `nonce` (and `unix_ms`), so a reply cannot be replayed as the answer to another
//! request. Data-plane requests carry a 48-byte trailer, `u64 unix_ms, u64 nonce, [32]
//! mac` with the label `"kvd.data.v2"` over `to`, the header and the ranges
//! ([`ClusterKey::data_trailer`]).
//!
//! Replay protection is the receiver's: a request is accepted once, and only within
//! [`MAX_SKEW_MS`] of the receiver's clock ([`check_fresh`]); the daemon remembers the
//! nonces it accepted for that long.
//!
//! The MAC is BLAKE2b in its keyed mode (RFC 7693), a PRF: without the key no one can make
//! a valid frame, and a frame changed in any byte fails. Comparison is constant-time.

use blake2::digest::consts::U32;
use blake2::digest::{KeyInit, Mac};
use blake2::Blake2bMac;

/// Length of the auth frame.
pub const AUTH_FRAME_BYTES: usize = 52;
/// Length of the data-plane trailer.
pub const DATA_TRAILER_BYTES: usize = 48;
/// How far a request's clock may be from the receiver's (either way).
pub const MAX_SKEW_MS: u64 = 30_000;
/// Fewest bytes a secret file must hold (after trimming white space: [`trim_secret`]).
pub const MIN_SECRET_BYTES: usize = 32;

const MAGIC: &[u8; 4] = b"KVA1";
const REQ_LABEL: &[u8] = b"kvd.peer.req.v2";
const REPLY_LABEL: &[u8] = b"kvd.peer.reply.v1";
const DATA_LABEL: &[u8] = b"kvd.data.v2";

type Mac256 = Blake2bMac<U32>;

/// The cluster secret, as a 32-byte MAC key.
#[derive(Clone)]
pub struct ClusterKey([u8; 32]);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

/// Why a peer message was not authenticated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No auth frame, or one of the wrong length or magic.
    #[error("no valid auth frame (peer messages must carry one: SPEC §10.1)")]
    Missing,
    /// The MAC does not match: another secret, altered bytes, or a request addressed
    /// to another node.
    #[error("MAC mismatch (another cluster secret, the message was altered, or a request addressed to another node)")]
    BadMac,
    /// The request's clock is too far from the receiver's.
    #[error("timestamp {got_ms} is {skew_ms} ms from this node's clock (limit {MAX_SKEW_MS})")]
    Stale {
        /// The request's `unix_ms`.
        got_ms: u64,
        /// How far off it is.
        skew_ms: u64,
    },
    /// The request was stamped before the receiver started: it was meant for an
    /// earlier life of the daemon (a replay across a restart), or the sender's clock is
    /// behind the receiver's by more than the time since it started.
    #[error("stamped at {got_ms}, before this daemon started ({started_ms})")]
    BeforeStart {
        /// The request's `unix_ms`.
        got_ms: u64,
        /// When the receiver started, by its clock.
        started_ms: u64,
    },
    /// The receiver remembers as many accepted requests as it may within the window;
    /// new ones are refused until old ones age out.
    #[error("too many requests within the replay window ({0} remembered); try again")]
    Full(usize),
    /// The request was already accepted once.
    #[error("replayed request (nonce {0:#x} already seen)")]
    Replayed(u64),
    /// A reply that does not answer the request it claims to.
    #[error("reply names another request")]
    WrongReply,
}

/// What an accepted auth frame says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    /// The sender's clock, ms since the Unix epoch.
    pub unix_ms: u64,
    /// A random number the sender chose for this request.
    pub nonce: u64,
}

/// A cluster secret shorter than [`MIN_SECRET_BYTES`] (after trimming): its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the cluster secret has {0} bytes; it needs at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")]
pub struct SecretTooShort(pub usize);

impl ClusterKey {
    /// The key of a secret (the contents of the secret file, white space trimmed by
    /// [`trim_secret`]): the secret is hashed, so any encoding (hex, base64, raw) of at
    /// least [`MIN_SECRET_BYTES`] works.
    pub fn from_secret(secret: &[u8]) -> Result<ClusterKey, SecretTooShort> {
        let s = trim_secret(secret);
        if s.len() < MIN_SECRET_BYTES {
            return Err(SecretTooShort(s.len()));
        }
        use blake2::{Blake2b, Digest};
        let mut h = Blake2b::<U32>::new();
        h.update(b"kvd.cluster-key.v1");
        h.update(s);
        Ok(ClusterKey(h.finalize().into()))
    }

    fn mac(&self, label: &[u8], stamp: Stamp, parts: &[&[u8]]) -> Mac256 {
        // A 32-byte key is always a valid BLAKE2b key (1..=64 bytes).
        let mut m = <Mac256 as KeyInit>::new_from_slice(&self.0).expect("32-byte key");
        m.update(label);
        m.update(&stamp.unix_ms.to_le_bytes());
        m.update(&stamp.nonce.to_le_bytes());
        for p in parts {
            m.update(p);
        }
        m
    }

    fn frame(&self, label: &[u8], stamp: Stamp, parts: &[&[u8]]) -> [u8; AUTH_FRAME_BYTES] {
        let tag = self.mac(label, stamp, parts).finalize().into_bytes();
        let mut f = [0u8; AUTH_FRAME_BYTES];
        f[..4].copy_from_slice(MAGIC);
        f[4..12].copy_from_slice(&stamp.unix_ms.to_le_bytes());
        f[12..20].copy_from_slice(&stamp.nonce.to_le_bytes());
        f[20..].copy_from_slice(&tag);
        f
    }

    fn open(&self, label: &[u8], parts: &[&[u8]], frame: &[u8]) -> Result<Stamp, AuthError> {
        let stamp = parse(frame)?;
        self.mac(label, stamp, parts)
            .verify_slice(&frame[20..])
            .map_err(|_| AuthError::BadMac)?;
        Ok(stamp)
    }

    /// The auth frame of a peer request to the node named `to` (its control endpoint as
    /// it advertises it: `PeerRef.node`).
    pub fn seal_request(&self, stamp: Stamp, to: &str, envelope: &[u8]) -> [u8; AUTH_FRAME_BYTES] {
        let len = name_len(to);
        self.frame(REQ_LABEL, stamp, &[&len, to.as_bytes(), envelope])
    }

    /// Checks a peer request's auth frame, and that it is addressed to `me` (not its
    /// freshness: see [`check_fresh`]).
    pub fn open_request(
        &self,
        me: &Receiver,
        envelope: &[u8],
        frame: &[u8],
    ) -> Result<Stamp, AuthError> {
        let len = name_len(&me.0);
        self.open(REQ_LABEL, &[&len, me.0.as_bytes(), envelope], frame)
    }

    /// The auth frame of the reply to the request stamped `req`.
    pub fn seal_reply(&self, req: Stamp, envelope: &[u8]) -> [u8; AUTH_FRAME_BYTES] {
        self.frame(REPLY_LABEL, req, &[envelope])
    }

    /// Checks that a reply answers the request stamped `req`.
    pub fn open_reply(&self, req: Stamp, envelope: &[u8], frame: &[u8]) -> Result<(), AuthError> {
        let got = self.open(REPLY_LABEL, &[envelope], frame)?;
        if got != req {
            return Err(AuthError::WrongReply);
        }
        Ok(())
    }

    /// The trailer of a data-plane request to the node named `to` whose header and
    /// ranges are `head`.
    pub fn data_trailer(&self, stamp: Stamp, to: &str, head: &[u8]) -> [u8; DATA_TRAILER_BYTES] {
        let len = name_len(to);
        let tag = self
            .mac(DATA_LABEL, stamp, &[&len, to.as_bytes(), head])
            .finalize()
            .into_bytes();
        let mut t = [0u8; DATA_TRAILER_BYTES];
        t[..8].copy_from_slice(&stamp.unix_ms.to_le_bytes());
        t[8..16].copy_from_slice(&stamp.nonce.to_le_bytes());
        t[16..].copy_from_slice(&tag);
        t
    }

    /// Checks a data-plane request's trailer against its header and ranges, and that it
    /// is addressed to `me`.
    pub fn open_data(
        &self,
        me: &Receiver,
        head: &[u8],
        trailer: &[u8],
    ) -> Result<Stamp, AuthError> {
        if trailer.len() != DATA_TRAILER_BYTES {
            return Err(AuthError::Missing);
        }
        let stamp = Stamp {
            unix_ms: le64(&trailer[..8]),
            nonce: le64(&trailer[8..16]),
        };
        let len = name_len(&me.0);
        self.mac(DATA_LABEL, stamp, &[&len, me.0.as_bytes(), head])
            .verify_slice(&trailer[16..])
            .map_err(|_| AuthError::BadMac)?;
        Ok(stamp)
    }
}

/// The node a request is addressed to, as the receiver checks it: its own name, the
/// control endpoint it advertises (`PeerRef.node`). Peers must name it exactly so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receiver(pub String);

/// `u32 LE` length of a node name (names are control endpoints, far below 4 GiB; a longer
/// one is cut in the length only, and so never matches a receiver's own name).
fn name_len(name: &str) -> [u8; 4] {
    u32::try_from(name.len()).unwrap_or(u32::MAX).to_le_bytes()
}

/// The secret's bytes the key is made of: the file's contents less the white space at
/// both ends, where white space is exactly ASCII space, tab, CR and LF (not vertical tab
/// or form feed, which some languages' trim functions also remove: SPEC §10.1).
pub fn trim_secret(secret: &[u8]) -> &[u8] {
    let ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n');
    let start = secret.iter().position(|b| !ws(b)).unwrap_or(secret.len());
    let end = secret.iter().rposition(|b| !ws(b)).map_or(start, |i| i + 1);
    secret.get(start..end).unwrap_or_default()
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn parse(frame: &[u8]) -> Result<Stamp, AuthError> {
    if frame.len() != AUTH_FRAME_BYTES || &frame[..4] != MAGIC {
        return Err(AuthError::Missing);
    }
    Ok(Stamp {
        unix_ms: le64(&frame[4..12]),
        nonce: le64(&frame[12..20]),
    })
}

/// The stamp an auth frame claims, unchecked (to look up the request a reply answers).
pub fn stamp_of(frame: &[u8]) -> Result<Stamp, AuthError> {
    parse(frame)
}

/// Checks that a stamp's clock is within [`MAX_SKEW_MS`] of `now_ms`.
pub fn check_fresh(stamp: Stamp, now_ms: u64) -> Result<(), AuthError> {
    let skew = stamp.unix_ms.abs_diff(now_ms);
    if skew > MAX_SKEW_MS {
        return Err(AuthError::Stale {
            got_ms: stamp.unix_ms,
            skew_ms: skew,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> ClusterKey {
        ClusterKey::from_secret(&[b; 40]).unwrap()
    }

    const S: Stamp = Stamp {
        unix_ms: 1_700_000_000_000,
        nonce: 42,
    };
    const TO: &str = "tcp://10.0.0.5:7101";

    fn me() -> Receiver {
        Receiver(TO.into())
    }

    #[test]
    fn short_secrets_are_refused_and_white_space_is_trimmed() {
        assert!(ClusterKey::from_secret(b"  short \n").is_err());
        let a = ClusterKey::from_secret(&[b'a'; 32]).unwrap();
        let mut padded = b" \t\r\n".to_vec();
        padded.extend_from_slice(&[b'a'; 32]);
        padded.extend_from_slice(b"\r\n\t ");
        let b = ClusterKey::from_secret(&padded).unwrap();
        assert_eq!(a.0, b.0);
        // vertical tab and form feed are secret bytes, not white space
        let mut vt = vec![b'a'; 32];
        vt.push(0x0b);
        assert_eq!(trim_secret(&vt).len(), 33);
        assert_ne!(ClusterKey::from_secret(&vt).unwrap().0, a.0);
        assert_eq!(trim_secret(b"\x0c x \n"), b"\x0c x");
        assert_eq!(trim_secret(b" \n\t"), b"");
    }

    #[test]
    fn a_request_opens_only_with_the_same_key_bytes_and_receiver() {
        let env = b"envelope bytes";
        let f = key(1).seal_request(S, TO, env);
        assert_eq!(key(1).open_request(&me(), env, &f), Ok(S));
        assert_eq!(key(2).open_request(&me(), env, &f), Err(AuthError::BadMac));
        assert_eq!(
            key(1).open_request(&me(), b"envelope bytez", &f),
            Err(AuthError::BadMac)
        );
        // another daemon of the cluster refuses it
        for other in [
            "tcp://10.0.0.6:7101",
            "tcp://10.0.0.5:7102",
            "",
            "tcp://10.0.0.5:710",
        ] {
            assert_eq!(
                key(1).open_request(&Receiver(other.into()), env, &f),
                Err(AuthError::BadMac),
                "{other:?}"
            );
        }
        // the length prefix keeps the name and the envelope apart
        let g = key(1).seal_request(S, "tcp://10.0.0.5:710", b"1envelope bytes");
        assert_eq!(key(1).open_request(&me(), env, &g), Err(AuthError::BadMac));
        for i in 4..AUTH_FRAME_BYTES {
            let mut g = f;
            g[i] ^= 1;
            assert!(key(1).open_request(&me(), env, &g).is_err(), "byte {i}");
        }
        assert_eq!(
            key(1).open_request(&me(), env, &f[..51]),
            Err(AuthError::Missing)
        );
        assert_eq!(
            key(1).open_request(&me(), env, b""),
            Err(AuthError::Missing)
        );
        // a request's frame is not a reply's, nor the other way round
        assert!(key(1).open_reply(S, env, &f).is_err());
        let r = key(1).seal_reply(S, env);
        assert!(key(1).open_request(&me(), env, &r).is_err());
        assert_eq!(key(1).open_reply(S, env, &r), Ok(()));
        let other = Stamp { nonce: 43, ..S };
        assert_eq!(
            key(1).open_reply(other, env, &key(1).seal_reply(S, env)),
            Err(AuthError::WrongReply)
        );
    }

    #[test]
    fn data_trailers_bind_the_header_and_the_receiver() {
        let head = [7u8; 64];
        let t = key(1).data_trailer(S, TO, &head);
        assert_eq!(key(1).open_data(&me(), &head, &t), Ok(S));
        assert_eq!(key(2).open_data(&me(), &head, &t), Err(AuthError::BadMac));
        let there = Receiver("tcp://10.0.0.6:7101".into());
        assert_eq!(key(1).open_data(&there, &head, &t), Err(AuthError::BadMac));
        let mut h2 = head;
        h2[9] = 0;
        assert_eq!(key(1).open_data(&me(), &h2, &t), Err(AuthError::BadMac));
        assert_eq!(
            key(1).open_data(&me(), &head, &t[1..]),
            Err(AuthError::Missing)
        );
    }

    #[test]
    fn freshness_window() {
        assert!(check_fresh(S, S.unix_ms + MAX_SKEW_MS).is_ok());
        assert!(check_fresh(S, S.unix_ms - MAX_SKEW_MS).is_ok());
        assert!(matches!(
            check_fresh(S, S.unix_ms + MAX_SKEW_MS + 1),
            Err(AuthError::Stale { .. })
        ));
        assert!(matches!(
            check_fresh(S, S.unix_ms - MAX_SKEW_MS - 1),
            Err(AuthError::Stale { .. })
        ));
    }

    /// SPEC §10.1 vectors: secret = 32 × 0x61 ("a"), stamp (1700000000000, 42), receiver
    /// `tcp://10.0.0.5:7101`, envelope (or data-plane head) "kvd"; and the key of the
    /// same secret with a trailing vertical tab (kept: not white space).
    #[test]
    fn spec_vectors() {
        let k = ClusterKey::from_secret(&[b'a'; 32]).unwrap();
        let f = k.seal_request(S, TO, b"kvd");
        assert_eq!(&f[..4], b"KVA1");
        assert_eq!(hex::encode(&f[20..]), SPEC_REQUEST_MAC);
        let t = k.data_trailer(S, TO, b"kvd");
        assert_eq!(hex::encode(&t[16..]), SPEC_DATA_MAC);
        let r = k.seal_reply(S, b"kvd");
        assert_eq!(hex::encode(&r[20..]), SPEC_REPLY_MAC);
        assert_eq!(hex::encode(k.0), SPEC_KEY);
        let mut vt = vec![b'a'; 32];
        vt.extend_from_slice(b"\x0b\n");
        assert_eq!(
            hex::encode(ClusterKey::from_secret(&vt).unwrap().0),
            SPEC_KEY_VT
        );
    }

    const SPEC_REQUEST_MAC: &str =
        "f46cce1f0995adc81ce0e995ee61b71a560f8b792bf87d57ff82ad059c734568";
    const SPEC_DATA_MAC: &str = "86d2faee56e6a8151c67e3b01f311401fa31fd86743a64705f29c1ceef4d8c97";
    const SPEC_REPLY_MAC: &str = "3d41243aea40503ec37766bf25edca1e94b4c6b1686caa178a984763e7e0a5c6";
    const SPEC_KEY: &str = "19c29c94c0256f208d05a016ef2b9d69b900c3911caf0d6dfb74e95f26a775ff";
    const SPEC_KEY_VT: &str = "70814662435e7caed09b955e6509a08f7288d822b3ff9a939734456a6e5f7571";
}
