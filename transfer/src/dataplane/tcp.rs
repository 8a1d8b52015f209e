//! The TCP transport: the requesting side of the data plane (SPEC §10, "Data plane
//! (TCP)"): pooled connections per peer, parallel streams, bytes straight between the
//! socket and pool slots.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvd_protocol::auth::{ClusterKey, DATA_TRAILER_BYTES};
use kvd_protocol::data::{crc_table, pad_for, DataHeader, ALIGN, FLAG_CRC, HEADER_BYTES};
use kvd_protocol::{ErrorCode, Incarnation, WireError};

use super::{
    coalesce, read_status, split, write_all_vectored, Access, Caps, DataOptions, Dir, Op,
    Transport, CRC_PIECE,
};
use kvd_store::pool::Pool;

/// TCP: several parallel streams per transfer, pooled connections.
pub struct TcpTransport {
    key: ClusterKey,
    pool: Arc<Pool>,
    incarnation: Incarnation,
    streams: usize,
    timeout: Duration,
    /// Idle connections per peer address, with the incarnation they were made to: a peer
    /// seen with another incarnation has restarted and its old connections are dead.
    idle: Mutex<HashMap<String, Idle>>,
}

/// Idle connections to one peer address.
#[derive(Default)]
struct Idle {
    incarnation: u64,
    conns: Vec<(TcpStream, Instant)>,
}

impl TcpTransport {
    /// A transport over `pool` for the daemon of `incarnation`.
    pub fn new(
        pool: Arc<Pool>,
        incarnation: Incarnation,
        key: ClusterKey,
        opts: &DataOptions,
    ) -> Self {
        TcpTransport {
            key,
            pool,
            incarnation,
            streams: opts.streams.max(1),
            timeout: opts.io_timeout,
            idle: Mutex::new(HashMap::new()),
        }
    }

