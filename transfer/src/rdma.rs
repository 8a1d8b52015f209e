//! RDMA data plane (feature `rdma`): raw verbs through `rdma-sys`. This module is the
//! verbs boundary: every `unsafe` call into libibverbs lives here.
//!
//! - At start, [`Verbs::open`] takes the first RDMA device (none: `Ok(None)`, and the
//!   daemon says so in one line and uses TCP), allocates a protection domain and
//!   registers the whole pool once, in slices of at most 3.5 GiB, for **local** access
//!   only (the lkeys of this side's scatter/gather entries). Peers get remote access per
//!   grant: before moving a transfer's bytes the initiator asks the grant's owner
//!   (`peer_rdma_register`, sealed), which registers exactly that grant's ranges with
//!   exactly its access and answers their rkeys; they are deregistered when the transfer
//!   frees its slots ([`super::remote_access`]). No rkey travels in a `PeerRef` or in
//!   params.
//! - One RC queue pair per peer, each with its own completion queue. Connection metadata
//!   (QPN, PSN, LID, GID) is exchanged over the control channel (`peer_rdma_connect`); the
//!   pool's base address travels in [`kvd_protocol::PeerRef::rdma`], its `regions` empty.
//! - Pull = RDMA READ of the exporter's slots into local PENDING slots; push = RDMA WRITE
//!   into the decode side's registered slots, the last work request WRITE_WITH_IMM
//!   carrying the grant handle's low 32 bits (big-endian), so the receiver sees the
//!   transfer land after every byte of it (RC ordering).
//! - The NIC cannot check leases: an importer commits RDMA-read bytes only after the
//!   exporter confirms the lease held (`peer_done` answered ok), as for `shm`; and the
//!   decode side of a push that ended early keeps its slots out of use for a quarantine
//!   (two data-plane timeouts) after which the writer's queue pair has been reset.
//! - Completions are polled by the thread that posted (the worker running the job) on
//!   that queue pair's own CQ, under the queue pair's lock, with the data-plane timeout;
//!   a timeout or error moves the queue pair to ERR (flushing anything outstanding) and
//!   drops it, so the next transfer reconnects.
//!
//! Size: ~850 lines of code: one unsafe boundary (ibverbs: device, protection domain,
//! memory regions, queue pairs, completions) kept in one file on purpose, as every
//! boundary module is.

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvd_protocol::auth::ClusterKey;
use kvd_protocol::{ErrorCode, PeerRef, RdmaRef, RdmaRegion, WireError};
use rdma_sys::*;

use super::dataplane::{Access, Caps, Op, Transport};
use super::remote_access::{Registrar, Registration};
use kvd_store::pool::Pool;

/// Largest registration (some NICs refuse larger ones).
const MR_SLICE: u64 = 3584 << 20;
const PORT: u8 = 1;
const QUEUE: u32 = 4096;

fn os(what: &str) -> WireError {
    WireError::new(
        ErrorCode::TransferFailed,
        format!("{what}: {}", std::io::Error::last_os_error()),
    )
}

/// An opened device with the pool registered.
pub struct Verbs {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    mrs: Vec<(u64, u64, *mut ibv_mr)>,
    base: u64,
    lid: u16,
    gid: [u8; 16],
    mtu: ibv_mtu::Type,
    name: String,
    /// The registered pool: held so that its mapping outlives the registrations (`Drop`
    /// deregisters them; this field is dropped after that).
    _pool: Arc<Pool>,
}

// SAFETY: libibverbs objects (context, PD, MRs) may be used from any thread; this struct
// only holds their pointers and never mutates them after `open`, and `Drop` runs once.
unsafe impl Send for Verbs {}
// SAFETY: as above: shared use only reads the pointers and calls thread-safe verbs.
unsafe impl Sync for Verbs {}

