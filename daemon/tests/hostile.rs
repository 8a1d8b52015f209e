//! Hostile input against the real daemon: every bad message gets an error reply with the
//! right code, a second well-behaved client keeps being served throughout, and nothing
//! leaks (stats return to baseline).

mod common;

use common::*;
use kvd_client::Client;
use kvd_protocol::*;
use serde::Serialize;

/// A peer nobody knows (its endpoints lead nowhere).
fn stranger() -> PeerRef {
    PeerRef {
        node: "tcp://127.0.0.1:9".into(),
        data: "127.0.0.1:9".into(),
        incarnation: Incarnation(77),
        host: String::new(),
        shm: None,
        rdma: None,
    }
}

#[test]
fn every_bad_message_gets_an_error_and_others_keep_being_served() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let l = register(&good, 16).id;
    let base = good.stats().unwrap();
    let bad = Raw::new(&d.endpoint, zmq::DEALER);
    let hello = encode_request(1, &Request::Hello(HelloReq::default()));
    let mut seed = 0u32;
    let mut check =
        |(id, code): (u64, Option<ErrorCode>), want_id: u64, want: ErrorCode, what: &str| {
            assert_eq!(code, Some(want), "{what}");
            assert_eq!(id, want_id, "{what}: request id echoed");
            seed += 1;
            round_trip(&good, l, seed);
        };

    check(
        bad.call(&[b"\x00\x01garbage\xff"]),
        0,
        ErrorCode::Malformed,
        "garbage bytes",
    );
    check(
        bad.call(&[&hello[..hello.len() - 3]]),
        0,
        ErrorCode::Malformed,
        "truncated msgpack",
    );
    check(bad.call(&[b""]), 0, ErrorCode::Malformed, "empty frame");
    check(
        bad.call(&[&frame(2, 11, "hello", ())]),
        11,
        ErrorCode::UnsupportedVersion,
        "wrong version",
    );
    check(
        bad.call(&[&frame(1, 12, "format_disk", ())]),
        12,
        ErrorCode::UnknownOp,
        "unknown op",
    );
    #[derive(Serialize)]
    struct BadLookup<'a> {
        layout_id: &'a str,
        keys: Vec<u8>,
    }
    let wrong_types = frame(
        1,
        13,
        "lookup",
        BadLookup {
            layout_id: "x",
            keys: vec![1],
        },
    );
    check(
        bad.call(&[&wrong_types]),
        13,
        ErrorCode::InvalidArgument,
        "wrong field types",
    );
    #[derive(Serialize)]
    struct ShortKey {
        layout_id: u64,
        keys: Vec<serde_bytes::ByteBuf>,
    }
    let short = frame(
        1,
        14,
        "lookup",
        ShortKey {
            layout_id: l.0,
            keys: vec![serde_bytes::ByteBuf::from(vec![1u8; 15])],
        },
    );
    check(
        bad.call(&[&short]),
        14,
        ErrorCode::InvalidArgument,
        "15-byte key",
    );
    check(
        bad.call(&[&frame(1, 15, "lookup", ())]),
        15,
        ErrorCode::InvalidArgument,
        "missing body",
    );

    // huge declared lengths: an array of 2^32-1 keys and a 4 GiB bin, in small frames
    let mut huge = frame(
        1,
        16,
        "lookup",
        ShortKey {
            layout_id: l.0,
            keys: vec![],
        },
    );
    let n = huge.len();
    huge.truncate(n - 1); // drop the empty array marker (0x90)
    huge.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0xc4, 0x10]);
    let (_, code) = bad.call(&[&huge]);
    assert!(
        matches!(
            code,
            Some(ErrorCode::Malformed | ErrorCode::InvalidArgument)
        ),
        "{code:?}"
    );
    huge.truncate(n - 1);
    huge.extend_from_slice(&[0x91, 0xc6, 0xff, 0xff, 0xff, 0xff, 0, 0]);
    let (_, code) = bad.call(&[&huge]);
    assert!(
        matches!(
            code,
            Some(ErrorCode::Malformed | ErrorCode::InvalidArgument)
        ),
        "{code:?}"
    );

    // too many keys, and an envelope over the limit (4 MiB) but under the hard cap
    let many = encode_request(
        17,
        &Request::Lookup(LookupReq {
            layout_id: l,
            keys: vec![ChunkHash([1; 16]); 65537],
            no_prefetch: false,
            local_only: false,
            client: None,
        }),
    );
    check(bad.call(&[&many]), 17, ErrorCode::TooLarge, "too many keys");
    let mut big = encode_request(18, &Request::Stats(StatsReq::default()));
    big.resize((4 << 20) + 1000, 0);
    check(
        bad.call(&[&big]),
        18,
        ErrorCode::TooLarge,
        "oversized envelope",
    );
    check(
        bad.call(&[
            &encode_request(19, &Request::Stats(StatsReq::default())),
            b"payload",
        ]),
        19,
        ErrorCode::InvalidArgument,
        "payload on stats",
    );

    // a session of its own, for the stateful abuse
    let sess = Client::connect(&d.endpoint).unwrap();
    let info = register(&sess, 16);
    let sl = info.id;
    assert_eq!(sl, l);
    let hello = Raw::new(&d.endpoint, zmq::DEALER);
    hello.send(&[&encode_request(20, &Request::Hello(HelloReq::default()))]);
    let parts = hello.sock.recv_multipart(0).unwrap();
    let me: HelloResp = decode_reply::<HelloResp>(&parts[0]).unwrap().1.unwrap();
    let ks = keys(900, 2);
    let alloc = encode_request(
        21,
        &Request::Alloc(AllocReq {
            client: me.client,
            layout_id: l,
            keys: ks.clone(),
        }),
    );
    let parts = {
        hello.send(&[&alloc]);
        hello.sock.recv_multipart(0).unwrap()
    };
    let a: AllocResp = decode_reply::<AllocResp>(&parts[0]).unwrap().1.unwrap();
    let offs: Vec<u64> = a.offsets.iter().map(|o| o.unwrap()).collect();
    let commit_crcs = |id, offsets: Option<Vec<u64>>, crcs: Option<Vec<u32>>| {
        encode_request(
            id,
            &Request::Commit(CommitReq {
                client: me.client,
                layout_id: l,
                keys: ks.clone(),
                offsets,
                crcs,
            }),
        )
    };
    let commit = |id, offsets: Option<Vec<u64>>| commit_crcs(id, offsets, None);
    check(
        hello.call(&[&commit(22, Some(vec![me.pool.size_bytes + 4096, offs[1]]))]),
        22,
        ErrorCode::InvalidArgument,
        "offset beyond the pool",
    );
    check(
        hello.call(&[&commit(23, Some(vec![offs[1], offs[0]]))]),
        23,
        ErrorCode::InvalidArgument,
        "offsets swapped",
    );
    check(
        hello.call(&[&commit(24, None), b"short", b"short"]),
        24,
        ErrorCode::InvalidArgument,
        "payload of the wrong size",
    );
    check(
        hello.call(&[&commit_crcs(241, Some(offs.clone()), Some(vec![1]))]),
        241,
        ErrorCode::InvalidArgument,
        "one crc for two keys",
    );
    let block = vec![7u8; info.block_bytes as usize];
    let right = kvd_client::checksum::crc32c(&block);
    check(
        hello.call(&[
            &commit_crcs(242, None, Some(vec![right, right ^ 1])),
            &block,
            &block,
        ]),
        242,
        ErrorCode::InvalidArgument,
        "a payload frame that does not match its crc (damaged on the way)",
    );
    let other = encode_request(
        25,
        &Request::Commit(CommitReq {
            client: ClientId(me.client.0 ^ 1),
            layout_id: l,
            keys: ks.clone(),
            offsets: None,
            crcs: None,
        }),
    );
    check(
        hello.call(&[&other]),
        25,
        ErrorCode::UnknownClient,
        "forged client id",
    );
    assert_eq!(
        hello.call(&[&commit(26, Some(offs.clone()))]),
        (26, None),
        "the real commit still works"
    );
    check(
        hello.call(&[&commit(27, Some(offs))]),
        27,
        ErrorCode::InvalidState,
        "double commit",
    );
    // release of a pin that is not yours
    let pinned = sess.get(l, &ks, None).unwrap();
    let pin = pinned.pin().unwrap();
    let rel = encode_request(
        28,
        &Request::Release(ReleaseReq {
            client: me.client,
            pins: vec![pin],
        }),
    );
    check(
        hello.call(&[&rel]),
        28,
        ErrorCode::NotOwner,
        "someone else's pin",
    );
    let rel = encode_request(
        29,
        &Request::Release(ReleaseReq {
            client: me.client,
            pins: vec![PinId(1)],
        }),
    );
    check(
        hello.call(&[&rel]),
        29,
        ErrorCode::UnknownPin,
        "a pin that never existed",
    );
    assert!(
        pinned.with_block(0, |_| ()).unwrap().is_some(),
        "the pin survived the forged release"
    );
    pinned.release().unwrap();
    let unknown_layout = encode_request(
        30,
        &Request::Alloc(AllocReq {
            client: me.client,
            layout_id: LayoutId(1),
            keys: ks.clone(),
        }),
    );
    check(
        hello.call(&[&unknown_layout]),
        30,
        ErrorCode::UnknownLayout,
        "unknown layout",
    );
    let del = encode_request(
        31,
        &Request::Delete(DeleteReq {
            client: me.client,
            layout_id: l,
            keys: ks.clone(),
        }),
    );
    assert_eq!(hello.call(&[&del]).1, None);

    // a REQ socket (with its empty delimiter frame) is served too
    let req = Raw::new(&d.endpoint, zmq::REQ);
    assert_eq!(
        req.call(&[&encode_request(32, &Request::Stats(StatsReq::default()))]),
        (32, None)
    );

    // a frame over the hard cap: ZMQ drops that connection; everyone else is served
    let brute = Raw::new(&d.endpoint, zmq::DEALER);
    brute.sock.set_rcvtimeo(1000).unwrap();
    brute.send(&[&vec![0u8; 6 << 20]]);
    assert!(
        brute.sock.recv_multipart(0).is_err(),
        "no reply to a frame over the hard cap"
    );
    seed += 1;
    round_trip(&good, l, seed);

    let st = good.stats().unwrap();
    assert_eq!(st.pins, 0);
    assert_eq!(st.pending, 0);
    assert_eq!(st.pool.used_bytes, base.pool.used_bytes, "no pool leak");
    assert_eq!(st.blocks, base.blocks, "no block leak");
    for code in [
        "malformed",
        "unsupported_version",
        "unknown_op",
        "invalid_argument",
        "too_large",
        "unknown_client",
        "not_owner",
        "unknown_pin",
        "invalid_state",
        "unknown_layout",
    ] {
        assert!(
            st.errors.get(code).copied().unwrap_or(0) > 0,
            "errors[{code}] counted: {:?}",
            st.errors
        );
    }
}

