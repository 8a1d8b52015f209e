//! The dangerous moments (issue 47, item 4): every place where a byte could be read or
//! written after its slot went to another block, each forced from outside by a test.
//! Two defences stand at each: the hold (pin, allocation, lease, grant, fence) whose
//! deadline the client or the daemon enforces, and — for reads — the writer checksum
//! (SPEC §17), which catches a reader that kept reading past it.
//!
//! | moment | forced by |
//! |---|---|
//! | a reader's pin lapses and its slot is handed to another block | `store_load.rs::pins_expire_by_ttl_and_late_reads_are_refused` (the client refuses a read that outlasted the pin); below, `a_reader_past_its_pin_whose_slot_holds_another_block_reads_a_miss` (the checksum catches a reader that ignored it) |
//! | a prefetched pin lapses before its load | `pipelined.rs::a_prefetch_whose_pin_lapsed_is_loaded_again`, `pipelined.rs::a_queue_forgets_announcements_whose_pins_lapsed` |
//! | a writer's allocation expires and its slot is reused | `store_load.rs::a_write_batch_refuses_writes_after_its_ttl`; below, `a_writer_past_its_allocation_cannot_commit_into_a_reused_slot` (the daemon refuses the late commit, the new block keeps its bytes) |
//! | a pipelined writer's reserved slot expires | `pipelined.rs::no_session_puts_into_or_gives_back_slots_it_does_not_hold` |
//! | an export's lease ends and its slots are freed | `handoff.rs::unpulled_export_expires_frees_and_refuses_late_pulls`, `p2p.rs::a_silent_readers_lock_expires_and_forged_reads_are_refused` |
//! | a side of a transfer dies mid-way | `handoff.rs::prefill_killed_mid_pull_fails_cleanly_and_shows_nothing_half_written`, `handoff.rs::decode_killed_mid_transfer_frees_the_prefill_side_within_a_lease` |
//! | a daemon restarts under a writer, a reader, a staged export or a grant (the fence) | `keep.rs::an_old_writer_and_an_old_reader_touch_no_block_of_the_new_daemon`, `keep.rs::a_staged_exports_slots_are_fenced_after_a_restart`, `keep.rs::a_grant_of_the_old_daemon_reads_nothing_of_the_kept_pool` |
//! | a sealer reads a slot as its block goes | `table::tests::a_seal_lands_only_on_its_own_commit` (unit) |
//! | a block is found damaged while a reader pins it | `store::verify::tests::a_damaged_block_pinned_by_a_reader_is_found_by_no_key_and_freed_with_its_last_pin` (unit) |
//! | a pushed slot is written again after a checked write landed in it (its recorded checksum would name other bytes) | `transfer::dataplane::tests::checked_writes_land_and_record_what_they_matched` (unit: an overlapping write forgets the record, so the import commits without a checksum rather than with a wrong one) |
//! | a pushed block is damaged in the exporter's pool between its writer's checksum and the push | `checksums.rs::a_pushed_block_keeps_its_writers_checksum_and_damage_fails_the_push` (the decode daemon refuses the range; nothing of the push is visible) |
//! | a daemon is killed just after taking over from an upgrade, and restarted at once (the old one's lock on the pool outlives it for a moment) | `upgrade.rs::a_successor_killed_is_restarted_on_its_pool`; found and held by `kvd-bench integrity` (`upgrade-prefill-daemon` then `kill-prefill-daemon`) |

mod common;

use std::os::unix::fs::FileExt;
use std::time::Duration;

use common::*;
use kvd_client::{checksum::crc32c, Error};
use kvd_protocol::{decode_reply, encode_request, CommitReq, ErrorCode, Request};

const KIB: u64 = 64;
const BYTES: usize = (KIB * 1024) as usize;

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(|b| &b[..]).collect()
}

/// Sends `frame` on `raw` and decodes the reply's body as `T` (or the error).
fn ask<T: serde::de::DeserializeOwned>(
    raw: &Raw,
    frame: Vec<u8>,
) -> Result<T, kvd_protocol::WireError> {
    raw.send(&[&frame]);
    let parts = raw.sock.recv_multipart(0).expect("a reply within 5 s");
    decode_reply::<T>(&parts[0]).expect("replies decode").1
}

/// What the pool file holds at `off` (a reader that maps the pool sees the same bytes).
fn pool_bytes(d: &Daemon, off: u64) -> Vec<u8> {
    let f = std::fs::File::open(&d.pool_path).unwrap();
    let mut b = vec![0u8; BYTES];
    f.read_exact_at(&mut b, off).unwrap();
    b
}

