//! The three transfer records ([`Export`], [`Import`], [`Registration`]) against small
//! reference models, under random operation sequences (as `store::model_test` does for
//! the store). Each step applies one transition to the record and to the reference and
//! checks that they agree: the state, the pin or slots held, what the lease says, what
//! the grant lets a peer do (the renewal written through), what retention says.
//!
//! Negative control: the same checker run against references that break one rule each
//! (a renewal by a whole period, a pin released under an active read, a final state
//! ended again, slots freed under an active write, a silent exporter never failing the
//! import) must find a counterexample; otherwise the checks could not fail.

use std::time::{Duration, Instant};

use kvd_protocol::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use super::export::{self, Beat, Export};
use super::grants::{GrantGuard, GrantKind, Grants};
use super::import::{self, Import, Mode};
use super::life::Retain;
use super::registration::Registration;
use kvd_store::lease::{Lease, LeaseCheck};

const MS: Duration = Duration::from_millis(1);
const MAX_HOLD: Duration = Duration::from_millis(2000);
const RETAIN: Duration = Duration::from_millis(300);
const BLOCK: u64 = 4096;
const ME: Incarnation = Incarnation(11);

/// A broken rule in the reference (negative control), or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutant {
    None,
    /// Renewal extends by the whole period.
    FullPeriodRenewal,
    /// An export's pin is released even while a read is active.
    ReleaseUnderRead,
    /// A final state may be ended again (into another final state).
    ReEndFinal,
    /// An import's slots are freed even while a write is active.
    FreeUnderWrite,
    /// A silent exporter never fails the import.
    NoSilence,
    /// A layer-wise push writes parts not yet announced.
    PushUnannounced,
    /// A staged export's blocks are readable before the last part.
    ReadWhileStaging,
}

fn renewed(expires: Instant, period: Duration, now: Instant, m: Mutant) -> Instant {
    let by = if m == Mutant::FullPeriodRenewal {
        period
    } else {
        period * 2 / 3
    };
    expires.max(now + by)
}

fn lease_check(expires: Instant, hard: Instant, now: Instant) -> LeaseCheck {
    if hard <= now {
        LeaseCheck::HeldTooLong
    } else if expires <= now {
        LeaseCheck::Expired
    } else {
        LeaseCheck::Live(expires.min(hard))
    }
}

fn peer(inc: u64) -> PeerRef {
    PeerRef {
        node: format!("tcp://127.0.0.1:{}", 7000 + inc),
        data: String::new(),
        incarnation: Incarnation(inc),
        host: String::new(),
        shm: None,
        rdma: None,
    }
}

fn final_state(i: u8) -> TransferState {
    [
        TransferState::Done,
        TransferState::Failed,
        TransferState::Aborted,
        TransferState::Expired,
    ][i as usize % 4]
}

/// Random sequences for the real checks; for the negative control, a fixed seed and
/// more cases, so that whether a broken rule is found does not depend on the draw.
fn runner(m: Mutant) -> TestRunner {
    let config = Config {
        cases: if m == Mutant::None { 192 } else { 1024 },
        failure_persistence: None,
        ..Config::default()
    };
    if m == Mutant::None {
        TestRunner::new(config)
    } else {
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
    }
}

// ---------------------------------------------------------------------------------
// Exports

#[derive(Debug, Clone)]
enum XOp {
    /// A heartbeat from the importer (or from another incarnation).
    Beat {
        ours: bool,
    },
    /// A push registration pairs with the export (fitting its layout, or not).
    Register {
        fits: bool,
    },
    StartJob,
    JobDone {
        bytes: u64,
    },
    End {
        state: u8,
    },
    /// A data-plane read begins under the grant (kept active until `EndRead`).
    BeginRead,
    EndRead,
    Settle,
    Advance {
        ms: u64,
    },
}