impl Verbs {
    /// Opens the first RDMA device and registers `pool`. `Ok(None)`: no device here.
    pub fn open(pool: &Arc<Pool>) -> Result<Option<Verbs>, WireError> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the returned list (maybe NULL, e.g. ENOSYS
        // without the kernel module) is freed below.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() || n <= 0 {
            if !list.is_null() {
                // SAFETY: `list` came from ibv_get_device_list and is freed once.
                unsafe { ibv_free_device_list(list) };
            }
            return Ok(None);
        }
        // SAFETY: `n > 0`, so the list holds at least one device pointer; the device
        // stays valid while the context opened from it lives (libibverbs keeps it).
        let (ctx, name) = unsafe {
            let dev = *list;
            let name = CStr::from_ptr(ibv_get_device_name(dev))
                .to_string_lossy()
                .into_owned();
            let ctx = ibv_open_device(dev);
            ibv_free_device_list(list);
            (ctx, name)
        };
        if ctx.is_null() {
            return Err(os("ibv_open_device"));
        }
        let mut v = Verbs {
            ctx,
            pd: std::ptr::null_mut(),
            mrs: Vec::new(),
            base: pool.addr(0, 0).map_or(0, |p| p as u64),
            lid: 0,
            gid: [0; 16],
            mtu: ibv_mtu::IBV_MTU_1024,
            name,
            _pool: pool.clone(),
        };
        // SAFETY: `ctx` is an open context; the attribute structs are plain C data we
        // own, zero-initialised as the verbs API expects, and outlive the calls.
        unsafe {
            v.pd = ibv_alloc_pd(ctx);
            if v.pd.is_null() {
                return Err(os("ibv_alloc_pd"));
            }
            let mut port: ibv_port_attr = std::mem::zeroed();
            if ___ibv_query_port(ctx, PORT, &mut port) != 0 {
                return Err(os("ibv_query_port"));
            }
            v.lid = port.lid;
            v.mtu = port.active_mtu;
            let mut gid: ibv_gid = std::mem::zeroed();
            if ibv_query_gid(ctx, PORT, 0, &mut gid) != 0 {
                return Err(os("ibv_query_gid"));
            }
            v.gid = gid.raw;
        }
        // Local access only: remote access is per grant (`register`).
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
        let mut off = 0u64;
        while off < pool.size() {
            let len = (pool.size() - off).min(MR_SLICE);
            let addr = pool
                .addr(off, len as usize)
                .map_err(|e| WireError::new(ErrorCode::Internal, e.to_string()))?;
            // SAFETY: `addr` is a range of `len` bytes the pool's region checked lies inside
            // its mapping, which outlives the registration: `Verbs` holds an `Arc` of the
            // pool (`_pool`), dropped only after `Drop` has deregistered every MR.
            let mr = unsafe { ibv_reg_mr(v.pd, addr.cast(), len as usize, access) };
            if mr.is_null() {
                return Err(os("ibv_reg_mr"));
            }
            v.mrs.push((off, len, mr));
            off += len;
        }
        tracing::info!(device = %v.name, slices = v.mrs.len(), "rdma: pool registered");
        Ok(Some(v))
    }

    /// What peers need to address this pool: no keys (those come per grant).
    pub fn describe(&self) -> RdmaRef {
        RdmaRef {
            lid: self.lid,
            gid: self.gid.to_vec(),
            base: self.base,
            regions: Vec::new(),
        }
    }

    fn lkey(&self, off: u64) -> Option<u32> {
        self.mrs
            .iter()
            .find(|&&(o, l, _)| off >= o && off < o + l)
            // SAFETY: `mr` is a live registration owned by `self`.
            .map(|&(_, _, mr)| unsafe { (*mr).lkey })
    }
}

impl Drop for Verbs {
    fn drop(&mut self) {
        // SAFETY: each object was created by `open`, is destroyed once, children first.
        unsafe {
            for &(_, _, mr) in &self.mrs {
                ibv_dereg_mr(mr);
            }
            if !self.pd.is_null() {
                ibv_dealloc_pd(self.pd);
            }
            ibv_close_device(self.ctx);
        }
    }
}

/// Remote-access registrations of pool ranges ([`Registrar`] for
/// [`super::remote_access::RemoteAccess`]).
pub struct VerbsRegistrar(Arc<Verbs>);

/// One registration; deregistered on drop (the `Arc` keeps the PD and the pool alive
/// until then).
struct Mr {
    mr: *mut ibv_mr,
    _verbs: Arc<Verbs>,
}

// SAFETY: an MR handle may be used and deregistered from any thread; only `Drop` uses it.
unsafe impl Send for Mr {}
// SAFETY: shared use only reads the rkey.
unsafe impl Sync for Mr {}

