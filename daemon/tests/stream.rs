//! The local stream transport (SPEC §1.1) from the outside: a real daemon, raw Unix
//! sockets speaking the framing by hand, and `kvd-client`, which uses the transport by
//! default. Every bad connection is closed (or answered) without disturbing anyone else.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use kvd_client::{Client, MapPool};
use kvd_protocol::stream::{self, Greeting, StreamLimits};
use kvd_protocol::*;

const ANY: StreamLimits = StreamLimits {
    max_frames: u32::MAX,
    max_frame_bytes: u32::MAX,
    max_message_bytes: u64::MAX,
};

fn stream_path(d: &Daemon) -> PathBuf {
    let mut p = d.socket_path.clone().into_os_string();
    p.push(".stream");
    PathBuf::from(p)
}

/// A hand-driven connection.
struct RawStream {
    s: UnixStream,
    buf: Vec<u8>,
}

impl RawStream {
    /// Connects and reads the greeting.
    fn connect(d: &Daemon) -> (RawStream, Greeting) {
        let s = UnixStream::connect(stream_path(d)).expect("connect to the stream socket");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = RawStream { s, buf: Vec::new() };
        let g = r.recv().expect("a greeting");
        assert_eq!(g.len(), 1, "the greeting is one frame");
        (r, Greeting::decode(&g[0]).expect("a greeting frame"))
    }

    fn send(&mut self, frames: &[&[u8]]) {
        let mut out = Vec::new();
        assert!(stream::encode(frames, &mut out));
        self.s.write_all(&out).unwrap();
    }

    /// The next whole message, or `None` when the daemon closed the connection.
    fn recv(&mut self) -> Option<Vec<Vec<u8>>> {
        loop {
            if let Some(f) = stream::decode(&self.buf, &ANY).unwrap() {
                let frames = f
                    .frames
                    .iter()
                    .map(|r| self.buf[r.clone()].to_vec())
                    .collect();
                self.buf.drain(..f.consumed);
                return Some(frames);
            }
            let mut chunk = [0u8; 65536];
            match self.s.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("reading the stream socket: {e}"),
            }
        }
    }

    /// One request, its reply's id and error code.
    fn call(&mut self, frames: &[&[u8]]) -> (u64, Option<ErrorCode>, usize) {
        self.send(frames);
        let reply = self.recv().expect("a reply");
        let (id, r) = decode_reply::<serde::de::IgnoredAny>(&reply[0]).expect("a reply envelope");
        (id, r.err().map(|e| e.code), reply.len() - 1)
    }

    /// Whether the daemon closed the connection (within 10 s).
    fn closed(&mut self) -> bool {
        self.recv().is_none()
    }
}

fn stats_frame(id: u64) -> Vec<u8> {
    encode_request(id, &Request::Stats(StatsReq::default()))
}

/// The daemon answers a client with the stream transport off (over ZMQ alone).
fn answers_over_zmq(d: &Daemon) {
    let zmq_only = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_stream(false)
        .connect()
        .unwrap();
    zmq_only.stats().unwrap();
}

/// The daemon serves: over ZMQ (a client with the transport off) and over a fresh
/// stream connection.
fn still_serves(d: &Daemon) {
    answers_over_zmq(d);
    let (mut s, _) = RawStream::connect(d);
    assert_eq!(s.call(&[&stats_frame(9)]), (9, None, 0));
}

#[test]
fn hello_offers_the_transport_and_the_greeting_names_the_daemon() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let info = c
        .hello_info()
        .stream
        .expect("hello offers the stream transport");
    assert_eq!(PathBuf::from(&info.path), stream_path(&d));
    assert_eq!(info.max_frames, 65537, "one frame per key and the envelope");
    let (mut s, g) = RawStream::connect(&d);
    assert_eq!(g.incarnation, c.incarnation());
    // The same envelopes as over ZMQ, ids echoed, and hello works here too.
    assert_eq!(s.call(&[&stats_frame(41)]), (41, None, 0));
    let hello = encode_request(42, &Request::Hello(HelloReq::default()));
    assert_eq!(s.call(&[&hello]), (42, None, 0));
    // Socket file: owner only, like the ipc socket.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(stream_path(&d))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
}