fn x_op() -> impl Strategy<Value = XOp> {
    prop_oneof![
        3 => any::<bool>().prop_map(|ours| XOp::Beat { ours }),
        1 => any::<bool>().prop_map(|fits| XOp::Register { fits }),
        1 => Just(XOp::StartJob),
        1 => (0u64..10_000).prop_map(|bytes| XOp::JobDone { bytes }),
        1 => (0u8..4).prop_map(|state| XOp::End { state }),
        2 => Just(XOp::BeginRead),
        2 => Just(XOp::EndRead),
        2 => Just(XOp::Settle),
        3 => (1u64..400).prop_map(|ms| XOp::Advance { ms }),
    ]
}

/// The reference export.
struct XRef {
    state: TransferState,
    period: Duration,
    expires: Instant,
    hard: Instant,
    importer: Option<Incarnation>,
    registered: bool,
    job: bool,
    pin: bool,
    revoked: bool,
    ended: Option<Instant>,
}

fn run_export(ops: &[XOp], m: Mutant) -> Result<(), TestCaseError> {
    let t0 = Instant::now();
    let mut now = t0;
    let grants = Grants::new(ME);
    let keys = vec![ChunkHash([1; 16]), ChunkHash([2; 16])];
    let offsets = vec![0, BLOCK * 4];
    let req = ExportReq {
        client: ClientId(5),
        transfer_id: "x".into(),
        layout_id: LayoutId(1),
        keys: keys.clone(),
        lease_ms: Some(300),
        parts: None,
        staged: false,
    };
    let period = MS * 300;
    let lease = Lease::new(period, now).with_max_hold(MAX_HOLD, now);
    let (mut x, params) = Export::open(
        &peer(1),
        &req,
        offsets.clone(),
        BLOCK,
        Some(PinId(9)),
        lease,
        &grants,
        (vec![(0, BLOCK)], None),
        now,
    );
    prop_assert_eq!(params.lease_ms, 300);
    let grant_token = params.token ^ transfer_tag("x", &keys, offsets.iter().map(|&o| Some(o)));
    let mut r = XRef {
        state: TransferState::Exported,
        period,
        expires: now + period,
        hard: now + MAX_HOLD,
        importer: None,
        registered: false,
        job: false,
        pin: true,
        revoked: false,
        ended: None,
    };
    let mut reads: Vec<GrantGuard<'_>> = Vec::new();
    for op in ops {
        match *op {
            XOp::Beat { ours } => {
                let from = if ours {
                    r.importer.unwrap_or(Incarnation(21))
                } else {
                    Incarnation(99)
                };
                let want = if r.importer.is_some_and(|i| i != from) {
                    Beat::Unknown
                } else if r.state == TransferState::Done {
                    Beat::Done
                } else if r.state.is_final() {
                    Beat::Unknown
                } else {
                    r.expires = renewed(r.expires, r.period, now, m);
                    r.importer = Some(from);
                    Beat::Renewed
                };
                prop_assert_eq!(x.heartbeat(&peer(from.0), &grants, now), want);
            }
            XOp::Register { fits } => {
                if r.state != TransferState::Exported || r.registered {
                    continue;
                }
                let reg = Registration::new(
                    &PeerPushRegReq {
                        from: peer(31),
                        to_incarnation: ME,
                        transfer_id: "x".into(),
                        layout_id: LayoutId(if fits { 1 } else { 2 }),
                        keys: keys.clone(),
                        offsets: vec![Some(0), None],
                        handle: 77,
                        token: 78,
                        lease_ms: 600,
                    },
                    Lease::new(MS * 600, now),
                );
                let access = super::dataplane::Access {
                    peer: peer(31),
                    handle: 77,
                    token: 78,
                    verify: false,
                };
                let ok = x.accept_registration(&reg, access);
                prop_assert_eq!(ok.is_ok(), fits, "a registration fits iff its layout does");
                if ok.is_ok() {
                    match x.next_push() {
                        super::export::NextPush::Write(ops, _, upto) => {
                            prop_assert_eq!(ops.len(), 1, "one write per registered slot");
                            prop_assert_eq!(upto, 1, "a whole export is one part");
                        }
                        other => prop_assert!(false, "a fitting push writes: {other:?}"),
                    }
                }
                // One that does not fit ends the export (the flow's part, not here):
                // only a fitting one lets the push start.
                r.registered = fits;
                r.importer = Some(Incarnation(31));
                r.period = r.period.max(MS * 600);
                prop_assert_eq!(x.period(), r.period);
            }
            XOp::StartJob => {
                if r.state != TransferState::Exported || !r.registered {
                    continue;
                }
                x.start_job("tcp", 1, 1);
                r.state = TransferState::Running;
                r.job = true;
            }
            XOp::JobDone { bytes } => {
                if !r.job {
                    continue;
                }
                x.job_done(true);
                x.moved(bytes);
                r.job = false;
            }
            XOp::End { state } => {
                let s = final_state(state);
                let ended = x.end(s, None, now);
                let may = !r.state.is_final() || m == Mutant::ReEndFinal;
                prop_assert_eq!(ended.is_some(), may, "end of a {:?} export", r.state);
                if may {
                    r.state = s;
                    r.ended = Some(now);
                }
            }
            XOp::BeginRead => {
                let g = grants.begin(
                    GrantKind::Read,
                    x.handle(),
                    grant_token,
                    ME,
                    &[(0, BLOCK)],
                    now,
                );
                let allowed = !r.revoked && now < r.expires;
                prop_assert_eq!(
                    g.is_ok(),
                    allowed,
                    "a read at {:?} (lease to {:?})",
                    now - t0,
                    r.expires - t0
                );
                if let Ok(g) = g {
                    reads.push(g);
                }
            }
            XOp::EndRead => {
                if let Some(mut g) = reads.pop() {
                    g.complete();
                }
            }
            XOp::Settle => {
                let want = if !r.pin || !r.state.is_final() {
                    export::Settle::Nothing
                } else if r.job {
                    // The push job still reads the slots (the grant is not revoked yet:
                    // the job itself holds no grant request).
                    export::Settle::Later
                } else {
                    // Revoked now: no new request; the active ones finish.
                    r.revoked = true;
                    if !reads.is_empty() && m != Mutant::ReleaseUnderRead {
                        export::Settle::Later
                    } else {
                        r.pin = false;
                        export::Settle::Release(PinId(9))
                    }
                };
                prop_assert_eq!(x.settle(&grants, None), want);
            }
            XOp::Advance { ms } => now += Duration::from_millis(ms),
        }
        prop_assert_eq!(x.state(), r.state);
        prop_assert_eq!(x.holds_pin(), r.pin);
        prop_assert_eq!(x.check_lease(now), lease_check(r.expires, r.hard, now));
        prop_assert_eq!(x.importer().map(|p| p.incarnation), r.importer);
        let retain = if r.ended.is_some_and(|t| t + RETAIN > now) || r.pin {
            Retain::Keep
        } else if r.state.is_final() {
            Retain::Forget
        } else {
            Retain::Live
        };
        prop_assert_eq!(x.retention(RETAIN, now), retain);
    }
    Ok(())
}