#[test]
fn a_flood_from_one_client_does_not_starve_another() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let l = register(&good, 16).id;
    let base = good.stats().unwrap();
    let flood = Raw::new(&d.endpoint, zmq::DEALER);
    const N: u64 = 10_000;
    let ks: Vec<ChunkHash> = keys(1, 64);
    // 10k requests, sent without reading a reply: lookups, stats and garbage
    let sender = {
        let frames: Vec<Vec<u8>> = (0..N)
            .map(|i| match i % 3 {
                0 => encode_request(
                    i,
                    &Request::Lookup(LookupReq {
                        layout_id: l,
                        keys: ks.clone(),
                        no_prefetch: false,
                        local_only: false,
                        client: None,
                    }),
                ),
                1 => encode_request(i, &Request::Stats(StatsReq::default())),
                _ => frame(1, i, "nonsense", ()),
            })
            .collect();
        for f in &frames {
            flood.send(&[f]);
        }
        frames.len()
    };
    assert_eq!(sender as u64, N);
    // meanwhile the other client is served
    for s in 0..20 {
        round_trip(&good, l, 10_000 + s);
    }
    // every flood request is answered, in order, with the right outcome
    for i in 0..N {
        let (id, code, _) = flood.recv();
        assert_eq!(id, i);
        assert_eq!(
            code,
            if i % 3 == 2 {
                Some(ErrorCode::UnknownOp)
            } else {
                None
            }
        );
    }
    let st = good.stats().unwrap();
    assert_eq!(
        (st.pins, st.pending, st.pool.used_bytes),
        (0, 0, base.pool.used_bytes)
    );
    assert!(st.requests >= N);
    assert_eq!(st.dropped_replies, 0);
}

