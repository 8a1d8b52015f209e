//! Helpers shared by the integration tests: a real `kvd` process on a private ipc
//! socket and pool file, and deterministic random block contents.
#![allow(dead_code)] // each test file uses a different subset

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvd_client::{Client, LayoutInfo, MapPool};
use kvd_protocol::{decode_reply, Dtype, ErrorCode, Layout, MemoryOrder};
use serde::de::IgnoredAny;
use serde::Serialize;

/// A running daemon. Killed (SIGKILL) on drop if still running.
pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub endpoint: String,
    pub pool_path: PathBuf,
    pub socket_path: PathBuf,
    args: Vec<String>,
}

impl Daemon {
    /// Starts `kvd` with a 64 MiB pool (unless `extra` sets one) of 1 MiB segments, plus
    /// `extra` flags.
    pub fn start(extra: &[&str]) -> Daemon {
        Self::try_start(extra).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Daemon::start`], but a daemon that exits at start (e.g. a port another process
    /// took meanwhile) is an error the caller can retry.
    pub fn try_start(extra: &[&str]) -> Result<Daemon, String> {
        let dir = tempfile::tempdir_in("/dev/shm").expect("tempdir in /dev/shm");
        let socket_path = dir.path().join("kvd.sock");
        let pool_path = dir.path().join("kvd.pool");
        let endpoint = format!("ipc://{}", socket_path.display());
        let mut args: Vec<String> = vec![
            "--endpoint".into(),
            endpoint.clone(),
            "--pool-path".into(),
            pool_path.display().to_string(),
            "--segment-size".into(),
            "1MiB".into(),
            "--log-level".into(),
            "warn".into(),
        ];
        if !extra.contains(&"--metrics-addr") {
            args.extend(["--metrics-addr".into(), "127.0.0.1:0".into()]);
        }
        if !extra.contains(&"--pool-size") {
            args.extend(["--pool-size".into(), "64MiB".into()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let child = spawn(&args);
        let mut d = Daemon {
            child,
            dir,
            endpoint,
            pool_path,
            socket_path,
            args,
        };
        d.wait_ready()?;
        Ok(d)
    }

    /// Waits for the socket: the daemon creates it last, once every endpoint is bound.
    fn wait_ready(&mut self) -> Result<(), String> {
        let until = Instant::now() + Duration::from_secs(20);
        while !self.socket_path.exists() {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Err(format!("kvd exited at start: {st}"));
            }
            if Instant::now() > until {
                return Err("kvd did not create its socket in 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// A client that maps the pool.
    pub fn client(&self) -> Client {
        self.client_with(MapPool::Always)
    }

    /// A client with the given mapping mode.
    pub fn client_with(&self, map: MapPool) -> Client {
        Client::builder()
            .with_endpoint(&self.endpoint)
            .with_timeout(Duration::from_secs(10))
            .with_map_pool(map)
            .connect()
            .expect("connect to kvd")
    }

    /// Sends a signal and waits (bounded) for the exit status.
    pub fn signal(&mut self, sig: nix::sys::signal::Signal) -> ExitStatus {
        if let Some(st) = self.child.try_wait().unwrap() {
            return st; // already gone
        }
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < until,
                "kvd did not exit within 20 s of {sig}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the daemon (if it still runs) and starts a new one with the same arguments.
    pub fn restart(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGKILL);
        let _ = std::fs::remove_file(&self.socket_path);
        self.child = spawn(&self.args);
        self.wait_ready().unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The `kvd` to run: `$KVD_BIN_DIR/kvd` when set (a bundle run on another machine, e.g.
/// the GPU check), else the one cargo built for this test.
pub fn kvd_bin() -> PathBuf {
    match std::env::var_os("KVD_BIN_DIR") {
        Some(d) => PathBuf::from(d).join("kvd"),
        None => PathBuf::from(env!("CARGO_BIN_EXE_kvd")),
    }
}

fn spawn(args: &[String]) -> Child {
    Command::new(kvd_bin())
        .args(args)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn kvd")
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A layout whose blocks are `kib` KiB (`kib` even).
pub fn layout(kib: u64) -> Layout {
    // 2 parts * 16 tokens * 1 head * 32 dims * 2 bytes = 2 KiB per layer
    Layout {
        model: "kvd-test/model".into(),
        num_layers: kib / 2,
        kv_parts: 2,
        num_kv_heads: 1,
        head_dim: 32,
        dtype: Dtype::F16,
        tokens_per_block: 16,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::LayerPartTokenHead,
    }
}

/// Registers `layout(kib)`.
pub fn register(c: &Client, kib: u64) -> LayoutInfo {
    c.register_layout(&layout(kib)).expect("register layout")
}

/// Deterministic pseudo-random bytes (xorshift), different for every seed.
pub fn block(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Keys for a token sequence of `n` blocks starting from `seed`.
pub fn keys(seed: u32, n: usize) -> Vec<kvd_protocol::ChunkHash> {
    let tokens: Vec<u32> = (0..n as u32 * 16)
        .map(|t| t.wrapping_mul(31).wrapping_add(seed))
        .collect();
    kvd_protocol::hash::chunk_hashes(&tokens, 16, &seed.to_le_bytes())
}

/// Polls `f` until it returns true, failing after `secs` seconds.
pub fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < until, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free TCP port on loopback for a daemon a test starts, chosen outside the kernel's
/// ephemeral range (`net.ipv4.ip_local_port_range`) and never twice in one process.
///
/// A port bound to 0 and released comes from the ephemeral range, where every socket
/// bound to port 0 meanwhile (another daemon's data port, any outgoing connection's
/// local end) may take it before the daemon binds it: the p2p bench lost a daemon that
/// way ("Address already in use"). Outside the range only another process picking the
/// same port between this check and the bind can, and the pick is random.
pub fn free_port() -> u16 {
    use rand::Rng;
    use std::sync::Mutex;
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|x| x.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999));
    // below the range when there is room, else above it
    let (from, to) = if range.0 >= 12_000 {
        (10_000, range.0)
    } else {
        (range.1.saturating_add(1), u16::MAX)
    };
    assert!(
        to > from + 100,
        "no ports outside the ephemeral range {range:?}"
    );
    let mut rng = rand::thread_rng();
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1000 {
        let p = rng.gen_range(from..to);
        if !given.contains(&p) && std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
            given.push(p);
            return p;
        }
    }
    panic!("no free port in {from}..{to}");
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