fn check_exports(m: Mutant) -> Result<(), TestError<Vec<XOp>>> {
    runner(m).run(&proptest::collection::vec(x_op(), 1..60), |ops| {
        run_export(&ops, m)
    })
}

// ---------------------------------------------------------------------------------
// Imports

#[derive(Debug, Clone)]
enum IOp {
    /// Slots allocated; `here`: the first key is here already.
    Allocate {
        here: bool,
    },
    /// Pull: the data-plane job starts. Push: the registration goes out.
    Start,
    JobDone {
        bytes: u64,
    },
    /// The exporter answered (a heartbeat or the registration).
    Heard,
    /// Committed and pinned.
    Commit,
    End {
        state: u8,
    },
    BeginWrite,
    EndWrite,
    Settle,
    Advance {
        ms: u64,
    },
}

fn i_op() -> impl Strategy<Value = IOp> {
    prop_oneof![
        1 => any::<bool>().prop_map(|here| IOp::Allocate { here }),
        1 => Just(IOp::Start),
        1 => (0u64..10_000).prop_map(|bytes| IOp::JobDone { bytes }),
        2 => Just(IOp::Heard),
        1 => Just(IOp::Commit),
        1 => (0u8..4).prop_map(|state| IOp::End { state }),
        2 => Just(IOp::BeginWrite),
        2 => Just(IOp::EndWrite),
        2 => Just(IOp::Settle),
        3 => (1u64..400).prop_map(|ms| IOp::Advance { ms }),
    ]
}