/// Transfer and daemon-to-daemon ops with bad, stale or forged contents: each gets a clear
/// error, nothing is left behind, and the daemon keeps serving.
#[test]
fn bad_transfer_and_peer_messages_are_refused() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let l = register(&good, 16).id;
    let me = good.hello_info().node.expect("transfers are on by default");
    let raw = Raw::new(&d.endpoint, zmq::DEALER);
    let client = good.hello_info().client;
    let stranger = stranger();
    let ks = keys(900, 2);
    // peer ops go, signed, to the control endpoint; client ops to the client endpoint
    let peer = PeerRaw::new(&me.node, Some(cluster_key()));
    let mut id = 0;
    let mut call = |op: &str, body: &dyn erased::Body| {
        id += 1;
        if op.starts_with("peer_") {
            peer.call(&body.frame(id, op)).1
        } else {
            raw.call(&[&body.frame(id, op)]).1
        }
    };
    // a restarted (or forged) peer's view of our incarnation
    let hb = PeerHeartbeatReq {
        from: stranger.clone(),
        to_incarnation: Incarnation(me.incarnation.0 ^ 1),
        transfers: vec!["t".into()],
    };
    assert_eq!(
        call("peer_heartbeat", &hb),
        Some(ErrorCode::StaleIncarnation)
    );
    // 0 is accepted only as a first contact (push registration)
    let hb0 = PeerHeartbeatReq {
        to_incarnation: Incarnation(0),
        ..hb.clone()
    };
    assert_eq!(
        call("peer_heartbeat", &hb0),
        Some(ErrorCode::StaleIncarnation)
    );
    // heartbeats for transfers we do not hold: answered, listed as unknown (not an error)
    let hb_ok = PeerHeartbeatReq {
        to_incarnation: me.incarnation,
        ..hb
    };
    assert_eq!(call("peer_heartbeat", &hb_ok), None);
    let done = PeerDoneReq {
        from: stranger.clone(),
        to_incarnation: me.incarnation,
        transfer_id: "nope".into(),
        handle: 1,
        token: 0,
    };
    assert_eq!(call("peer_done", &done), Some(ErrorCode::UnknownTransfer));
    let fail = PeerFailReq {
        from: stranger.clone(),
        to_incarnation: me.incarnation,
        transfer_id: "nope".into(),
        error: WireError::new(ErrorCode::Aborted, "x"),
        proof: None,
    };
    assert_eq!(call("peer_fail", &fail), Some(ErrorCode::UnknownTransfer));
    let pushed = PeerPushDoneReq {
        from: stranger.clone(),
        to_incarnation: me.incarnation,
        transfer_id: "nope".into(),
        handle: 1,
        bytes: 1 << 40,
    };
    assert_eq!(
        call("peer_push_done", &pushed),
        Some(ErrorCode::UnknownTransfer)
    );
    let mut reg = PeerPushRegReq {
        from: stranger.clone(),
        to_incarnation: Incarnation(0),
        transfer_id: "r1".into(),
        layout_id: l,
        keys: ks.clone(),
        offsets: vec![Some(4096)],
        handle: 5,
        token: 6,
        // long enough that the repeat below still finds it live on a loaded machine
        lease_ms: 2000,
    };
    assert_eq!(
        call("peer_push_reg", &reg),
        Some(ErrorCode::InvalidArgument)
    );
    reg.offsets = vec![Some(4096), None];
    reg.transfer_id = "x".repeat(200);
    assert_eq!(
        call("peer_push_reg", &reg),
        Some(ErrorCode::InvalidArgument)
    );
    reg.transfer_id = "r1".into();
    assert_eq!(call("peer_push_reg", &reg), None);
    assert_eq!(call("peer_push_reg", &reg), Some(ErrorCode::InvalidState));
    let rc = PeerRdmaConnectReq {
        from: stranger.clone(),
        to_incarnation: me.incarnation,
        qpn: 1,
        psn: 2,
    };
    assert_eq!(
        call("peer_rdma_connect", &rc),
        Some(ErrorCode::InvalidState)
    );
    // Per-grant RDMA registration reaches its handler (sealed) and, without a device,
    // registers nothing.
    let rr = PeerRdmaRegisterReq {
        from: stranger.clone(),
        to_incarnation: me.incarnation,
        handle: 1,
        token: 2,
        write: true,
    };
    assert_eq!(
        call("peer_rdma_register", &rr),
        Some(ErrorCode::InvalidState)
    );
    // client ops: wrong shapes and unknown names
    let bad_export = ExportReq {
        client,
        transfer_id: "e".into(),
        layout_id: l,
        keys: ks.clone(),
        lease_ms: None,
        parts: None,
        staged: false,
    };
    assert_eq!(call("export", &bad_export), Some(ErrorCode::InvalidState)); // not stored
    let params = TransferParams {
        from: stranger.clone(),
        transfer_id: "p".into(),
        handle: 1,
        token: 2,
        layout_id: l,
        block_bytes: 16 * 1024,
        keys: ks.clone(),
        offsets: vec![4096],
        lease_ms: 1000,
        expires_unix_ms: 0,
        crcs: Vec::new(),
    };
    // One writer checksum too many (SPEC §17): refused before anything is asked of a peer.
    let miscounted = TransferParams {
        offsets: vec![4096; ks.len()],
        crcs: vec![Some(1); ks.len() + 1],
        ..params.clone()
    };
    let pull = PullReq {
        client,
        params: miscounted,
        ttl_ms: None,
        wait: true,
        defer: false,
    };
    assert_eq!(call("pull", &pull), Some(ErrorCode::InvalidArgument));
    let pull = PullReq {
        client,
        params,
        ttl_ms: None,
        wait: true,
        defer: false,
    };
    assert_eq!(call("pull", &pull), Some(ErrorCode::InvalidArgument));
    let st = TransferStatusReq {
        client,
        transfer_id: "nope".into(),
        wait_ms: 0,
        parts_wait: None,
    };
    assert_eq!(
        call("transfer_status", &st),
        Some(ErrorCode::UnknownTransfer)
    );
    assert_eq!(
        call("export", &"not a map"),
        Some(ErrorCode::InvalidArgument)
    );
    // Layer-wise (SPEC §16): a `ready` of the wrong type, parts beyond the layers, a
    // staged export of a layout nobody registered, `export_ready` of nothing.
    #[derive(serde::Serialize)]
    struct BadReady<'a> {
        client: ClientId,
        transfer_id: &'a str,
        ready: &'a str,
    }
    let bad = BadReady {
        client,
        transfer_id: "e",
        ready: "all of them",
    };
    assert_eq!(call("export_ready", &bad), Some(ErrorCode::InvalidArgument));
    let too_many = ExportReq {
        parts: Some(1 << 40),
        staged: true,
        transfer_id: "lw".into(),
        ..bad_export.clone()
    };
    assert_eq!(call("export", &too_many), Some(ErrorCode::InvalidArgument));
    let unknown_layout = ExportReq {
        layout_id: LayoutId(0xdead),
        parts: Some(2),
        ..too_many.clone()
    };
    assert_eq!(
        call("export", &unknown_layout),
        Some(ErrorCode::UnknownLayout)
    );
    let nothing = ExportReadyReq {
        client,
        transfer_id: "never-exported".into(),
        ready: 1,
        crcs: Vec::new(),
        part_crcs: Vec::new(),
    };
    assert_eq!(
        call("export_ready", &nothing),
        Some(ErrorCode::UnknownTransfer)
    );
    // the registration to a node that does not exist expires and is counted
    eventually(15, "registration expired", || {
        let s = good.stats().unwrap().transfers.unwrap();
        s.registrations == 0 && s.expired == 1
    });
    round_trip(&good, l, 901);
    let s = good.stats().unwrap();
    assert_eq!(s.pinned_blocks, 0);
    assert_eq!(s.pending, 0);
    assert!(s.transfers.unwrap().refused >= 5);
}