impl Registration for Mr {
    fn rkey(&self) -> u32 {
        // SAFETY: `self.mr` is a live registration until `Drop`.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by `VerbsRegistrar::register`, deregistered once, before the
        // PD (held by `_verbs`) goes.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

impl Registrar for VerbsRegistrar {
    fn register(
        &self,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<Box<dyn Registration>, WireError> {
        let v = &self.0;
        let addr = v
            ._pool
            .addr(offset, len as usize)
            .map_err(|e| WireError::new(ErrorCode::InvalidArgument, e.to_string()))?;
        let remote = if write {
            ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        } else {
            ibv_access_flags::IBV_ACCESS_REMOTE_READ
        };
        // REMOTE_WRITE needs LOCAL_WRITE; reads get it too (the NIC's own access).
        let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | remote).0 as i32;
        // SAFETY: `addr..addr+len` is a range the pool's region checked lies inside its
        // mapping, which outlives the MR (`Mr` holds the `Verbs`, which holds the pool).
        let mr = unsafe { ibv_reg_mr(v.pd, addr.cast(), len as usize, access) };
        if mr.is_null() {
            return Err(os("ibv_reg_mr (per grant)"));
        }
        Ok(Box::new(Mr {
            mr,
            _verbs: v.clone(),
        }))
    }
}

/// One RC queue pair and its completion queue.
pub struct Qp {
    qp: *mut ibv_qp,
    cq: *mut ibv_cq,
    psn: u32,
    /// Grant handles whose final WRITE_WITH_IMM arrived.
    landed: Vec<u32>,
}

// SAFETY: a `Qp` is only used under its owner's `Mutex`, one thread at a time.
unsafe impl Send for Qp {}

impl Qp {
    /// Creates a queue pair in INIT.
    pub fn create(v: &Verbs) -> Result<Qp, WireError> {
        // SAFETY: `v.ctx`/`v.pd` are live; the init attributes are owned C data.
        unsafe {
            let cq = ibv_create_cq(
                v.ctx,
                (QUEUE * 2) as i32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            );
            if cq.is_null() {
                return Err(os("ibv_create_cq"));
            }
            let mut init: ibv_qp_init_attr = std::mem::zeroed();
            init.send_cq = cq;
            init.recv_cq = cq;
            init.cap.max_send_wr = QUEUE;
            init.cap.max_recv_wr = 256;
            init.cap.max_send_sge = 1;
            init.cap.max_recv_sge = 1;
            init.qp_type = ibv_qp_type::IBV_QPT_RC;
            let qp = ibv_create_qp(v.pd, &mut init);
            if qp.is_null() {
                ibv_destroy_cq(cq);
                return Err(os("ibv_create_qp"));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_INIT;
            a.pkey_index = 0;
            a.port_num = PORT;
            a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ibv_access_flags::IBV_ACCESS_REMOTE_READ
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0;
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
            let q = Qp {
                qp,
                cq,
                psn: rand::random::<u32>() & 0xff_ffff,
                landed: Vec::new(),
            };
            if ibv_modify_qp(qp, &mut a, mask.0 as i32) != 0 {
                return Err(os("ibv_modify_qp INIT"));
            }
            q.post_recvs(256)?;
            Ok(q)
        }
    }

    /// This end's (QPN, PSN) for the peer.
    pub fn local(&self) -> (u32, u32) {
        // SAFETY: `self.qp` is live.
        (unsafe { (*self.qp).qp_num }, self.psn)
    }

    /// INIT → RTR → RTS towards the peer's queue pair.
    pub fn connect(
        &mut self,
        v: &Verbs,
        peer: &RdmaRef,
        qpn: u32,
        psn: u32,
    ) -> Result<(), WireError> {
        let mut gid = [0u8; 16];
        if peer.gid.len() == 16 {
            gid.copy_from_slice(&peer.gid);
        }
        // SAFETY: `self.qp` is live; the attributes are owned, zero-initialised C data.
        unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = v.mtu;
            a.dest_qp_num = qpn;
            a.rq_psn = psn;
            a.max_dest_rd_atomic = 16;
            a.min_rnr_timer = 12;
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = gid;
            a.ah_attr.grh.sgid_index = 0;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.dlid = peer.lid;
            a.ah_attr.port_num = PORT;
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            if ibv_modify_qp(self.qp, &mut a, mask.0 as i32) != 0 {
                return Err(os("ibv_modify_qp RTR"));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_RTS;
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.sq_psn = self.psn;
            a.max_rd_atomic = 16;
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            if ibv_modify_qp(self.qp, &mut a, mask.0 as i32) != 0 {
                return Err(os("ibv_modify_qp RTS"));
            }
        }
        Ok(())
    }

    fn post_recvs(&self, n: usize) -> Result<(), WireError> {
        for i in 0..n {
            // SAFETY: a zero-SGE receive (WRITE_WITH_IMM consumes one, carrying no data);
            // the WR is read by the call only.
            let rc = unsafe {
                let mut wr: ibv_recv_wr = std::mem::zeroed();
                wr.wr_id = i as u64;
                let mut bad = std::ptr::null_mut();
                ibv_post_recv(self.qp, &mut wr, &mut bad)
            };
            if rc != 0 {
                return Err(WireError::new(
                    ErrorCode::TransferFailed,
                    format!("ibv_post_recv: {rc}"),
                ));
            }
        }
        Ok(())
    }

    /// Posts one RDMA op per range (READ, or WRITE with the last one WRITE_WITH_IMM
    /// carrying `imm`) into the peer's `regions` (the grant's registrations) and waits for
    /// them, up to `timeout`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        v: &Verbs,
        peer: &RdmaRef,
        regions: &[RdmaRegion],
        read: bool,
        imm: Option<u32>,
        ops: &[Op],
        timeout: Duration,
    ) -> Result<u64, WireError> {
        let mut bytes = 0u64;
        for chunk in ops.chunks((QUEUE / 2) as usize) {
            let mut sges = Vec::with_capacity(chunk.len());
            let mut wrs: Vec<ibv_send_wr> = Vec::with_capacity(chunk.len());
            for (i, op) in chunk.iter().enumerate() {
                let lkey = v.lkey(op.local).ok_or_else(|| {
                    WireError::new(
                        ErrorCode::InvalidArgument,
                        "local range outside the registered pool",
                    )
                })?;
                let region = regions
                    .iter()
                    .find(|r| {
                        op.remote >= r.offset
                            && op
                                .remote
                                .checked_add(op.len)
                                .is_some_and(|e| e <= r.offset + r.len)
                    })
                    .ok_or_else(|| {
                        WireError::new(
                            ErrorCode::InvalidArgument,
                            "remote range outside what the peer registered for this grant",
                        )
                    })?;
                let len = u32::try_from(op.len)
                    .map_err(|_| WireError::new(ErrorCode::InvalidArgument, "range over 4 GiB"))?;
                sges.push(ibv_sge {
                    addr: v.base + op.local,
                    length: len,
                    lkey,
                });
                let last = i + 1 == chunk.len();
                // SAFETY: a zeroed ibv_send_wr is a valid "empty" request; the fields
                // set below are the ones RC READ/WRITE use.
                let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
                wr.wr_id = i as u64;
                wr.num_sge = 1;
                wr.opcode = match (read, last && imm.is_some()) {
                    (true, _) => ibv_wr_opcode::IBV_WR_RDMA_READ,
                    (false, true) => ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                    (false, false) => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                };
                if last {
                    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
                    if let Some(imm) = imm {
                        wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                    }
                }
                wr.wr.rdma = rdma_t {
                    remote_addr: peer.base + op.remote,
                    rkey: region.rkey,
                };
                wrs.push(wr);
                bytes += op.len;
            }
            let n = wrs.len();
            for i in 0..n {
                wrs[i].sg_list = &mut sges[i];
                if i + 1 < n {
                    let next: *mut ibv_send_wr = &mut wrs[i + 1];
                    wrs[i].next = next;
                }
            }
            let mut bad = std::ptr::null_mut();
            // SAFETY: `wrs` and `sges` outlive the call and the completion wait below
            // (the NIC reads the WRs during the call; the SGEs name registered pool
            // memory, which is live).
            let rc = unsafe { ibv_post_send(self.qp, wrs.as_mut_ptr(), &mut bad) };
            if rc != 0 {
                return Err(WireError::new(
                    ErrorCode::TransferFailed,
                    format!("ibv_post_send: {rc}"),
                ));
            }
            self.wait_send(timeout)?;
        }
        Ok(bytes)
    }

    /// Waits for the signalled send completion; records immediates that arrive.
    fn wait_send(&mut self, timeout: Duration) -> Result<(), WireError> {
        let until = Instant::now() + timeout;
        loop {
            // SAFETY: a zeroed ibv_wc is valid storage for one completion.
            let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
            // SAFETY: `self.cq` is live; `wc` has room for one entry.
            let n = unsafe { ibv_poll_cq(self.cq, 1, &mut wc) };
            if n < 0 {
                return Err(WireError::new(
                    ErrorCode::TransferFailed,
                    "ibv_poll_cq failed",
                ));
            }
            if n == 1 {
                if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                    return Err(WireError::new(
                        ErrorCode::TransferFailed,
                        format!("rdma completion status {}", wc.status),
                    ));
                }
                if wc.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                    // SAFETY: the union holds imm_data for this opcode.
                    self.landed.push(u32::from_be(unsafe {
                        wc.imm_data_invalidated_rkey_union.imm_data
                    }));
                    self.post_recvs(1)?;
                    continue;
                }
                return Ok(());
            }
            if Instant::now() > until {
                return Err(WireError::new(
                    ErrorCode::PeerUnreachable,
                    "rdma completion timed out",
                ));
            }
            std::hint::spin_loop();
        }
    }

