//! Helpers shared by the daemon's integration tests: raw sockets, signed peer and
//! data-plane requests, HTTP and Python checks. The daemon launcher, the small layout,
//! test data and free ports are `kvd-testkit`'s (re-exported here).
#![allow(dead_code)] // each test file uses a different subset
#![allow(unused_imports)] // each test file uses a different subset of the re-exports

pub use kvd_testkit::{block, eventually, free_port, keys, kvd_bin, layout, Daemon};

use std::process::Command;
use std::time::Duration;

use kvd_client::{Client, LayoutInfo};
use kvd_protocol::{decode_reply, ErrorCode};
use serde::de::IgnoredAny;
use serde::Serialize;

/// Flags of a daemon whose restart keeps nothing (`pool.keep` off): for tests of how
/// clients recover from an empty new daemon (a kept pool is `keep.rs`'s subject).
pub const NOT_KEPT: &[&str] = &["--keep-pool", "false"];

/// Registers `layout(kib)`.
pub fn register(c: &Client, kib: u64) -> LayoutInfo {
    c.register_layout(&layout(kib)).expect("register layout")
}

/// The cluster key the tests' daemons use (the default secret file, which the first
/// daemon created).
pub fn cluster_key() -> kvd_protocol::auth::ClusterKey {
    kvd_daemon::auth::load_key(&kvd_daemon::auth::default_secret_path(), true).unwrap()
}

/// A data-plane read (`kvd_protocol::data`, SPEC §10 wire format) of `len` bytes at
/// `off` of the exporter named by `p`, under `handle` and `token`, signed with the
/// cluster key: the bytes, or the refusal's code.
pub fn raw_read(
    p: &kvd_protocol::TransferParams,
    handle: u64,
    token: u64,
    off: u64,
    len: u64,
) -> Result<Vec<u8>, String> {
    raw_read_with(Some(&cluster_key()), p, handle, token, off, len)
}

/// [`raw_read`] signed with `key` (or unsigned).
pub fn raw_read_with(
    key: Option<&kvd_protocol::auth::ClusterKey>,
    p: &kvd_protocol::TransferParams,
    handle: u64,
    token: u64,
    off: u64,
    len: u64,
) -> Result<Vec<u8>, String> {
    raw_data(
        key,
        &p.from.data,
        p.from.incarnation.0,
        (1, handle, token),
        &[(off, len)],
        &[],
    )
}

/// One data-plane request by hand (SPEC §10, "Data plane (TCP)"), signed with `key` (or
/// not): `op` = (1 read | 2 write, handle, token) to the daemon of `incarnation` at `addr`
/// (its `PeerRef::data`, which the request is signed for), over `ranges`; a write sends
/// `payload` after the request. Returns a read's bytes (a write's: none), or the
/// refusal's code.
pub fn raw_data(
    key: Option<&kvd_protocol::auth::ClusterKey>,
    addr: &str,
    incarnation: u64,
    (op, handle, token): (u8, u64, u64),
    ranges: &[(u64, u64)],
    payload: &[u8],
) -> Result<Vec<u8>, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut req = Vec::new();
    req.extend_from_slice(b"KVDX");
    req.extend_from_slice(&[3, op, 0, 0]);
    for v in [handle, token, 1, incarnation] {
        req.extend_from_slice(&v.to_le_bytes());
    }
    req.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    req.extend_from_slice(&0u32.to_le_bytes());
    for (off, len) in ranges {
        req.extend_from_slice(&off.to_le_bytes());
        req.extend_from_slice(&len.to_le_bytes());
    }
    let trailer = match key {
        Some(k) => k
            .data_trailer(kvd_daemon::auth::stamp(), addr, &req)
            .to_vec(),
        None => vec![0u8; kvd_protocol::auth::DATA_TRAILER_BYTES],
    };
    req.extend_from_slice(&trailer);
    req.resize(req.len().div_ceil(64) * 64, 0); // padded to 64 bytes
    req.extend_from_slice(payload);
    s.write_all(&req).unwrap();
    let mut hdr = [0u8; 64];
    s.read_exact(&mut hdr).unwrap();
    let mlen = u32::from_le_bytes(hdr[4..8].try_into().unwrap()) as usize;
    let mut msg = vec![0u8; mlen.div_ceil(64) * 64];
    s.read_exact(&mut msg).unwrap();
    msg.truncate(mlen);
    if hdr[0] != 0 {
        let text = String::from_utf8(msg).unwrap();
        return Err(text.split(':').next().unwrap().to_string());
    }
    let want: u64 = if op == 1 {
        ranges.iter().map(|r| r.1).sum()
    } else {
        0
    };
    let mut body = vec![0u8; want as usize];
    s.read_exact(&mut body).unwrap();
    Ok(body)
}

/// A raw ZMQ socket speaking the wire by hand (hostile and race tests).
pub struct Raw {
    pub sock: zmq::Socket,
    _ctx: zmq::Context,
}

