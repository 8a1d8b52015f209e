//! The data plane's tests: the real server and TCP transport on loopback.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::auth::{ClusterKey, DATA_TRAILER_BYTES};
use kvd_protocol::data::{
    check_header, crc_table, split_request, status_bytes, ALIGN, HEADER_BYTES, MAX_STATUS_MSG,
};
use kvd_protocol::{ErrorCode, Incarnation, PeerRef};

use super::*;
use crate::gate::GateLimits;
use crate::grants::{GrantKind, Grants};
use kvd_store::pool::{Pool, PoolOptions};

fn test_pool(dir: &std::path::Path, name: &str, inc: u64) -> Arc<Pool> {
    Arc::new(
        Pool::create(
            &PoolOptions {
                path: dir.join(name),
                size_bytes: 4096 + (4 << 20),
                huge_pages: false,
                prefault: false,
                group: None,
                keep: false,
            },
            Incarnation(inc),
        )
        .unwrap(),
    )
}

fn opts() -> DataOptions {
    DataOptions {
        streams: 1,
        workers: 1,
        io_timeout: Duration::from_secs(5),
        gate: GateLimits {
            max_connections: 4,
            max_pending: 4,
            max_pending_per_source: 4,
            auth_timeout: Duration::from_secs(2),
        },
        shm: false,
    }
}

fn access_to(addr: String, verify: bool) -> Access {
    Access {
        peer: PeerRef {
            node: "exporter".into(),
            data: addr,
            incarnation: Incarnation(2),
            host: String::new(),
            shm: None,
            rdma: None,
        },
        handle: 1,
        token: 77,
        verify,
    }
}

/// A transport from a fresh pool in `dir` (incarnation 1).
fn transport(dir: &std::path::Path) -> TcpTransport {
    TcpTransport::new(test_pool(dir, "l", 1), Incarnation(1), key(), &opts())
}

fn key() -> ClusterKey {
    ClusterKey::from_secret(b"a test secret of thirty-two bytes!!").unwrap()
}

/// Checked reads of ranges below, at and above the piece size, through the real data
/// server: every byte arrives and every CRC matches (pieces and remainders included).
#[test]
fn checked_reads_of_every_range_size_arrive_whole() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (local, remote) = (test_pool(dir.path(), "l", 1), test_pool(dir.path(), "r", 2));
    let bytes: Vec<u8> = (0..(3u32 << 20) + 12345)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    remote.write(4096, &bytes).unwrap();
    let grants = Arc::new(Grants::new(Incarnation(2)));
    grants.insert(
        1,
        77,
        GrantKind::Read,
        &[(4096, bytes.len() as u64)],
        Instant::now() + Duration::from_secs(30),
    );
    let server =
        DataServer::start("127.0.0.1:0", remote, grants, key(), (None, None), &opts()).unwrap();
    let t = TcpTransport::new(local.clone(), Incarnation(1), key(), &opts());
    let a = access_to(server.addr().to_string(), true);
    for len in [
        4096u64,
        CRC_PIECE,
        CRC_PIECE + 1,
        2 * CRC_PIECE + 7,
        bytes.len() as u64,
    ] {
        let ops = [Op {
            remote: 4096,
            local: 4096,
            len,
            crc: None,
        }];
        assert_eq!(t.read(&a, &ops).unwrap(), len);
        assert_eq!(
            local.read(4096, len as usize).unwrap(),
            &bytes[..len as usize]
        );
        local.write(4096, &vec![0u8; len as usize]).unwrap();
    }
}