    /// Drains receive completions; returns the handles (low 32 bits) that landed.
    fn drain(&mut self) -> Vec<u32> {
        loop {
            // SAFETY: as in `wait_send`.
            let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
            // SAFETY: as in `wait_send`.
            let n = unsafe { ibv_poll_cq(self.cq, 1, &mut wc) };
            if n != 1 {
                break;
            }
            if wc.status == ibv_wc_status::IBV_WC_SUCCESS
                && wc.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
            {
                // SAFETY: the union holds imm_data for this opcode.
                self.landed.push(u32::from_be(unsafe {
                    wc.imm_data_invalidated_rkey_union.imm_data
                }));
                let _ = self.post_recvs(1);
            }
        }
        std::mem::take(&mut self.landed)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by `create`, destroyed once, QP before its CQ.
        unsafe {
            ibv_destroy_qp(self.qp);
            ibv_destroy_cq(self.cq);
        }
    }
}

type PeerKey = (String, u64);

/// The RDMA [`Transport`]: queue pairs per peer, connected on first use through the
/// peer's control endpoint.
pub struct RdmaTransport {
    verbs: Arc<Verbs>,
    me: Mutex<Option<PeerRef>>,
    /// Queue pairs by peer (control endpoint, incarnation), whichever side connected.
    qps: Mutex<HashMap<PeerKey, Arc<Mutex<Qp>>>>,
    timeout: Duration,
    zmq: zmq::Context,
    /// Seals the queue-pair handshake (a peer op like any other: unsealed, it is refused).
    key: ClusterKey,
    landed: Mutex<Vec<u32>>,
    /// The registrations peers made for their grants: (control endpoint, incarnation,
    /// handle) → ranges and rkeys.
    regions: Mutex<HashMap<(String, u64, u64), Vec<RdmaRegion>>>,
}

