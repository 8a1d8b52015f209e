//! The data plane: bytes between two daemons' pools, behind one [`Transport`] trait.
//!
//! | file | what it owns |
//! |---|---|
//! | `mod.rs` | what a transfer moves ([`Op`], [`Dir`], [`coalesce`], [`split`]), who with ([`Access`]), the [`Transport`] trait, the status and piece helpers both TCP ends share |
//! | `server.rs` | [`DataServer`]: the TCP listener serving one-sided reads and writes straight from and into pool slots, one thread per connection, admitted by the [`super::gate`]; every request checked against its grant ([`super::grants`]) and its MAC |
//! | `tcp.rs` | [`TcpTransport`]: the client side: a connection pool per peer, a transfer's ranges coalesced and split over parallel streams; bytes go from the socket straight into the pool and back, with no staging copy |
//! | `shm.rs` | [`ShmTransport`]: same host: the peer's pool file mapped read-only |
//! | `workers.rs` | [`DataPlane`]: worker threads that run transfer jobs and report completions to the server thread through a channel and a wake-up socket it polls |
//!
//! The wire format of a TCP data connection is [`kvd_protocol::data`] (SPEC §10, "Data
//! plane (TCP)"). A refused write closes the connection (its bytes are not drained), and
//! so does a request whose MAC is missing, wrong, stale, replayed or addressed to another
//! server: without the cluster secret a peer gets no byte, whatever params it holds. The
//! MAC covers the request, not the bytes that follow it (their integrity on the wire is
//! the crc flag's: accidental damage, not an on-path forger).

use std::io::{self, Read, Write};

use kvd_protocol::data::{self, pad_for, STATUS_BYTES};
use kvd_protocol::{PeerRef, WireError};

mod server;
mod shm;
mod tcp;
#[cfg(test)]
mod tests;
mod workers;

#[cfg(fuzzing)]
pub use server::parse_request;
pub use server::{DataOptions, DataServer};
pub use shm::ShmTransport;
pub use tcp::TcpTransport;
pub use workers::{DataPlane, Job, JobDone};

/// Most ranges in one data-plane request.
pub use kvd_protocol::data::MAX_RANGES;

/// Ranges of a job are split into pieces of at least this size to spread them over
/// streams (a smaller transfer goes on one stream: a second one costs more than it
/// saves).
const MIN_PIECE: u64 = 4 << 20;

/// Read or write.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dir {
    /// Remote → local.
    Read = 1,
    /// Local → remote.
    Write = 2,
}

/// One contiguous copy: `len` bytes between `remote` (the peer's pool) and `local`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Op {
    /// Offset in the peer's pool.
    pub remote: u64,
    /// Offset in this pool.
    pub local: u64,
    /// Bytes.
    pub len: u64,
    /// The writer checksum of these bytes (SPEC §17), when they are one whole block that
    /// has one: a checked write sends it in its CRC table, so the receiving server checks
    /// the bytes against what their writer computed, not against a checksum of this
    /// pool's copy. Such an op is neither merged with another nor cut.
    pub crc: Option<u32>,
}

impl Op {
    /// `len` bytes from local `local` to remote `remote`, no writer checksum.
    pub fn new(remote: u64, local: u64, len: u64) -> Op {
        Op {
            remote,
            local,
            len,
            crc: None,
        }
    }
}

/// Merges ops whose remote and local ranges both continue the previous one (adjacent
/// slots move as one range), keeping order; ops that carry a writer checksum stay whole.
pub fn coalesce(ops: &[Op]) -> Vec<Op> {
    let mut out: Vec<Op> = Vec::with_capacity(ops.len());
    for op in ops {
        if let Some(last) = out.last_mut() {
            if last.remote + last.len == op.remote
                && last.local + last.len == op.local
                && last.crc.is_none()
                && op.crc.is_none()
            {
                last.len += op.len;
                continue;
            }
        }
        out.push(*op);
    }
    out
}

/// Splits `ops` into at most `streams` groups of about equal bytes (cutting large ops,
/// but not one with a writer checksum: it goes whole).
pub fn split(ops: &[Op], streams: usize) -> Vec<Vec<Op>> {
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let streams = streams.max(1);
    let share = (total.div_ceil(streams as u64)).max(MIN_PIECE);
    let mut groups: Vec<Vec<Op>> = vec![Vec::new()];
    let mut filled = 0u64;
    for op in ops {
        let mut op = *op;
        while op.len > 0 {
            if filled >= share && groups.len() < streams {
                groups.push(Vec::new());
                filled = 0;
            }
            let room = if groups.len() < streams {
                share - filled.min(share)
            } else {
                u64::MAX
            };
            let take = if op.crc.is_some() {
                op.len
            } else {
                op.len.min(room.max(1))
            };
            groups
                .last_mut()
                .expect("one group at least")
                .push(Op { len: take, ..op });
            filled += take;
            op.remote += take;
            op.local += take;
            op.len -= take;
        }
    }
    groups.retain(|g| !g.is_empty());
    groups
}