#[test]
fn the_client_uses_it_for_every_op_with_zmq_as_the_fallback() {
    let d = Daemon::start(&[]);
    let probe = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_stream(false)
        .connect()
        .unwrap();
    for (map, stream) in [
        (MapPool::Always, true),
        (MapPool::Never, true), // payload frames travel on the stream
        (MapPool::Always, false),
    ] {
        let c = Client::builder()
            .with_endpoint(&d.endpoint)
            .with_map_pool(map)
            .with_stream(stream)
            .connect()
            .unwrap();
        let before = probe
            .stats()
            .unwrap()
            .stream
            .expect("stream stats")
            .accepted;
        let l = register(&c, 64).id;
        let ks = keys(u32::from(stream) + 10 * (map == MapPool::Never) as u32, 8);
        let data: Vec<Vec<u8>> = (0..8).map(|i| block(i + 100, 64 * 1024)).collect();
        let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
        assert_eq!(c.store(l, &ks, &refs).unwrap().stored(), 8);
        assert_eq!(c.lookup(l, &ks).unwrap().prefix, 8);
        let mut bufs = vec![vec![0u8; 64 * 1024]; 8];
        let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        assert_eq!(c.load(l, &ks, &mut outs).unwrap(), vec![true; 8]);
        assert!(bufs == data, "byte-identical ({map:?}, stream {stream})");
        c.delete(l, &ks).unwrap();
        let st = probe.stats().unwrap().stream.unwrap();
        if stream {
            assert!(
                st.accepted > before,
                "the client connected to the stream socket"
            );
            assert!(st.connections >= 1);
        } else {
            assert_eq!(st.accepted, before, "with the transport off, ZMQ only");
        }
        assert_eq!(st.closed_bad, 0);
    }
}

#[test]
fn bad_framing_closes_that_connection_only() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let l = register(&good, 16).id;

    // A bad envelope inside good framing is an error reply; the connection goes on.
    let (mut s, _) = RawStream::connect(&d);
    assert_eq!(
        s.call(&[b"\x00\x01garbage\xff"]).1,
        Some(ErrorCode::Malformed)
    );
    let unknown = common::frame(1, 5, "no_such_op", ());
    assert_eq!(s.call(&[&unknown]), (5, Some(ErrorCode::UnknownOp), 0));
    // Above max_envelope_bytes (4 MiB), within the frame cap (4 MiB + 64 KiB here).
    let big = vec![0x90u8; (4 << 20) + 1024];
    assert_eq!(s.call(&[&big]).1, Some(ErrorCode::TooLarge));
    assert_eq!(s.call(&[&stats_frame(6)]), (6, None, 0));
    drop(s);
    round_trip(&good, l, 1);

    // Framing that cannot be followed: the daemon closes the connection at once,
    // without waiting for (or allocating) what the prefix announced.
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("no frames", 0u32.to_le_bytes().to_vec()),
        ("too many frames", 70_000u32.to_le_bytes().to_vec()),
        (
            "a 4 GiB frame",
            [1u32.to_le_bytes(), u32::MAX.to_le_bytes()].concat(),
        ),
        (
            "a frame above the cap",
            [1u32.to_le_bytes(), (5u32 << 20).to_le_bytes()].concat(),
        ),
        ("a message above the cap (64 MiB)", {
            // 17 frames of 4 MiB: each within the frame cap, together above 64 MiB.
            let mut b = 17u32.to_le_bytes().to_vec();
            for _ in 0..17 {
                b.extend_from_slice(&(4u32 << 20).to_le_bytes());
                b.extend_from_slice(&vec![0; 4 << 20]);
            }
            b
        }),
    ];
    for (i, (what, bytes)) in cases.iter().enumerate() {
        let (mut s, _) = RawStream::connect(&d);
        let t = Instant::now();
        // (The write of the largest case fails part-way once the daemon closes.)
        let _ = s.s.write_all(bytes);
        assert!(s.closed(), "{what}: connection closed");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{what}: closed at once"
        );
        round_trip(&good, l, 10 + i as u32);
        still_serves(&d);
    }
    let st = good.stats().unwrap().stream.unwrap();
    assert_eq!(st.closed_bad, cases.len() as u64, "each violation counted");

    // Half a message, then gone: nothing changes, nothing leaks.
    let before = good.stats().unwrap();
    {
        let (mut s, _) = RawStream::connect(&d);
        let mut out = Vec::new();
        stream::encode(&[&stats_frame(7)], &mut out);
        s.s.write_all(&out[..out.len() / 2]).unwrap();
    }
    eventually(10, "the half-sent connection is gone", || {
        good.stats().unwrap().stream.unwrap().connections <= 1 // `good`'s own
    });
    let after = good.stats().unwrap();
    assert_eq!(
        (after.blocks, after.pins, after.pending),
        (before.blocks, before.pins, before.pending)
    );
    round_trip(&good, l, 20);
}