/// Object-safe serialization of a request body, so one helper sends any op.
mod erased {
    pub trait Body {
        fn frame(&self, id: u64, op: &str) -> Vec<u8>;
    }
    impl<T: serde::Serialize> Body for T {
        fn frame(&self, id: u64, op: &str) -> Vec<u8> {
            super::frame(1, id, op, self)
        }
    }
}

/// Peer ops are served only on the control endpoint, only with a valid, fresh, unreplayed
/// MAC; client ops are not served there; data-plane requests need the MAC too. Each
/// refusal is counted and the daemon keeps serving.
#[test]
fn unauthenticated_peer_traffic_gets_nothing() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let l = register(&good, 16).id;
    let me = good.hello_info().node.expect("transfers are on by default");
    let stranger = stranger();
    let hb = |id: u64| {
        frame(
            1,
            id,
            "peer_heartbeat",
            PeerHeartbeatReq {
                from: stranger.clone(),
                to_incarnation: me.incarnation,
                transfers: vec!["t".into()],
            },
        )
    };
    let unauth = || good.stats().unwrap().transfers.unwrap().unauthenticated;
    // 1. a peer op on the client endpoint, even signed
    let client_side = PeerRaw {
        raw: Raw::new(&d.endpoint, zmq::DEALER),
        key: Some(cluster_key()),
        to: me.node.clone(),
    };
    assert_eq!(
        client_side.call(&hb(1)),
        (1, Some(ErrorCode::Unauthenticated))
    );
    assert_eq!(unauth(), 1);
    // 2. on the control endpoint: unsigned, signed with another secret, garbage auth
    let unsigned = PeerRaw::new(&me.node, None);
    assert_eq!(unsigned.call(&hb(2)), (2, Some(ErrorCode::Unauthenticated)));
    let other = auth::ClusterKey::from_secret(&[b'z'; 32]).unwrap();
    let wrong = PeerRaw::new(&me.node, Some(other.clone()));
    assert_eq!(wrong.call(&hb(3)), (3, Some(ErrorCode::Unauthenticated)));
    assert_eq!(
        unsigned.call_frames(&[hb(4), vec![0u8; 52]]),
        (4, Some(ErrorCode::Unauthenticated))
    );
    // a MAC over another envelope
    let signed = PeerRaw::new(&me.node, Some(cluster_key()));
    let mut frames = signed.frames(&hb(5));
    frames[0] = hb(6);
    assert_eq!(
        signed.call_frames(&frames),
        (6, Some(ErrorCode::Unauthenticated))
    );
    // 3. the right MAC is served once; the same frames again are a replay
    let frames = signed.frames(&hb(7));
    assert_eq!(signed.call_frames(&frames), (7, None));
    assert_eq!(
        signed.call_frames(&frames),
        (7, Some(ErrorCode::Unauthenticated))
    );
    // a stamp from the past (or future) beyond the skew window
    let key = cluster_key();
    let env = hb(8);
    let old = auth::Stamp {
        unix_ms: kvd_daemon::auth::unix_ms() - 10 * auth::MAX_SKEW_MS,
        nonce: 1,
    };
    assert_eq!(
        signed.call_frames(&[env.clone(), key.seal_request(old, &me.node, &env).to_vec()]),
        (8, Some(ErrorCode::Unauthenticated))
    );
    // 4. a client op on the control endpoint, signed
    let stats = encode_request(9, &Request::Stats(StatsReq::default()));
    assert_eq!(signed.call(&stats), (9, Some(ErrorCode::UnknownOp)));
    assert_eq!(unauth(), 7);
    // 5. the data plane: an export's own handle and token, but no or a wrong MAC
    let ks = keys(77, 1);
    let data = block(77, 16 * 1024);
    good.store(l, &ks, &[&data]).unwrap();
    let p = good.export("x", l, &ks, None).unwrap();
    let token = p.token ^ transfer_tag("x", &p.keys, p.offsets.iter().map(|&o| Some(o)));
    assert_eq!(
        raw_read_with(None, &p, p.handle, token, p.offsets[0], 4096).unwrap_err(),
        "unauthenticated"
    );
    assert_eq!(
        raw_read_with(Some(&other), &p, p.handle, token, p.offsets[0], 4096).unwrap_err(),
        "unauthenticated"
    );
    assert_eq!(
        raw_read(&p, p.handle, token, p.offsets[0], 16 * 1024).unwrap(),
        data
    );
    assert_eq!(unauth(), 9);
    round_trip(&good, l, 78);
}