/// A peer whose bytes do not match the CRC it sends (damage on the way) fails the
/// read, for a range sent whole and one checked in pieces.
#[test]
fn a_checksum_mismatch_fails_the_read() {
    for len in [64u64 << 10, CRC_PIECE * 2 + 5] {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let local = test_pool(dir.path(), "l", 1);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let fake = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut hdr = [0u8; HEADER_BYTES];
            c.read_exact(&mut hdr).unwrap();
            let (_, _, rest) = check_header(&hdr).unwrap();
            c.read_exact(&mut vec![0u8; rest]).unwrap();
            let body = vec![3u8; len as usize];
            let wrong = kvd_store::checksum::crc32c(&body) ^ 1;
            c.write_all(&status_bytes(None)).unwrap();
            c.write_all(&body).unwrap();
            c.write_all(&crc_table(&[wrong])).unwrap();
            let _ = c.read(&mut [0u8; 1]); // until the reader lets go
        });
        let t = TcpTransport::new(local, Incarnation(1), key(), &opts());
        let e = t
            .read(
                &access_to(addr, true),
                &[Op {
                    remote: 4096,
                    local: 4096,
                    len,
                    crc: None,
                }],
            )
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::TransferFailed, "{e}");
        assert!(e.message.contains("checksum mismatch"), "{e}");
        drop(t);
        fake.join().unwrap();
    }
}

/// Every part of the wire around block bytes is a multiple of 64 bytes (what keeps the
/// bytes cache-line aligned in the stream), with SPEC's vector.
#[test]
fn everything_around_the_bytes_is_padded_to_64() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let t = transport(dir.path());
    for n in 1..=9u64 {
        let ops: Vec<Op> = (0..n).map(|i| op(i << 20, i << 20, 4096)).collect();
        for verify in [false, true] {
            let req = t.request(Dir::Read, &access_to(String::new(), verify), &ops);
            assert_eq!(req.len() % ALIGN, 0, "{n} ranges");
            let hdr: &[u8; HEADER_BYTES] = req[..HEADER_BYTES].try_into().unwrap();
            let (_, _, rest) = check_header(hdr).unwrap();
            assert_eq!(HEADER_BYTES + rest, req.len(), "the server reads it all");
            let (head, trailer) = split_request(&req).unwrap();
            assert_eq!(head.len(), HEADER_BYTES + 16 * n as usize);
            assert_eq!(trailer.len(), DATA_TRAILER_BYTES);
        }
        assert_eq!(crc_table(&vec![7; n as usize]).len() % ALIGN, 0);
    }
    let one = t.request(
        Dir::Read,
        &access_to(String::new(), false),
        &[op(4096, 0, 8192)],
    );
    assert_eq!(one.len(), 128, "SPEC's vector");
    assert!(one[112..].iter().all(|&b| b == 0));
    assert_eq!(status_bytes(None), vec![0u8; 64], "SPEC's vector");
    assert_eq!(crc_table(&[1, 2, 3]).len(), 64);
    for msg in ["x", &"long ".repeat(2000)] {
        let b = status_bytes(Some(&WireError::new(ErrorCode::NotOwner, msg)));
        assert_eq!(b.len() % ALIGN, 0);
        let len = u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize;
        assert!(len <= MAX_STATUS_MSG && len > 0);
        assert!(matches!(read_status(&mut &b[..]), Err(Ok(e)) if e.code == ErrorCode::NotOwner));
    }
}

/// Padding that is not zeros: the server refuses the request (and closes), the reader
/// refuses the status; neither reads on as if it were something else.
#[test]
fn padding_that_is_not_zeros_is_refused() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (local, remote) = (test_pool(dir.path(), "l", 1), test_pool(dir.path(), "r", 2));
    let grants = Arc::new(Grants::new(Incarnation(2)));
    grants.insert(
        1,
        77,
        GrantKind::Read,
        &[(4096, 8192)],
        Instant::now() + Duration::from_secs(30),
    );
    let server =
        DataServer::start("127.0.0.1:0", remote, grants, key(), (None, None), &opts()).unwrap();
    let t = TcpTransport::new(local, Incarnation(1), key(), &opts());
    let a = access_to(server.addr().to_string(), false);
    let ask = |req: &[u8]| {
        let mut s = TcpStream::connect(server.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(req).unwrap();
        (read_status(&mut s), s)
    };
    let good = t.request(Dir::Read, &a, &[op(4096, 0, 8192)]);
    let (r, mut s) = ask(&good);
    assert!(r.is_ok(), "the unaltered request is served");
    s.read_exact(&mut [0u8; 8192]).unwrap();
    let mut bad = t.request(Dir::Read, &a, &[op(4096, 0, 8192)]);
    *bad.last_mut().unwrap() = 1;
    let (r, mut s) = ask(&bad);
    assert!(
        matches!(&r, Err(Ok(e)) if e.code == ErrorCode::Malformed),
        "{r:?}"
    );
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "nothing follows the refusal: the connection is closed"
    );

    for (at, v) in [(1usize, 1u8), (0, 2), (63, 9), (4, 1)] {
        let mut st = status_bytes(None);
        st[at] = v;
        assert!(
            matches!(read_status(&mut &st[..]), Err(Err(_))),
            "status with byte {at} = {v}"
        );
    }
    let mut long = status_bytes(Some(&WireError::new(ErrorCode::NotOwner, "x")));
    long[4..8].copy_from_slice(&(MAX_STATUS_MSG as u32 + 1).to_le_bytes());
    assert!(matches!(read_status(&mut &long[..]), Err(Err(_))));
}