#[test]
fn a_connection_that_does_not_read_its_replies_is_closed_and_others_are_served() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let (mut s, _) = RawStream::connect(&d);
    // Requests whose replies (~1 KiB each) are never read, until the daemon gives up
    // on the connection (64 MiB unread) or 30 s pass.
    let mut batch = Vec::new();
    for i in 0..1000 {
        stream::encode(&[&stats_frame(i)], &mut batch);
    }
    // Whole messages only: a write fails only once the daemon closed the connection (a
    // timeout would be a hang, and fails the test).
    s.s.set_write_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    let mut closed = false;
    while Instant::now() < until {
        if let Err(e) = s.s.write_all(&batch) {
            assert_ne!(
                e.kind(),
                std::io::ErrorKind::WouldBlock,
                "the daemon stopped reading"
            );
            closed = true;
            break;
        }
        good.stats().unwrap(); // served meanwhile
    }
    assert!(closed, "the daemon closed the connection that never read");
    assert_eq!(good.stats().unwrap().stream.unwrap().closed_bad, 1);
    still_serves(&d);
}

#[test]
fn restart_and_busy_poll() {
    let mut d = Daemon::start(&["--busy-poll", "--keep-pool", "false"]);
    let c = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_busy_poll(true)
        .with_timeout(Duration::from_secs(10))
        .connect()
        .unwrap();
    let l = register(&c, 16).id;
    let ks = keys(3, 4);
    let data: Vec<Vec<u8>> = (0..4).map(|i| block(i, 16 * 1024)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    c.store(l, &ks, &refs).unwrap();
    for _ in 0..1000 {
        assert_eq!(c.lookup(l, &ks).unwrap().prefix, 4);
    }
    let old = c.incarnation();
    // The pooled stream connection breaks with the daemon; the next call learns of the
    // restart (as over ZMQ), and the one after works on a new connection to the new daemon.
    d.restart();
    match c.store(l, &ks, &refs) {
        Err(kvd_client::Error::DaemonRestarted { old: o, new }) => {
            assert_eq!(o, old);
            assert_ne!(new, old);
        }
        other => panic!("expected DaemonRestarted, got {other:?}"),
    }
    assert_eq!(c.store(l, &ks, &refs).unwrap().stored(), 4);
    let mut bufs = vec![vec![0u8; 16 * 1024]; 4];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l, &ks, &mut outs).unwrap(), vec![true; 4]);
    assert!(bufs == data);
    let st = c.stats().unwrap().stream.unwrap();
    assert!(
        st.accepted >= 1,
        "the new daemon's stream transport is used"
    );
}

#[test]
fn off_when_asked() {
    let d = Daemon::start(&["--stream", "false"]);
    let c = d.client();
    assert!(c.hello_info().stream.is_none());
    assert!(!stream_path(&d).exists());
    assert!(c.stats().unwrap().stream.is_none());
    register(&c, 16);
}

#[test]
fn a_failed_connect_falls_back_to_zmq_and_is_retried_later() {
    let d = Daemon::start(&[]);
    let path = stream_path(&d);
    // The daemon binds the stream socket beside its ZMQ endpoint, not before it answers,
    // and sets its mode right after binding it: a rename before that makes its start
    // fail. A ZMQ-only client's answer says the start is over.
    eventually(10, "the stream socket is bound", || path.exists());
    answers_over_zmq(&d);
    let away = path.with_extension("away");
    std::fs::rename(&path, &away).unwrap();
    let c = d.client();
    let accepted = |c: &Client| c.stats().unwrap().stream.unwrap().accepted;
    assert_eq!(accepted(&c), 0, "no stream socket to connect to: ZMQ");
    std::fs::rename(&away, &path).unwrap();
    assert_eq!(accepted(&c), 0, "ZMQ for a while after the failure");
    std::thread::sleep(kvd_client::STREAM_RETRY + Duration::from_millis(200));
    assert_eq!(accepted(&c), 1, "then the stream socket again");
}

#[test]
fn a_message_above_the_stream_cap_goes_over_zmq() {
    // 4092 payload frames of 16 KiB: 64 KiB short of the stream's 64 MiB message cap,
    // with a commit envelope (4092 keys) larger than 64 KiB: the whole message is above
    // the cap only once the envelope counts, so the client must count it at its largest.
    let d = Daemon::start(&["--pool-size", "256MiB"]);
    let c = d.client_with(MapPool::Never);
    let l = register(&c, 16).id;
    let n = 4092;
    let ks = keys(77, n);
    let data: Vec<Vec<u8>> = (0..n as u64).map(|i| block(i, 16 * 1024)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    assert_eq!(c.store(l, &ks, &refs).unwrap().stored(), n);
    assert_eq!(c.lookup(l, &ks).unwrap().prefix, n as u64);
    assert_eq!(c.stats().unwrap().stream.unwrap().closed_bad, 0);
}