struct IRef {
    state: TransferState,
    allocated: Option<bool>,
    job: bool,
    heard: Instant,
    settled: bool,
    freed: bool,
    granted: bool,
}

fn run_import(push: bool, ops: &[IOp], m: Mutant) -> Result<(), TestCaseError> {
    let t0 = Instant::now();
    let mut now = t0;
    let grants = Grants::new(ME);
    let keys = vec![ChunkHash([1; 16]), ChunkHash([2; 16])];
    let period = MS * 300;
    let mut x = if push {
        let req = PushRegisterReq {
            client: ClientId(5),
            transfer_id: "i".into(),
            node: "tcp://127.0.0.1:7001".into(),
            layout_id: LayoutId(1),
            keys: keys.clone(),
            ttl_ms: None,
            wait: false,
            parts: None,
        };
        Import::push(&req, BLOCK, period, now)
    } else {
        let p = TransferParams {
            from: peer(1),
            transfer_id: "i".into(),
            handle: 3,
            token: 4,
            layout_id: LayoutId(1),
            block_bytes: BLOCK,
            keys: keys.clone(),
            offsets: vec![0, BLOCK],
            lease_ms: 300,
            expires_unix_ms: 0,
            crcs: Vec::new(),
        };
        Import::pull(&p, ClientId(5), None, period, now)
    };
    prop_assert_eq!(x.mode(), if push { Mode::Push } else { Mode::Pull });
    let mut r = IRef {
        state: TransferState::Queued,
        allocated: None,
        job: false,
        heard: now,
        settled: false,
        freed: false,
        granted: false,
    };
    let mut grant_token = 0;
    let mut writes: Vec<GrantGuard<'_>> = Vec::new();
    for op in ops {
        match *op {
            IOp::Allocate { here } => {
                prop_assert_eq!(
                    x.wants_room(),
                    r.state == TransferState::Queued && r.allocated.is_none()
                );
                if !x.wants_room() {
                    continue;
                }
                x.allocated(vec![(!here).then_some(BLOCK * 8), Some(BLOCK * 9)]);
                r.allocated = Some(here);
            }
            IOp::Start => {
                if r.state != TransferState::Queued || r.allocated.is_none() {
                    continue;
                }
                if push {
                    if let Some(g) = x.write_grant("i") {
                        grants.insert(
                            g.handle,
                            g.token,
                            GrantKind::Write,
                            &g.ranges,
                            x.grant_end(MAX_HOLD),
                        );
                        grant_token = g.token;
                        r.granted = true;
                    }
                    let Request::PeerPushReg(reg) = x.registered(&peer(2), "i") else {
                        return Err(TestCaseError::fail("a registration is a peer_push_reg"));
                    };
                    prop_assert_eq!(
                        reg.offsets.iter().flatten().count(),
                        if r.allocated == Some(true) { 1 } else { 2 }
                    );
                    r.state = TransferState::Waiting;
                } else {
                    let n = x.pull_ops().len();
                    prop_assert_eq!(n, if r.allocated == Some(true) { 1 } else { 2 });
                    x.start_job("tcp", Default::default(), 1);
                    r.state = TransferState::Running;
                    r.job = true;
                }
            }
            IOp::JobDone { bytes } => {
                if !r.job {
                    continue;
                }
                x.job_done();
                x.moved(bytes);
                r.job = false;
            }
            IOp::Heard => {
                x.heard(now);
                r.heard = now;
            }
            IOp::Commit => {
                if r.state.is_final() || r.allocated.is_none() {
                    continue;
                }
                // As the importer does: committed, then ended done.
                x.committed();
                r.settled = true;
                prop_assert!(x.end(TransferState::Done, None, now).is_some());
                r.state = TransferState::Done;
            }
            IOp::End { state } => {
                let s = final_state(state);
                let may = !r.state.is_final() || m == Mutant::ReEndFinal;
                prop_assert_eq!(x.end(s, None, now).is_some(), may);
                if may {
                    r.state = s;
                }
            }
            IOp::BeginWrite => {
                if !r.granted {
                    continue;
                }
                let g = grants.begin(
                    GrantKind::Write,
                    x.handle(),
                    grant_token,
                    ME,
                    &[(BLOCK * 9, BLOCK)],
                    now,
                );
                if let Ok(g) = g {
                    writes.push(g);
                }
            }
            IOp::EndWrite => {
                if let Some(mut g) = writes.pop() {
                    g.complete();
                }
            }
            IOp::Settle => {
                let want = if r.settled || !r.state.is_final() {
                    import::Settle::Nothing
                } else {
                    let writing = push && !writes.is_empty() && m != Mutant::FreeUnderWrite;
                    if r.job || writing {
                        import::Settle::Later
                    } else {
                        r.settled = true;
                        prop_assert!(!r.freed, "slots freed twice");
                        r.freed = true;
                        let mut keys = keys.clone();
                        if r.allocated == Some(true) {
                            keys.remove(0);
                        }
                        if r.allocated.is_none() {
                            keys.clear();
                        }
                        import::Settle::Free(keys)
                    }
                };
                prop_assert_eq!(x.settle(&grants, None, None), want);
            }
            IOp::Advance { ms } => now += Duration::from_millis(ms),
        }
        prop_assert_eq!(x.state(), r.state);
        prop_assert_eq!(x.settled(), r.settled);
        prop_assert_eq!(x.is_final(), r.state.is_final());
        let silence = if t0 + MAX_HOLD <= now {
            LeaseCheck::HeldTooLong
        } else if r.heard + period > now || m == Mutant::NoSilence {
            LeaseCheck::Live((r.heard + period).min(t0 + MAX_HOLD))
        } else {
            LeaseCheck::Expired
        };
        prop_assert_eq!(x.check_peer(MAX_HOLD, now), silence);
    }
    Ok(())
}