fn op(r: u64, l: u64, n: u64) -> Op {
    Op::new(r, l, n)
}

#[test]
fn coalesces_only_when_both_sides_continue() {
    let ops = [
        op(0, 100, 10),
        op(10, 110, 10),
        op(20, 200, 10),
        op(40, 210, 10),
    ];
    assert_eq!(
        coalesce(&ops),
        vec![op(0, 100, 20), op(20, 200, 10), op(40, 210, 10)]
    );
}

#[test]
fn split_covers_every_byte_once() {
    let ops = [op(0, 0, 3 << 20), op(10 << 20, 5 << 20, 1 << 20)];
    for streams in 1..6 {
        let groups = split(&ops, streams);
        assert!(groups.len() <= streams);
        let mut all: Vec<Op> = groups.concat();
        all.sort_by_key(|o| o.remote);
        assert_eq!(coalesce(&all), ops.to_vec(), "streams {streams}");
    }
    assert_eq!(split(&[op(0, 0, 4096)], 4).len(), 1);
    assert_eq!(split(&[op(0, 0, 4 << 20)], 4).len(), 1);
    assert_eq!(split(&[op(0, 0, 16 << 20)], 4).len(), 4);
}

/// SPEC §10 "Data plane (TCP)", as implemented from the text (issue 32, 5.5): a
/// grant is the union of its slots (a range over two adjacent slots is served); the
/// bytes of a read are not padded, only the CRC table is (from its own first byte:
/// one 100-byte checked range is 64 + 100 + 4 + 60 = 228 bytes, unchecked 164); a
/// refused read leaves the connection open, a request with a bad MAC closes it.
#[test]
fn reads_are_framed_and_refused_as_the_spec_says() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (local, remote) = (test_pool(dir.path(), "l", 1), test_pool(dir.path(), "r", 2));
    let bytes: Vec<u8> = (0..128u8).collect();
    remote.write(4096, &bytes).unwrap();
    let grants = Arc::new(Grants::new(Incarnation(2)));
    // two adjacent 64-byte slots
    grants.insert(
        1,
        77,
        GrantKind::Read,
        &[(4096, 64), (4160, 64)],
        Instant::now() + Duration::from_secs(30),
    );
    let server =
        DataServer::start("127.0.0.1:0", remote, grants, key(), (None, None), &opts()).unwrap();
    let t = TcpTransport::new(local, Incarnation(1), key(), &opts());
    let at = server.addr().to_string();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let answer = |s: &mut TcpStream, req: &[u8], len: usize| {
        s.write_all(req).unwrap();
        let mut got = vec![0u8; len];
        s.read_exact(&mut got).unwrap();
        got
    };
    let checked = t.request(Dir::Read, &access_to(at.clone(), true), &[op(4096, 0, 100)]);
    let got = answer(&mut s, &checked, 228);
    assert_eq!(&got[..64], &status_bytes(None)[..], "ok status");
    assert_eq!(&got[64..164], &bytes[..100], "the bytes, over both slots");
    let crc = kvd_store::checksum::crc32c_append(0, &bytes[..100]);
    assert_eq!(&got[164..168], &crc.to_le_bytes());
    assert!(got[168..].iter().all(|&b| b == 0), "60 bytes of padding");
    // the same connection: an unchecked read, nothing after its bytes
    let plain = t.request(
        Dir::Read,
        &access_to(at.clone(), false),
        &[op(4100, 0, 100)],
    );
    let got = answer(&mut s, &plain, 164);
    assert_eq!(&got[64..], &bytes[4..104]);
    // a range past the grant is refused; the connection stays open for the next
    let outside = t.request(Dir::Read, &access_to(at.clone(), false), &[op(4160, 0, 65)]);
    s.write_all(&outside).unwrap();
    let e = read_status(&mut s).expect_err("a range past the grant is refused");
    assert!(
        matches!(e, Ok(ref e) if e.code == ErrorCode::InvalidArgument),
        "{e:?}"
    );
    // (a new request: the same one again would be a replay)
    let again = t.request(
        Dir::Read,
        &access_to(at.clone(), false),
        &[op(4100, 0, 100)],
    );
    let got = answer(&mut s, &again, 164);
    assert_eq!(&got[64..], &bytes[4..104], "served after the refusal");
    // a request signed for another data server is refused and the connection closed
    let mut elsewhere = access_to(at.clone(), false);
    elsewhere.peer.data = "10.9.9.9:7102".into();
    s.write_all(&t.request(Dir::Read, &elsewhere, &[op(4096, 0, 64)]))
        .unwrap();
    let e = read_status(&mut s).expect_err("addressed to another server");
    assert!(
        matches!(e, Ok(ref e) if e.code == ErrorCode::Unauthenticated),
        "{e:?}"
    );
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "closed after the refusal");
}