/// Issue 32, 5.4: each endpoint judges an op by its name before its body. A peer op
/// with a malformed body on a client endpoint was `invalid_argument` (its body was read
/// first); now it is `unauthenticated`, as any peer op there. A client op with a
/// malformed body on the control endpoint, signed, is `unknown_op` (not served there),
/// and one unsigned is `unauthenticated` (authentication comes before anything else).
#[test]
fn each_endpoint_refuses_an_op_by_its_name_before_reading_its_body() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let me = good.hello_info().node.expect("transfers are on by default");
    let unauth = || good.stats().unwrap().transfers.unwrap().unauthenticated;
    let client_side = Raw::new(&d.endpoint, zmq::DEALER);
    let bad_peer_op = frame(1, 1, "peer_heartbeat", ("not", "a", "body"));
    assert_eq!(
        client_side.call(&[&bad_peer_op]),
        (1, Some(ErrorCode::Unauthenticated))
    );
    assert_eq!(unauth(), 1);
    // the same body under a client op name is the body's fault
    let bad_client_op = frame(1, 2, "lookup", ("not", "a", "body"));
    assert_eq!(
        client_side.call(&[&bad_client_op]),
        (2, Some(ErrorCode::InvalidArgument))
    );
    let signed = PeerRaw::new(&me.node, Some(cluster_key()));
    let bad_client_op = frame(1, 3, "lookup", ("not", "a", "body"));
    assert_eq!(signed.call(&bad_client_op), (3, Some(ErrorCode::UnknownOp)));
    let unsigned = PeerRaw::new(&me.node, None);
    assert_eq!(
        unsigned.call(&bad_client_op),
        (3, Some(ErrorCode::Unauthenticated))
    );
    // and a peer op's malformed body on the control endpoint, signed, is the body's fault
    let bad_peer_op = frame(1, 4, "peer_heartbeat", ("not", "a", "body"));
    assert_eq!(
        signed.call(&bad_peer_op),
        (4, Some(ErrorCode::InvalidArgument))
    );
    assert_eq!(unauth(), 2);
    let l = register(&good, 16).id;
    round_trip(&good, l, 3);
}