fn check_imports(m: Mutant) -> Result<(), TestError<(bool, Vec<IOp>)>> {
    runner(m).run(
        &(any::<bool>(), proptest::collection::vec(i_op(), 1..60)),
        |(push, ops)| run_import(push, &ops, m),
    )
}

// ---------------------------------------------------------------------------------
// Registrations

fn run_registration(ops: &[(bool, u64)], m: Mutant) -> Result<(), TestCaseError> {
    let t0 = Instant::now();
    let mut now = t0;
    let period = MS * 300;
    let req = PeerPushRegReq {
        from: peer(31),
        to_incarnation: ME,
        transfer_id: "r".into(),
        layout_id: LayoutId(1),
        keys: vec![ChunkHash([1; 16])],
        offsets: vec![Some(0)],
        handle: 77,
        token: 78,
        lease_ms: 300,
    };
    let mut g = Registration::new(&req, Lease::new(period, now).with_max_hold(MAX_HOLD, now));
    let mut expires = now + period;
    for &(ours, ms) in ops {
        now += Duration::from_millis(ms);
        let from = if ours {
            Incarnation(31)
        } else {
            Incarnation(32)
        };
        prop_assert_eq!(g.heartbeat(from, now), ours);
        if ours {
            expires = renewed(expires, period, now, m);
        }
        prop_assert_eq!(g.expires(), expires);
        prop_assert_eq!(g.check_lease(now), lease_check(expires, t0 + MAX_HOLD, now));
    }
    Ok(())
}

fn check_registrations(m: Mutant) -> Result<(), TestError<Vec<(bool, u64)>>> {
    runner(m).run(
        &proptest::collection::vec((any::<bool>(), 0u64..350), 1..40),
        |ops| run_registration(&ops, m),
    )
}

// ---------------------------------------------------------------------------------
// Staged, layer-wise exports (SPEC §16)