/// A write grant (handle 1, token 77) over `len` bytes at 4096 of `remote`, its data
/// server, and a transport from `local`.
fn write_grant(
    local: &Arc<Pool>,
    remote: &Arc<Pool>,
    len: u64,
) -> (Arc<Grants>, DataServer, TcpTransport) {
    let grants = Arc::new(Grants::new(Incarnation(2)));
    grants.insert(
        1,
        77,
        GrantKind::Write,
        &[(4096, len)],
        Instant::now() + Duration::from_secs(30),
    );
    let server = DataServer::start(
        "127.0.0.1:0",
        remote.clone(),
        grants.clone(),
        key(),
        (None, None),
        &opts(),
    )
    .unwrap();
    let t = TcpTransport::new(local.clone(), Incarnation(1), key(), &opts());
    (grants, server, t)
}

/// A checked write through the real server and transport (SPEC §10, version 4): every
/// range's bytes land, and each whole range is recorded with the CRC it matched, the
/// writer checksum an op carried or the writer's own copy's; a slot written over since
/// (unchecked) has none, so an import would commit its blocks without checksums.
#[test]
fn checked_writes_land_and_record_what_they_matched() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (local, remote) = (test_pool(dir.path(), "l", 1), test_pool(dir.path(), "r", 2));
    let block = 64u64 << 10;
    let bytes: Vec<u8> = (0..3 * block as u32)
        .map(|i| (i * 13 % 251) as u8)
        .collect();
    local.write(4096, &bytes).unwrap();
    let (grants, server, t) = write_grant(&local, &remote, 3 * block);
    let a = access_to(server.addr().to_string(), true);
    let crc = |i: u64| {
        kvd_store::checksum::crc32c(&bytes[(i * block) as usize..((i + 1) * block) as usize])
    };
    // block 0 and 1 carry their writer checksums, block 2 none (its copy's is sent)
    let ops: Vec<Op> = (0..3)
        .map(|i| Op {
            crc: (i < 2).then(|| crc(i)),
            ..op(4096 + i * block, 4096 + i * block, block)
        })
        .collect();
    assert_eq!(t.write(&a, &ops).unwrap(), 3 * block);
    assert_eq!(remote.read(4096, bytes.len()).unwrap(), &bytes[..]);
    let slots: Vec<(u64, u64)> = (0..3).map(|i| (4096 + i * block, block)).collect();
    assert_eq!(
        grants.written_crcs(1, &slots),
        Some(vec![crc(0), crc(1), crc(2)])
    );
    // Checked ranges that tile a span join into its CRC (a layer-wise push's parts).
    assert_eq!(
        grants.written_crcs(1, &[(4096, 2 * block)]),
        Some(vec![kvd_store::checksum::crc32c(
            &bytes[..2 * block as usize]
        )]),
    );
    assert_eq!(
        grants.written_crcs(1, &[(4096 + 64, block)]),
        None,
        "not where a checked range starts"
    );
    assert_eq!(grants.damaged(), 0);
    // an unchecked write over half of block 1 forgets its record
    let plain = access_to(server.addr().to_string(), false);
    t.write(&plain, &[op(4096 + block + 64, 4096 + block + 64, 64)])
        .unwrap();
    assert_eq!(grants.written_crcs(1, &slots[..1]), Some(vec![crc(0)]));
    assert_eq!(grants.written_crcs(1, &slots), None);
}