impl Raw {
    pub fn new(ep: &str, kind: zmq::SocketType) -> Raw {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(kind).unwrap();
        sock.set_linger(0).unwrap();
        sock.set_rcvtimeo(5000).unwrap();
        sock.set_sndhwm(0).unwrap();
        sock.set_rcvhwm(0).unwrap();
        sock.connect(ep).unwrap();
        Raw { sock, _ctx: ctx }
    }

    pub fn send(&self, frames: &[&[u8]]) {
        self.sock.send_multipart(frames.iter().copied(), 0).unwrap();
    }

    /// The next reply: (id, error code or None for ok, payload frame count).
    pub fn recv(&self) -> (u64, Option<ErrorCode>, usize) {
        let mut parts = self.sock.recv_multipart(0).expect("a reply within 5 s");
        if parts[0].is_empty() {
            parts.remove(0); // REQ-style delimiter
        }
        let (id, r) = decode_reply::<IgnoredAny>(&parts[0]).expect("replies always decode");
        (id, r.err().map(|e| e.code), parts.len() - 1)
    }

    pub fn call(&self, frames: &[&[u8]]) -> (u64, Option<ErrorCode>) {
        self.send(frames);
        let (id, code, _) = self.recv();
        (id, code)
    }
}

#[derive(Serialize)]
pub struct Env<'a, B: Serialize> {
    pub v: u64,
    pub id: u64,
    pub op: &'a str,
    pub body: B,
}

/// An envelope frame, encoded as the SPEC says (a map).
pub fn frame<B: Serialize>(v: u64, id: u64, op: &str, body: B) -> Vec<u8> {
    rmp_serde::to_vec_named(&Env { v, id, op, body }).unwrap()
}

/// A raw DEALER on a daemon's control endpoint that signs what it sends (or not).
pub struct PeerRaw {
    pub raw: Raw,
    pub key: Option<kvd_protocol::auth::ClusterKey>,
    /// The receiver's name the requests are signed for.
    pub to: String,
}

impl PeerRaw {
    /// Connects to `control` (a `PeerRef::node`), signing with `key` for that node.
    pub fn new(control: &str, key: Option<kvd_protocol::auth::ClusterKey>) -> PeerRaw {
        PeerRaw {
            raw: Raw::new(control, zmq::DEALER),
            key,
            to: control.to_string(),
        }
    }

    /// The frames of an envelope, with its auth frame when a key is set.
    pub fn frames(&self, env: &[u8]) -> Vec<Vec<u8>> {
        let mut v = vec![env.to_vec()];
        if let Some(k) = &self.key {
            v.push(
                k.seal_request(kvd_daemon::auth::stamp(), &self.to, env)
                    .to_vec(),
            );
        }
        v
    }

    /// Sends `frames` and returns the reply's (id, code).
    pub fn call_frames(&self, frames: &[Vec<u8>]) -> (u64, Option<ErrorCode>) {
        let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        self.raw.call(&refs)
    }

    /// Signs and sends one envelope; returns the reply's (id, code).
    pub fn call(&self, env: &[u8]) -> (u64, Option<ErrorCode>) {
        self.call_frames(&self.frames(env))
    }
}

/// `GET path` on 127.0.0.1:`port` → (status, body); `None` when nothing listens yet.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// The Python the tests run: `$KVD_PYTHON`, else the test command's `.venv`, else
/// `python3`.
/// Runs one of python/tests/'s check scripts with `args` under [`python`], after checking
/// that it can import `imports` (else fails saying `how` to get them); asserts every check
/// passed ("N passed, 0 failed") and returns the script's output.
#[allow(dead_code)] // not every test binary runs Python
pub fn python_checks(script: &str, imports: &str, how: &str, args: &[String]) -> String {
    let py = python();
    let probe = Command::new(&py)
        .args(["-c", &format!("import {imports}")])
        .status();
    assert!(
        matches!(probe, Ok(s) if s.success()),
        "{py} cannot import {imports}: {how}"
    );
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../python/tests")
        .join(script);
    let out = Command::new(&py)
        .arg(&path)
        .args(args)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script} failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    stdout
}

pub fn python() -> String {
    if let Ok(p) = std::env::var("KVD_PYTHON") {
        return p;
    }
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if venv.exists() {
        return venv.display().to_string();
    }
    "python3".into()
}

/// The well-behaved client: a full store/load round trip, verified.
pub fn round_trip(c: &Client, l: kvd_protocol::LayoutId, seed: u32) {
    let ks = keys(seed, 2);
    let data: Vec<Vec<u8>> = (0..2)
        .map(|i| block(u64::from(seed) + i, 16 * 1024))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    c.store(l, &ks, &refs).unwrap();
    let mut bufs = vec![vec![0u8; 16 * 1024]; 2];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l, &ks, &mut outs).unwrap(), vec![true; 2]);
    assert!(bufs == data);
    c.delete(l, &ks).unwrap();
}