impl RdmaTransport {
    /// Opens the device; `None` when there is none.
    pub fn open(
        pool: &Arc<Pool>,
        key: ClusterKey,
        timeout: Duration,
    ) -> Result<Option<RdmaTransport>, WireError> {
        Ok(Verbs::open(pool)?.map(|v| RdmaTransport {
            key,
            verbs: Arc::new(v),
            me: Mutex::new(None),
            qps: Mutex::new(HashMap::new()),
            timeout,
            zmq: zmq::Context::new(),
            landed: Mutex::new(Vec::new()),
            regions: Mutex::new(HashMap::new()),
        }))
    }

    /// Per-grant remote access to this daemon's pool, through this device.
    pub fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(VerbsRegistrar(self.verbs.clone()))
    }

    /// What this daemon advertises.
    pub fn describe(&self) -> RdmaRef {
        self.verbs.describe()
    }

    /// Sets this daemon's identity (used in `peer_rdma_connect`).
    pub fn set_me(&self, me: PeerRef) {
        *self.me.lock().unwrap_or_else(|p| p.into_inner()) = Some(me);
    }

    /// The passive side of `peer_rdma_connect`: a queue pair for `peer`, connected to
    /// its (qpn, psn); returns ours.
    pub fn accept(&self, peer: &PeerRef, qpn: u32, psn: u32) -> Result<(u32, u32), WireError> {
        let r = peer.rdma.as_ref().ok_or_else(|| {
            WireError::new(ErrorCode::InvalidArgument, "peer has no rdma description")
        })?;
        let mut qp = Qp::create(&self.verbs)?;
        qp.connect(&self.verbs, r, qpn, psn)?;
        let local = qp.local();
        self.qps.lock().unwrap_or_else(|p| p.into_inner()).insert(
            (peer.node.clone(), peer.incarnation.0),
            Arc::new(Mutex::new(qp)),
        );
        Ok(local)
    }

    /// Grant handles (low 32 bits) whose pushed bytes have fully landed.
    pub fn landed(&self) -> Vec<u32> {
        let qps: Vec<_> = self
            .qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        let mut out = std::mem::take(&mut *self.landed.lock().unwrap_or_else(|p| p.into_inner()));
        for q in qps {
            if let Ok(mut q) = q.try_lock() {
                out.extend(q.drain());
            }
        }
        out
    }

    fn qp_for(&self, peer: &PeerRef) -> Result<Arc<Mutex<Qp>>, WireError> {
        let key = (peer.node.clone(), peer.incarnation.0);
        if let Some(q) = self.qps.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(q.clone());
        }
        let r = peer.rdma.as_ref().ok_or_else(|| {
            WireError::new(ErrorCode::InvalidArgument, "peer has no rdma description")
        })?;
        let mut qp = Qp::create(&self.verbs)?;
        let (qpn, psn) = qp.local();
        let me = self
            .me
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| WireError::new(ErrorCode::Internal, "rdma transport has no identity"))?;
        let (rq, rp) = handshake(&self.zmq, &self.key, &me, peer, qpn, psn, self.timeout)?;
        qp.connect(&self.verbs, r, rq, rp)?;
        let q = Arc::new(Mutex::new(qp));
        self.qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, q.clone());
        Ok(q)
    }

    /// The peer's registrations for the grant in `a` (asked once per grant, sealed).
    fn regions_for(&self, a: &Access, write: bool) -> Result<Vec<RdmaRegion>, WireError> {
        let key = (a.peer.node.clone(), a.peer.incarnation.0, a.handle);
        if let Some(r) = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(r.clone());
        }
        let me = self
            .me
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| WireError::new(ErrorCode::Internal, "rdma transport has no identity"))?;
        let req = kvd_protocol::Request::PeerRdmaRegister(kvd_protocol::PeerRdmaRegisterReq {
            from: me,
            to_incarnation: a.peer.incarnation,
            handle: a.handle,
            token: a.token,
            write,
        });
        let ack = peer_call(&self.zmq, &self.key, &a.peer, &req, self.timeout)?;
        let mut cache = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        // Grants are short-lived: a bounded cache, dropped whole when full.
        if cache.len() >= 4096 {
            cache.clear();
        }
        cache.insert(key, ack.rdma_regions.clone());
        Ok(ack.rdma_regions)
    }

    fn run(&self, a: &Access, ops: &[Op], read: bool) -> Result<u64, WireError> {
        let q = self.qp_for(&a.peer)?;
        let r = a.peer.rdma.as_ref().ok_or_else(|| {
            WireError::new(ErrorCode::InvalidArgument, "peer has no rdma description")
        })?;
        let regions = self.regions_for(a, !read)?;
        let mut qp = q.lock().unwrap_or_else(|p| p.into_inner());
        let imm = (!read).then_some(a.handle as u32);
        let out = qp.run(
            &self.verbs,
            r,
            &regions,
            read,
            imm,
            &super::dataplane::coalesce(ops),
            self.timeout,
        );
        if out.is_err() {
            // Drop the queue pair (destroying it flushes outstanding requests) and the
            // grant's keys (the grant may have ended).
            self.landed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(qp.drain());
            drop(qp);
            self.qps
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(a.peer.node.clone(), a.peer.incarnation.0));
            self.regions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&(a.peer.node.clone(), a.peer.incarnation.0, a.handle));
        }
        out
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }
    fn caps(&self) -> Caps {
        Caps {
            one_sided: true,
            from_named_file: false,
            remote_completion: true,
        }
    }
    fn read(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        self.run(access, ops, true)
    }
    fn write(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        self.run(access, ops, false)
    }
}

