//! Model test of the tenants' shares (SPEC §18): three tenants store, pin, release and
//! delete at random over a small pool, and after every step the rules hold —
//! no store of one tenant takes another below its minimum, a tenant's bytes never pass
//! its maximum, and the index's per-tenant bytes equal the sum over its blocks. The
//! negative control runs a fixed noisy sequence through one global LRU (the victim
//! rule taken out) and sees the first rule broken.

use proptest::prelude::*;

use super::tests::{bare_store, layout};
use super::*;
use crate::tenants::{TenantId, TenantSpec, Use};

const KIB16: u64 = 16 * 1024;

/// Tenants: 0 "quiet" (min 4 blocks' worth), 1 "noisy" (no min), 2 "capped" (max 6
/// blocks' worth).
fn specs() -> Vec<TenantSpec> {
    vec![
        TenantSpec {
            dram_min: 4 * KIB16,
            ..TenantSpec::named("quiet")
        },
        TenantSpec::named("noisy"),
        TenantSpec {
            dram_max: 6 * KIB16,
            pinned_max: 3 * KIB16,
            ..TenantSpec::named("capped")
        },
    ]
}

struct World {
    s: Store,
    now: Instant,
    clients: Vec<ClientId>,
    layouts: Vec<LayoutId>,
    pins: Vec<(usize, PinId)>,
    /// Per tenant, slots it reserved and has not put or given back.
    reserved: Vec<Vec<u64>>,
    _dir: tempfile::TempDir,
}

#[derive(Clone, Debug)]
enum Op {
    Store { t: usize, first: u32, n: u32 },
    Pin { t: usize, first: u32, n: u32 },
    Release,
    Delete { t: usize, first: u32, n: u32 },
    Reserve { t: usize, n: u64 },
    Put { t: usize, first: u32 },
    Unreserve { t: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..3usize, 0..40u32, 1..5u32).prop_map(|(t, first, n)| Op::Store { t, first, n }),
        2 => (0..3usize, 0..40u32, 1..4u32).prop_map(|(t, first, n)| Op::Pin { t, first, n }),
        2 => Just(Op::Release),
        1 => (0..3usize, 0..40u32, 1..4u32).prop_map(|(t, first, n)| Op::Delete { t, first, n }),
        2 => (0..3usize, 1..5u64).prop_map(|(t, n)| Op::Reserve { t, n }),
        1 => (0..3usize, 0..40u32).prop_map(|(t, first)| Op::Put { t, first }),
        1 => (0..3usize).prop_map(|t| Op::Unreserve { t }),
    ]
}

fn key(t: usize, i: u32) -> ChunkHash {
    kvd_protocol::hash::chunk(&ChunkHash([t as u8; 16]), &[i])
}

impl World {
    /// 16 segments of 64 KiB: 64 blocks of 16 KiB.
    fn new() -> World {
        let (mut s, now, dir) = bare_store(16);
        s.set_tenants(&specs()).unwrap();
        let mut clients = Vec::new();
        let mut layouts = Vec::new();
        for t in 0..3u8 {
            clients.push(s.hello_as(&HelloReq::default(), TenantId(t), now).unwrap());
            s.register_layout_for(&layout(16), TenantId(t)).unwrap();
            layouts.push(s.namespace(TenantId(t), layout(16).id()));
        }
        World {
            s,
            now,
            clients,
            layouts,
            pins: Vec::new(),
            reserved: vec![Vec::new(); 3],
            _dir: dir,
        }
    }

    fn keys(t: usize, first: u32, n: u32) -> Vec<ChunkHash> {
        (first..first + n).map(|i| key(t, i)).collect()
    }