/// Stores `n` fresh blocks (seed `seed`) in batches: enough of them push every older
/// block out of a small pool, and their slots are reused.
fn churn(c: &kvd_client::Client, l: kvd_protocol::LayoutId, seed: u32, n: usize) {
    let ks = keys(seed, n);
    for (i, chunk) in ks.chunks(16).enumerate() {
        let data: Vec<Vec<u8>> = (0..chunk.len())
            .map(|j| block(u64::from(seed) * 10_000 + (i * 16 + j) as u64, BYTES))
            .collect();
        c.store(l, chunk, &refs(&data)).unwrap();
    }
}

#[test]
fn a_reader_past_its_pin_whose_slot_holds_another_block_reads_a_miss() {
    // 8 MiB: about 120 blocks of 64 KiB.
    let d = Daemon::start(&["--pool-size", "8MiB"]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let ks = keys(1, 1);
    let a = block(1, BYTES);
    c.store(l, &ks, &[&a]).unwrap();
    let pinned = c.get(l, &ks, Some(Duration::from_millis(200))).unwrap();
    let (off, crc) = (pinned.offsets()[0].unwrap(), pinned.crc(0).unwrap());
    assert_eq!(crc, crc32c(&a));
    eventually(10, "the pin lapsed", || {
        c.stats().unwrap().expired_pins >= 1
    });
    // Three pools' worth of other blocks: the slot now holds one of them.
    churn(&c, l, 2, 360);
    assert_eq!(c.lookup(l, &ks).unwrap().prefix, 0, "the block went");
    let now = pool_bytes(&d, off);
    assert_ne!(
        now, a,
        "the slot was reused (else this test proves nothing)"
    );
    // First defence: the client refuses to read past its pin's deadline.
    assert!(matches!(
        pinned.with_block(0, |_| ()),
        Err(Error::PinExpired)
    ));
    // Second defence: a reader that ignored the deadline holds bytes that fail the
    // checksum its `get` gave it, so a checked copy treats them as a miss.
    assert_ne!(
        crc32c(&now),
        crc,
        "the other block's bytes pass as the old one's"
    );
}

#[test]
fn a_writer_past_its_allocation_cannot_commit_into_a_reused_slot() {
    let d = Daemon::start(&["--pool-size", "8MiB", "--alloc-ttl-ms", "200"]);
    let c = d.client();
    let l = register(&c, KIB).id;
    // The late writer: its own session, by raw requests (its allocation is reclaimed
    // while it "writes").
    let raw = Raw::new(&d.endpoint, zmq::DEALER);
    let me: kvd_protocol::HelloResp = ask(
        &raw,
        encode_request(1, &Request::Hello(kvd_protocol::HelloReq::default())),
    )
    .unwrap();
    let ks = keys(3, 1);
    let a: kvd_protocol::AllocResp = ask(
        &raw,
        encode_request(
            2,
            &Request::Alloc(kvd_protocol::AllocReq {
                client: me.client,
                layout_id: l,
                keys: ks.clone(),
            }),
        ),
    )
    .unwrap();
    let off = a.offsets[0].expect("a slot");
    eventually(10, "the allocation expired", || {
        c.stats().unwrap().expired_allocs >= 1
    });
    // Another writer stores the same key meanwhile, and the pool churns: the old slot
    // holds other blocks.
    let b = block(33, BYTES);
    c.store(l, &ks, &[&b]).unwrap();
    churn(&c, l, 4, 60);
    // The late writer's bytes land in the slot it was given (shared memory: nothing
    // stops the write itself) and it asks to commit: refused, nothing is served as its.
    let late = block(99, BYTES);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&d.pool_path)
        .unwrap();
    f.write_all_at(&late, off).unwrap();
    let commit = encode_request(
        3,
        &Request::Commit(CommitReq {
            client: me.client,
            layout_id: l,
            keys: ks.clone(),
            offsets: Some(vec![off]),
            crcs: Some(vec![crc32c(&late)]),
        }),
    );
    let e = ask::<kvd_protocol::CommitResp>(&raw, commit).unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidState, "{e:?}");
    // The key serves the other writer's bytes, checked against its checksum; whatever
    // block the late write landed on reads as a miss, never as the late bytes.
    let mut out = vec![0u8; BYTES];
    let hit = c.load(l, &ks, &mut [&mut out[..]]).unwrap()[0];
    assert!(
        !hit || out == b,
        "the key served bytes that are not its writer's"
    );
    let all = keys(4, 60);
    let mut bufs = vec![vec![0u8; BYTES]; all.len()];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let hits = c.load(l, &all, &mut outs).unwrap();
    for (i, (h, got)) in hits.iter().zip(&bufs).enumerate() {
        assert!(
            !h || got != &late,
            "block {i} served the late writer's bytes"
        );
    }
}