/// Finding: the wire was looser than SPEC §2 says: positional arrays were accepted for
/// envelopes and bodies, integers for enum fields (`dtype: 2`), bin for `op` and `model`.
/// Each is refused now, from a raw socket, and the daemon keeps serving.
#[test]
fn the_wire_is_as_strict_as_the_spec() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let l = register(&good, 16).id;
    let raw = Raw::new(&d.endpoint, zmq::DEALER);
    // a positional envelope [v, id, op, body]
    let positional = rmp_serde::to_vec(&(1u32, 41u64, "stats", ())).unwrap();
    assert_eq!(raw.call(&[&positional]).1, Some(ErrorCode::Malformed));
    // op as bin
    #[derive(Serialize)]
    struct BinOp<'a> {
        v: u32,
        id: u64,
        #[serde(with = "serde_bytes")]
        op: &'a [u8],
    }
    let bin_op = rmp_serde::to_vec_named(&BinOp {
        v: 1,
        id: 42,
        op: b"stats",
    })
    .unwrap();
    assert_eq!(raw.call(&[&bin_op]), (42, Some(ErrorCode::Malformed)));
    // a positional body
    let layout = layout(16);
    let body = rmp_serde::to_vec(&RegisterLayoutReq {
        layout: layout.clone(),
        client: None,
    })
    .unwrap();
    let mut env = Vec::new();
    env.extend_from_slice(&[0x84]); // map of 4
    for (k, v) in [
        ("v", &rmp_serde::to_vec(&1u32).unwrap()),
        ("id", &rmp_serde::to_vec(&43u64).unwrap()),
        ("op", &rmp_serde::to_vec("register_layout").unwrap()),
    ] {
        env.extend_from_slice(&rmp_serde::to_vec(k).unwrap());
        env.extend_from_slice(v);
    }
    env.extend_from_slice(&rmp_serde::to_vec("body").unwrap());
    env.extend_from_slice(&body);
    assert_eq!(raw.call(&[&env]), (43, Some(ErrorCode::InvalidArgument)));
    // dtype as an integer, model as bin (named maps otherwise)
    #[derive(Serialize)]
    struct RawLayout {
        model: Either,
        num_layers: u64,
        kv_parts: u64,
        num_kv_heads: u64,
        head_dim: u64,
        dtype: Either,
        tokens_per_block: u64,
        tp_size: u64,
        tp_rank: u64,
        order: MemoryOrder,
    }
    #[derive(Serialize)]
    struct Reg {
        layout: RawLayout,
    }
    let spelled = |id: u64, model: Either, dtype: Either| {
        let layout = RawLayout {
            model,
            num_layers: layout.num_layers,
            kv_parts: layout.kv_parts,
            num_kv_heads: layout.num_kv_heads,
            head_dim: layout.head_dim,
            dtype,
            tokens_per_block: layout.tokens_per_block,
            tp_size: 1,
            tp_rank: 0,
            order: layout.order,
        };
        frame(1, id, "register_layout", Reg { layout })
    };
    let model = || Either::Str(layout.model.clone());
    let f16 = || Either::Str("f16".into());
    assert_eq!(
        raw.call(&[&spelled(44, model(), Either::Int(2))]),
        (44, Some(ErrorCode::InvalidArgument))
    );
    let bin_model = Either::Bin(layout.model.as_bytes().to_vec());
    assert_eq!(
        raw.call(&[&spelled(45, bin_model, f16())]),
        (45, Some(ErrorCode::InvalidArgument))
    );
    assert_eq!(raw.call(&[&spelled(47, model(), f16())]), (47, None));
    // the same layout, spelled as SPEC says, is accepted
    let ok = frame(
        1,
        46,
        "register_layout",
        RegisterLayoutReq {
            layout,
            client: None,
        },
    );
    assert_eq!(raw.call(&[&ok]), (46, None));
    round_trip(&good, l, 950);
}

/// A value spelled as a msgpack str, int or bin, for the strictness test.
#[derive(Serialize)]
#[serde(untagged)]
enum Either {
    Str(String),
    Int(u64),
    Bin(#[serde(with = "serde_bytes")] Vec<u8>),
}