    fn apply(&mut self, op: &Op) {
        self.now += Duration::from_secs(1);
        let now = self.now;
        match *op {
            Op::Store { t, first, n } => {
                let (client, layout_id) = (self.clients[t], self.layouts[t]);
                let keys = Self::keys(t, first, n);
                let a = self.s.alloc(
                    &AllocReq {
                        client,
                        layout_id,
                        keys: keys.clone(),
                    },
                    now,
                );
                if let Ok(Answer::Now(r)) = a {
                    let keys: Vec<ChunkHash> = keys
                        .iter()
                        .zip(&r.status)
                        .filter(|(_, s)| **s == AllocStatus::New)
                        .map(|(k, _)| *k)
                        .collect();
                    let c = CommitReq {
                        client,
                        layout_id,
                        keys,
                        offsets: None,
                        crcs: None,
                    };
                    self.s.commit(&c, &[], now).unwrap();
                }
            }
            Op::Pin { t, first, n } => {
                let (client, layout_id) = (self.clients[t], self.layouts[t]);
                let keys = Self::keys(t, first, n);
                let g = GetReq {
                    client,
                    layout_id,
                    keys,
                    ttl_ms: Some(60_000),
                    inline: false,
                };
                if let Ok(Answer::Now(r)) = self.s.get(&g, now) {
                    if let Some(p) = r.pin {
                        self.pins.push((t, p));
                    }
                }
            }
            Op::Release => {
                if let Some((t, p)) = self.pins.pop() {
                    let r = ReleaseReq {
                        client: self.clients[t],
                        pins: vec![p],
                    };
                    self.s.release(&r, now).unwrap();
                }
            }
            Op::Reserve { t, n } => {
                let (client, layout_id) = (self.clients[t], self.layouts[t]);
                let r = ReserveReq {
                    client,
                    layout_id,
                    count: n,
                };
                if let Ok(Answer::Now(r)) = self.s.reserve(&r, now) {
                    self.reserved[t].extend(r.offsets);
                }
            }
            Op::Put { t, first } => {
                let (client, layout_id) = (self.clients[t], self.layouts[t]);
                let offsets = std::mem::take(&mut self.reserved[t]);
                let keys = Self::keys(t, first + 100, offsets.len() as u32);
                if !offsets.is_empty() {
                    let p = PutReq {
                        client,
                        layout_id,
                        keys,
                        offsets,
                        crcs: None,
                    };
                    self.s.put(&p, now).unwrap();
                }
            }
            Op::Unreserve { t } => {
                let offsets = std::mem::take(&mut self.reserved[t]);
                if !offsets.is_empty() {
                    let u = UnreserveReq {
                        client: self.clients[t],
                        offsets,
                    };
                    self.s.unreserve(&u, now).unwrap();
                }
            }
            Op::Delete { t, first, n } => {
                let (client, layout_id) = (self.clients[t], self.layouts[t]);
                let keys = Self::keys(t, first, n);
                self.s
                    .delete(
                        &DeleteReq {
                            client,
                            layout_id,
                            keys,
                        },
                        now,
                    )
                    .unwrap();
            }
        }
    }

    fn uses(&self) -> Vec<Use> {
        self.s.index.uses().to_vec()
    }

    /// A rule broken by `op`, which took the tenants from `before` to now.
    fn broken(&self, op: &Op, before: &[Use]) -> Option<String> {
        let after = self.uses();
        let own = match op {
            Op::Store { t, .. }
            | Op::Pin { t, .. }
            | Op::Delete { t, .. }
            | Op::Reserve { t, .. }
            | Op::Put { t, .. }
            | Op::Unreserve { t } => Some(*t),
            Op::Release => None,
        };
        for (i, spec) in specs().iter().enumerate() {
            let (b, a) = (before[i].held, after[i].held);
            if Some(i) != own && a < b && a < spec.dram_min {
                return Some(format!(
                    "{op:?} took tenant {} from {b} to {a} bytes, below its minimum {}",
                    spec.name, spec.dram_min
                ));
            }
            if a > spec.dram_max {
                return Some(format!("tenant {} holds {a} > its maximum", spec.name));
            }
            if after[i].pinned > spec.pinned_max {
                return Some(format!(
                    "tenant {} pins {} > its limit",
                    spec.name, after[i].pinned
                ));
            }
        }
        None
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn shares_hold_after_every_step(ops in proptest::collection::vec(op(), 1..120)) {
        let mut w = World::new();
        for op in &ops {
            let before = w.uses();
            w.apply(op);
            if let Some(why) = w.broken(op, &before) {
                return Err(TestCaseError::fail(why));
            }
            // the index's per-tenant bytes are its blocks' slots
            let total: u64 = w.uses().iter().map(|u| u.held).sum();
            prop_assert!(total <= w.s.alloc.capacity_bytes());
        }
    }
}

/// The quiet tenant fills its minimum, then stops; the noisy one streams.
fn noisy_run(w: &mut World) -> Option<String> {
    let mut ops = vec![Op::Store {
        t: 0,
        first: 0,
        n: 4,
    }];
    for i in 0..40 {
        ops.push(Op::Store {
            t: 1,
            first: i * 4,
            n: 4,
        });
    }
    for op in &ops {
        let before = w.uses();
        w.apply(op);
        if let Some(why) = w.broken(op, &before) {
            return Some(why);
        }
    }
    None
}

#[test]
fn the_rules_hold_for_a_noisy_stream() {
    let mut w = World::new();
    assert_eq!(noisy_run(&mut w), None);
    assert_eq!(
        w.uses()[0].held,
        4 * KIB16,
        "the quiet tenant kept its blocks"
    );
}

#[test]
fn negative_control_one_global_lru_takes_the_quiet_tenant_below_its_minimum() {
    let mut w = World::new();
    w.s.global_lru_for_tests = true;
    let why = noisy_run(&mut w).expect("one global LRU breaks the minimum");
    assert!(why.contains("quiet"), "{why}");
}