/// A checked write whose bytes do not match the CRC the writer sent (a block damaged in
/// the writer's pool after its writer computed its checksum) is refused: the writer
/// hears why, the bytes do not count as written (the grant never fills, so no import
/// commits them), and the refusal is counted.
#[test]
fn a_checked_write_that_does_not_match_is_refused_and_not_counted() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (local, remote) = (test_pool(dir.path(), "l", 1), test_pool(dir.path(), "r", 2));
    let block = 64u64 << 10;
    let bytes = vec![9u8; block as usize];
    local.write(4096, &bytes).unwrap();
    let (grants, server, t) = write_grant(&local, &remote, block);
    let a = access_to(server.addr().to_string(), true);
    let writer = kvd_store::checksum::crc32c(&bytes);
    local.write(4096 + 100, &[8]).unwrap(); // the flip, after the writer's checksum
    let e = t
        .write(
            &a,
            &[Op {
                crc: Some(writer),
                ..op(4096, 4096, block)
            }],
        )
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::TransferFailed, "{e}");
    assert!(
        e.message
            .contains("checksum mismatch writing the range at 4096"),
        "{e}"
    );
    assert_eq!(grants.bytes(1), 0, "a refused write moved nothing");
    assert!(!grants.is_filled(1));
    assert_eq!(grants.written_crcs(1, &[(4096, block)]), None);
    assert_eq!(grants.damaged(), 1);
    // the negative control: the same bytes with their own checksum go through
    let own = Op {
        crc: Some(kvd_store::checksum::crc32c(
            local.read(4096, block as usize).unwrap(),
        )),
        ..op(4096, 4096, block)
    };
    assert_eq!(t.write(&a, &[own]).unwrap(), block);
    assert!(grants.is_filled(1));
}

/// Ops with writer checksums are never merged or cut: each stays one range, so its
/// checksum still names exactly its bytes.
#[test]
fn ops_with_writer_checksums_stay_whole() {
    let big = 8u64 << 20;
    let ops = [
        Op {
            crc: Some(1),
            ..op(0, 0, big)
        },
        Op {
            crc: Some(2),
            ..op(big, big, big)
        },
        op(2 * big, 2 * big, 10),
        op(2 * big + 10, 2 * big + 10, 10),
    ];
    assert_eq!(
        coalesce(&ops),
        vec![ops[0], ops[1], op(2 * big, 2 * big, 20)]
    );
    for streams in 1..5 {
        let all: Vec<Op> = split(&ops, streams).concat();
        for o in &ops[..2] {
            assert!(all.contains(o), "streams {streams}: {o:?} was cut");
        }
    }
}

/// A version-3 write with the crc flag is refused (its table would be read as the next
/// request), and a version-4 header is what a checked write sends.
#[test]
fn a_checked_write_needs_version_4() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let t = transport(dir.path());
    let a = access_to("127.0.0.1:1".into(), true);
    let mut req = t.request(Dir::Write, &a, &[op(4096, 4096, 100)]);
    assert_eq!(
        (req.len(), req[4]),
        (128, 4),
        "SPEC §10's checked-write vector"
    );
    req[4] = 3;
    let hdr: [u8; HEADER_BYTES] = req[..HEADER_BYTES].try_into().unwrap();
    assert_eq!(check_header(&hdr).unwrap_err().code, ErrorCode::Malformed);
    let r = t.request(Dir::Read, &a, &[op(4096, 4096, 100)]);
    assert_eq!(r[4], 3, "a read still goes as version 3");
}