#[derive(Debug, Clone)]
enum SOp {
    Register,
    Announce {
        ready: u64,
    },
    /// Whatever `next_push` says is started as a job.
    Push,
    JobDone {
        ok: bool,
    },
    End {
        state: u8,
    },
    /// A peer's data-plane read under the read grant.
    Read,
}

fn s_op() -> impl Strategy<Value = SOp> {
    prop_oneof![
        1 => Just(SOp::Register),
        3 => (0u64..6).prop_map(|ready| SOp::Announce { ready }),
        3 => Just(SOp::Push),
        2 => any::<bool>().prop_map(|ok| SOp::JobDone { ok }),
        1 => (0u8..4).prop_map(|state| SOp::End { state }),
        2 => Just(SOp::Read),
    ]
}

/// A staged export of three blocks (the second held already, so never staged) in four
/// parts of unequal size, against a reference of what may be written and read when: a
/// push writes exactly the parts announced and not yet written, one range per pushed
/// block covering those parts; it is done only once every part is written and the
/// blocks are committed; no read is admitted before the last part.
fn run_staged(ops: &[SOp], m: Mutant) -> Result<(), TestCaseError> {
    let now = Instant::now();
    let grants = Grants::new(ME);
    let keys = vec![ChunkHash([1; 16]), ChunkHash([2; 16]), ChunkHash([3; 16])];
    let offsets = vec![0, BLOCK * 4, BLOCK * 8];
    let spans = vec![(0, 1024), (1024, 512), (1536, 1536), (3072, 1024)];
    let parts = spans.len() as u64;
    let req = ExportReq {
        client: ClientId(5),
        transfer_id: "s".into(),
        layout_id: LayoutId(1),
        keys: keys.clone(),
        lease_ms: Some(300),
        parts: Some(parts),
        staged: true,
    };
    let lease = Lease::new(MS * 300, now).with_max_hold(MAX_HOLD, now);
    let staged = export::Staged {
        keys: vec![keys[0], keys[2]],
        deadline: now + MS * 300,
    };
    let (mut x, params) = Export::open(
        &peer(1),
        &req,
        offsets.clone(),
        BLOCK,
        Some(PinId(9)),
        lease,
        &grants,
        (spans.clone(), Some(staged)),
        now,
    );
    prop_assert!(
        params.from.shm.is_none(),
        "a staged export offers no pool file"
    );
    let token = params.token ^ transfer_tag("s", &keys, offsets.iter().map(|&o| Some(o)));
    // The reference.
    let (mut ready, mut sent, mut sending) = (0u64, 0u64, None::<u64>);
    let (mut committed, mut registered, mut ended) = (false, false, false);
    for op in ops {
        match *op {
            SOp::Register => {
                if registered || ended || x.state() != TransferState::Exported {
                    continue;
                }
                let reg = Registration::new(
                    &PeerPushRegReq {
                        from: peer(31),
                        to_incarnation: ME,
                        transfer_id: "s".into(),
                        layout_id: LayoutId(1),
                        keys: keys.clone(),
                        // The importer holds the last block: two blocks to write.
                        offsets: vec![Some(BLOCK * 100), Some(BLOCK * 200), None],
                        handle: 77,
                        token: 78,
                        lease_ms: 300,
                    },
                    Lease::new(MS * 300, now),
                );
                let access = super::dataplane::Access {
                    peer: peer(31),
                    handle: 77,
                    token: 78,
                    verify: false,
                };
                prop_assert!(x.accept_registration(&reg, access).is_ok());
                registered = true;
            }
            SOp::Announce { ready: k } => {
                if ended {
                    continue;
                }
                let got = x.announce(k);
                if k > parts {
                    prop_assert!(got.is_err(), "ready {} > {} parts", k, parts);
                    continue;
                }
                let complete = !committed && k > ready && k == parts;
                prop_assert_eq!(got.ok(), Some(complete), "announce {}", k);
                if !committed {
                    ready = ready.max(k);
                }
                if complete {
                    let old = x.committed("s", PinId(10), &offsets, &grants);
                    prop_assert_eq!(old.ok().flatten(), Some(PinId(9)));
                    committed = true;
                }
            }
            SOp::Push => {
                let want_upto = if m == Mutant::PushUnannounced {
                    parts
                } else {
                    ready
                };
                match x.next_push() {
                    export::NextPush::Write(ops, _, upto) => {
                        prop_assert!(registered && sending.is_none() && !ended);
                        prop_assert_eq!(upto, want_upto, "a push writes up to the announced part");
                        prop_assert!(upto > sent);
                        let (a, e) = (spans[sent as usize].0, spans[upto as usize - 1]);
                        let e = e.0 + e.1;
                        let dst = [BLOCK * 100, BLOCK * 200];
                        prop_assert_eq!(ops.len(), 2, "one range per pushed block");
                        for (op, (src, dst)) in ops.iter().zip(offsets.iter().zip(dst)) {
                            prop_assert_eq!(
                                (op.local, op.remote, op.len),
                                (src + a, dst + a, e - a)
                            );
                        }
                        x.start_job("tcp", 1, upto);
                        sending = Some(upto);
                    }
                    export::NextPush::Done => {
                        prop_assert!(registered && sent == parts && committed && sending.is_none());
                        // What the flow does then: the export ends done and settles
                        // (its grant revoked: no job is left).
                        prop_assert!(x.end(TransferState::Done, None, now).is_some());
                        prop_assert!(grants.revoke(x.handle(), ErrorCode::InvalidState));
                        ended = true;
                    }
                    export::NextPush::Wait => {
                        prop_assert!(
                            !registered
                                || ended
                                || sending.is_some()
                                || ready <= sent
                                || (sent == parts && !committed),
                            "a push waits with parts to write: ready {} sent {}",
                            ready,
                            sent
                        );
                    }
                }
            }
            SOp::JobDone { ok } => {
                let Some(upto) = sending.take() else { continue };
                x.job_done(ok);
                if ok {
                    sent = upto;
                }
            }
            SOp::End { state } => {
                if ended {
                    continue;
                }
                prop_assert!(x.end(final_state(state), None, now).is_some());
                grants.revoke(x.handle(), ErrorCode::Aborted);
                ended = true;
            }
            SOp::Read => {
                let r = grants.begin(GrantKind::Read, x.handle(), token, ME, &[(0, 16)], now);
                let may = (committed || m == Mutant::ReadWhileStaging) && !ended;
                prop_assert_eq!(r.is_ok(), may, "a read while committed {}", committed);
            }
        }
        let d = x.describe("s", now);
        prop_assert_eq!((d.parts, d.parts_done), (parts, ready));
        prop_assert_eq!(x.staging(), !committed);
    }
    Ok(())
}