/// `peer_rdma_connect` over a private DEALER, sealed like every peer op (SPEC §10.1),
/// its reply verified: returns the peer's (qpn, psn).
pub fn handshake(
    ctx: &zmq::Context,
    key: &ClusterKey,
    me: &PeerRef,
    peer: &PeerRef,
    qpn: u32,
    psn: u32,
    timeout: Duration,
) -> Result<(u32, u32), WireError> {
    let req = kvd_protocol::Request::PeerRdmaConnect(kvd_protocol::PeerRdmaConnectReq {
        from: me.clone(),
        to_incarnation: peer.incarnation,
        qpn,
        psn,
    });
    let ack = peer_call(ctx, key, peer, &req, timeout)?;
    match (ack.rdma_qpn, ack.rdma_psn) {
        (Some(q), Some(p)) => Ok((q, p)),
        _ => Err(WireError::new(
            ErrorCode::TransferFailed,
            "rdma handshake reply without a queue pair",
        )),
    }
}

/// One peer op from a worker thread over a private DEALER, sealed, its reply verified
/// (the server thread's peer links are not reachable from here): the peer's ack.
pub fn peer_call(
    ctx: &zmq::Context,
    key: &ClusterKey,
    peer: &PeerRef,
    req: &kvd_protocol::Request,
    timeout: Duration,
) -> Result<kvd_protocol::PeerAck, WireError> {
    use kvd_protocol::{decode_reply, encode_request, PeerAck};
    let op = req.op();
    let unreachable = |e: zmq::Error| {
        WireError::new(
            ErrorCode::PeerUnreachable,
            format!("{op} to {}: {e}", peer.node),
        )
    };
    let s = ctx.socket(zmq::DEALER).map_err(unreachable)?;
    s.set_linger(0).map_err(unreachable)?;
    s.connect(&peer.node).map_err(unreachable)?;
    let frame = encode_request(1, req);
    let stamp = crate::auth::stamp();
    let auth = key.seal_request(stamp, &peer.node, &frame);
    s.send(frame, zmq::SNDMORE).map_err(unreachable)?;
    s.send(&auth[..], 0).map_err(unreachable)?;
    if s.poll(zmq::POLLIN, timeout.as_millis() as i64)
        .map_err(unreachable)?
        == 0
    {
        return Err(WireError::new(
            ErrorCode::PeerUnreachable,
            format!("{} did not answer {op}", peer.node),
        ));
    }
    let parts = s.recv_multipart(0).map_err(unreachable)?;
    let (Some(frame), Some(seal)) = (parts.first(), parts.get(1)) else {
        return Err(WireError::new(
            ErrorCode::Unauthenticated,
            format!("{} answered {op} unsealed", peer.node),
        ));
    };
    key.open_reply(stamp, frame, seal).map_err(|e| {
        WireError::new(
            ErrorCode::Unauthenticated,
            format!("{op} reply from {}: {e}", peer.node),
        )
    })?;
    match decode_reply::<PeerAck>(frame) {
        Ok((_, Ok(ack))) => Ok(ack),
        Ok((_, Err(e))) => Err(e),
        Err(e) => Err(WireError::new(ErrorCode::Malformed, e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_store::pool::PoolOptions;

    #[test]
    fn rdma_device_is_used_or_its_absence_reported() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let pool = Pool::create(
            &PoolOptions {
                path: dir.path().join("p"),
                size_bytes: 8 << 20,
                huge_pages: false,
                prefault: false,
                group: None,
                keep: false,
            },
            kvd_protocol::Incarnation(1),
        )
        .unwrap();
        let pool = Arc::new(pool);
        match Verbs::open(&pool) {
            Ok(None) => {
                assert!(
                    std::env::var_os("KVD_REQUIRE_RDMA").is_none(),
                    "an RDMA device is required (KVD_REQUIRE_RDMA) but there is none"
                );
                println!("SKIP: no RDMA device on this machine; verbs registration not exercised")
            }
            Ok(Some(v)) => {
                let d = v.describe();
                assert_eq!(d.base, pool.addr(0, 0).unwrap() as u64);
                assert!(
                    d.regions.is_empty(),
                    "no pool-wide remote keys are advertised"
                );
                let qp = Qp::create(&v).unwrap();
                assert_ne!(qp.local().0, 0);
            }
            Err(e) => panic!("an RDMA device is present but unusable: {e}"),
        }
    }
}