    /// A connection to `addr` (of the peer's incarnation `inc`): a pooled one unless
    /// `fresh`. Pooled connections to another incarnation are dropped.
    fn connect(&self, addr: &str, inc: u64, fresh: bool) -> Result<(TcpStream, bool), WireError> {
        let pooled = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let list = idle.entry(addr.to_string()).or_default();
            if list.incarnation != inc {
                list.conns.clear();
                list.incarnation = inc;
            }
            list.conns
                .retain(|(_, t)| t.elapsed() < Duration::from_secs(30));
            if fresh {
                None
            } else {
                list.conns.pop()
            }
        };
        if let Some((s, _)) = pooled {
            return Ok((s, true));
        }
        let unreachable = |e: io::Error| {
            WireError::new(
                ErrorCode::PeerUnreachable,
                format!("data plane {addr}: {e}"),
            )
        };
        let sa = std::net::ToSocketAddrs::to_socket_addrs(addr)
            .map_err(unreachable)?
            .next()
            .ok_or_else(|| {
                WireError::new(
                    ErrorCode::PeerUnreachable,
                    format!("{addr} resolves to nothing"),
                )
            })?;
        let s = TcpStream::connect_timeout(&sa, self.timeout).map_err(unreachable)?;
        s.set_nodelay(true).map_err(unreachable)?;
        s.set_read_timeout(Some(self.timeout))
            .map_err(unreachable)?;
        s.set_write_timeout(Some(self.timeout))
            .map_err(unreachable)?;
        Ok((s, false))
    }

    fn put_back(&self, addr: &str, inc: u64, s: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.entry(addr.to_string()).or_default();
        if list.incarnation == inc {
            list.conns.push((s, Instant::now()));
        }
    }

    /// One request on one connection; a pooled connection that turns out dead before
    /// any byte of the answer arrived is retried once on a fresh one (never another
    /// pooled one: they may all have died with the peer).
    fn one(&self, dir: Dir, a: &Access, ops: &[Op]) -> Result<u64, WireError> {
        let addr = &a.peer.data;
        let inc = a.peer.incarnation.0;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (mut s, pooled) = self.connect(addr, inc, attempt > 1)?;
            match self.exchange(&mut s, dir, a, ops) {
                Ok(n) => {
                    self.put_back(addr, inc, s);
                    return Ok(n);
                }
                Err(Ok(refused)) => {
                    if dir == Dir::Read {
                        self.put_back(addr, inc, s);
                    }
                    return Err(refused);
                }
                Err(Err((e, started))) => {
                    if pooled && !started && attempt == 1 {
                        continue;
                    }
                    return Err(WireError::new(
                        ErrorCode::PeerUnreachable,
                        format!("data plane {addr}: {e}"),
                    ));
                }
            }
        }
    }

    /// A whole request head: header, ranges, MAC trailer, padding.
    pub(super) fn request(&self, dir: Dir, a: &Access, ops: &[Op]) -> Vec<u8> {
        let mut buf =
            Vec::with_capacity(HEADER_BYTES + ops.len() * 16 + DATA_TRAILER_BYTES + ALIGN);
        DataHeader {
            op: dir as u8,
            flags: if a.verify { FLAG_CRC } else { 0 },
            handle: a.handle,
            token: a.token,
            src_inc: self.incarnation.0,
            dst_inc: a.peer.incarnation.0,
            nranges: ops.len() as u32,
        }
        .encode(ops.iter().map(|o| (o.remote, o.len)), &mut buf);
        let trailer = self
            .key
            .data_trailer(crate::auth::stamp(), &a.peer.data, &buf);
        buf.extend_from_slice(&trailer);
        buf.resize(buf.len() + pad_for(buf.len()), 0);
        buf
    }

    /// `Err(Ok)`: refused by the peer; `Err(Err((io, answered)))`: the connection broke,
    /// `answered` telling whether part of the answer had arrived.
    #[allow(clippy::type_complexity)]
    fn exchange(
        &self,
        s: &mut TcpStream,
        dir: Dir,
        a: &Access,
        ops: &[Op],
    ) -> Result<u64, Result<WireError, (io::Error, bool)>> {
        let verify = a.verify;
        let buf = self.request(dir, a, ops);
        if dir == Dir::Read || ops.is_empty() {
            s.write_all(&buf).map_err(|e| Err((e, false)))?;
        }
        let mut bytes = 0;
        match dir {
            Dir::Read => {
                read_status(s).map_err(|r| r.map_err(|e| (e, false)))?;
                let mut crcs = Vec::with_capacity(if verify { ops.len() } else { 0 });
                // (reported after the whole answer is read: the connection stays usable)
                let mut writer_mismatch = None;
                for op in ops {
                    // A checked range, or a block with its writer checksum, is
                    // checksummed as it lands, each read's bytes while they are in cache
                    // (not in a second pass over the range).
                    if verify || op.crc.is_some() {
                        let crc = self
                            .pool
                            .recv_checked(op.local, op.len as usize, s, CRC_PIECE as usize)
                            .map_err(|e| Err((e, true)))?;
                        if verify {
                            crcs.push(crc);
                        }
                        if let Some(want) = op.crc.filter(|&w| w != crc) {
                            writer_mismatch.get_or_insert((op.remote, want, crc));
                        }
                    } else {
                        self.pool
                            .recv_into(op.local, op.len as usize, s)
                            .map_err(|e| Err((e, true)))?;
                    }
                    bytes += op.len;
                }
                let mut table = vec![0u8; if verify { ops.len() * 4 } else { 0 }];
                table.resize(table.len() + pad_for(table.len()), 0);
                s.read_exact(&mut table).map_err(|e| Err((e, true)))?;
                let sent = kvd_protocol::data::parse_crc_table(&table, crcs.len())
                    .map_err(|e| Ok(WireError::new(ErrorCode::TransferFailed, e.message)))?;
                let bad = ops
                    .iter()
                    .zip(crcs.iter().zip(&sent))
                    .find(|(_, (got, sent))| got != sent)
                    .map(|(op, _)| op.remote);
                if let Some(at) = bad {
                    return Err(Ok(WireError::new(
                        ErrorCode::TransferFailed,
                        format!("checksum mismatch reading the range at {at}"),
                    )));
                }
                if let Some((at, want, got)) = writer_mismatch {
                    return Err(Ok(super::not_the_writers(at, want, got)));
                }
            }
            Dir::Write => {
                // The request and the ranges' bytes in `writev`s of up to 64 slices: a
                // small push is one segment train, not a request the peer wakes up for
                // and then its bytes. A checked write ends with the ranges' CRC table:
                // a block's writer checksum where the op carries one (the server then
                // checks the writer's bytes end to end), else this pool's copy's.
                let mut first: &[u8] = &buf;
                let mut crcs = Vec::with_capacity(if verify { ops.len() } else { 0 });
                for chunk in ops.chunks(63) {
                    let mut slices = Vec::with_capacity(chunk.len() + 1);
                    slices.push(io::IoSlice::new(first));
                    for op in chunk {
                        let src = self.pool.read(op.local, op.len as usize).map_err(|e| {
                            Err((io::Error::new(io::ErrorKind::InvalidInput, e), true))
                        })?;
                        if verify {
                            crcs.push(op.crc.unwrap_or_else(|| kvd_store::checksum::crc32c(src)));
                        }
                        slices.push(io::IoSlice::new(src));
                        bytes += op.len;
                    }
                    // A pooled connection found dead before the whole request went out
                    // is retried on a fresh one, as a read's is.
                    let whole_request = first.len();
                    write_all_vectored(s, &mut slices)
                        .map_err(|(e, n)| Err((e, n >= whole_request)))?;
                    first = &[];
                }
                if verify {
                    s.write_all(&crc_table(&crcs)).map_err(|e| Err((e, true)))?;
                }
                read_status(s).map_err(|r| r.map_err(|e| (e, true)))?;
            }
        }
        Ok(bytes)
    }

    fn run(&self, dir: Dir, a: &Access, ops: &[Op]) -> Result<u64, WireError> {
        let ops = coalesce(ops);
        let groups = split(&ops, self.streams);
        if groups.len() <= 1 {
            return groups.first().map_or(Ok(0), |g| self.one(dir, a, g));
        }
        std::thread::scope(|sc| {
            let handles: Vec<_> = groups[1..]
                .iter()
                .map(|g| sc.spawn(move || self.one(dir, a, g)))
                .collect();
            let mut total = self.one(dir, a, &groups[0]);
            for h in handles {
                let r = h.join().unwrap_or_else(|_| {
                    Err(WireError::new(ErrorCode::Internal, "stream panicked"))
                });
                total = match (total, r) {
                    (Ok(x), Ok(y)) => Ok(x + y),
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
            }
            total
        })
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }
    fn caps(&self) -> Caps {
        // every request is checked by the exporter's data server against its grant
        Caps::default()
    }
    fn read(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        self.run(Dir::Read, access, ops)
    }
    fn write(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        self.run(Dir::Write, access, ops)
    }
}