/// A checked range is checksummed by the sender in pieces of this size, each just before
/// it goes out (the checksum's read brings it into cache for the kernel's copy); the
/// reader checksums the bytes of each `read` as they land, at most a piece per `read`. A
/// range up to this size goes out whole, in one `writev`.
///
/// Why 1 MiB: on the 2 vCPU VM, loopback, two streams of 8 MiB (bench/README.md, "Checked
/// reads in 1 MiB pieces"), 256 KiB pieces ran at 0.79–0.86 of unchecked reads and 1 MiB
/// at 0.90–0.94; the sender's piece size made the difference (each piece is a `writev`
/// that wakes the reader), the reader's much less.
pub(super) const CRC_PIECE: u64 = 1 << 20;

/// A block read from a peer does not match the writer checksum its params named (SPEC
/// §17): the transfer fails (the decode engine computes), nothing of it is committed.
pub(super) fn not_the_writers(remote: u64, want: u32, got: u32) -> WireError {
    tracing::warn!(
        offset = remote,
        want,
        got,
        "a pulled block does not match its writer checksum: the transfer fails"
    );
    WireError::new(
        kvd_protocol::ErrorCode::TransferFailed,
        format!("the block read at {remote} does not match its writer checksum ({want:#010x}, read {got:#010x})"),
    )
}

/// Writes a response status ([`data::status_bytes`]).
pub(super) fn write_status(w: &mut impl Write, err: Option<&WireError>) -> io::Result<()> {
    w.write_all(&data::status_bytes(err))
}

/// Writes all of `bufs` (one `writev` when the socket takes it all: a status and the
/// bytes after it leave as one segment train and wake the reader once, not twice).
/// On failure, also says how many bytes had been written.
pub(super) fn write_all_vectored(
    w: &mut impl Write,
    bufs: &mut [io::IoSlice<'_>],
) -> Result<(), (io::Error, usize)> {
    let mut bufs = bufs;
    let mut written = 0;
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err((io::ErrorKind::WriteZero.into(), written)),
            Ok(n) => {
                written += n;
                io::IoSlice::advance_slices(&mut bufs, n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((e, written)),
        }
    }
    Ok(())
}

/// Reads a response status; `Err(Ok(e))` is the peer's refusal, `Err(Err(io))` a broken
/// connection.
pub(super) fn read_status(r: &mut impl Read) -> Result<(), Result<WireError, io::Error>> {
    let mut b = [0u8; STATUS_BYTES];
    r.read_exact(&mut b).map_err(Err)?;
    let len = match data::parse_status(&b) {
        Ok(None) => return Ok(()),
        Ok(Some(len)) => len,
        Err(m) => return Err(Err(io::Error::new(io::ErrorKind::InvalidData, m))),
    };
    let mut msg = vec![0u8; len + pad_for(len)];
    r.read_exact(&mut msg).map_err(Err)?;
    msg.truncate(len);
    Err(Ok(data::refusal(&msg)))
}

/// Who to talk to and with which rights.
#[derive(Clone, Debug)]
pub struct Access {
    /// The peer.
    pub peer: PeerRef,
    /// The grant's handle on the peer.
    pub handle: u64,
    /// Its token.
    pub token: u64,
    /// Check a CRC-32C of every range read (TCP: computed by the sender as it sends).
    pub verify: bool,
}

/// A way to move bytes between this pool and a peer's.
pub trait Transport: Send + Sync {
    /// `tcp`, `shm`, `rdma` (for reports and metrics only: behaviour follows
    /// [`Transport::caps`]).
    fn name(&self) -> &'static str;
    /// What this transport does and does not check, which decides what the importer must
    /// confirm before it commits.
    fn caps(&self) -> Caps;
    /// Copies the peer's ranges into local slots; returns bytes moved.
    fn read(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError>;
    /// Copies local slots into the peer's ranges; returns bytes moved.
    fn write(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError>;
}

/// What a transport vouches for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// The exporter checks nothing while the bytes move (a one-sided copy: shm, RDMA):
    /// the importer commits only once the exporter confirms, over the authenticated
    /// channel, that the lease held and the params were its own (`peer_done`).
    pub one_sided: bool,
    /// The bytes are copied from a file the params named (shm): the exporter's
    /// confirmation must name the same file.
    pub from_named_file: bool,
    /// Writes complete on the remote side with no server-side check (RDMA): the writer's
    /// immediate, not a byte count, says they all landed.
    pub remote_completion: bool,
}