fn check_staged(m: Mutant) -> Result<(), TestError<Vec<SOp>>> {
    runner(m).run(&proptest::collection::vec(s_op(), 1..40), |ops| {
        run_staged(&ops, m)
    })
}

#[test]
fn staged_exports_push_only_announced_parts_and_open_reads_at_the_end() {
    check_staged(Mutant::None).unwrap();
}

#[test]
fn exports_follow_their_state_machine() {
    check_exports(Mutant::None).unwrap();
}

#[test]
fn imports_follow_their_state_machine() {
    check_imports(Mutant::None).unwrap();
}

#[test]
fn registrations_follow_their_lease() {
    check_registrations(Mutant::None).unwrap();
}

#[test]
fn negative_control_each_broken_rule_is_found() {
    for m in [
        Mutant::FullPeriodRenewal,
        Mutant::ReleaseUnderRead,
        Mutant::ReEndFinal,
    ] {
        assert!(check_exports(m).is_err(), "exports: {m:?} was not caught");
    }
    for m in [
        Mutant::ReEndFinal,
        Mutant::FreeUnderWrite,
        Mutant::NoSilence,
    ] {
        assert!(check_imports(m).is_err(), "imports: {m:?} was not caught");
    }
    assert!(check_registrations(Mutant::FullPeriodRenewal).is_err());
    for m in [Mutant::PushUnannounced, Mutant::ReadWhileStaging] {
        assert!(
            check_staged(m).is_err(),
            "staged exports: {m:?} was not caught"
        );
    }
}
