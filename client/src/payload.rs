//! The data path of a client that does not map the pool (a remote `tcp://` daemon,
//! [`MapPool::Never`](crate::MapPool::Never), or a process outside the pool's group, SPEC
//! §18): stores send their blocks as payload frames of `commit`s, loads receive them as
//! payload frames of `get`s with `inline`.
//!
//! Both cut a call into messages of about [`PAYLOAD_CHUNK_BYTES`] on one connection.
//! One message of a whole call (16 MiB, say) is received whole before the daemon writes
//! any of it, in a buffer grown for it, and answered whole before the client copies any
//! of it; chunks let each side work on one while the next is on its way, and keep every
//! buffer small. Stores send every chunk and then collect the replies (each is a few
//! bytes); loads keep at most [`PAYLOAD_WINDOW_BYTES`] of replies owed at once, so the
//! daemon never holds more than that for a client that is still sending.

use std::collections::VecDeque;
use std::time::Duration;

use kvd_protocol::*;

use crate::checksum;
use crate::connection::Session;
use crate::{Client, Error, Result};

/// A payload-frame store or load moves its blocks in messages of about this many bytes
/// (at least one block each).
pub const PAYLOAD_CHUNK_BYTES: u64 = 1 << 20;

/// A payload-frame load keeps at most this many bytes of replies owed on its connection.
pub const PAYLOAD_WINDOW_BYTES: u64 = 8 << 20;

impl Client {
    /// Commits `keys` (reserved by session `s`, not yet committed) with `blocks` as
    /// payload frames, in chunks (module docs). A chunk's error fails the call; every
    /// reply sent for is still collected.
    pub(crate) fn commit_payloads(
        &self,
        s: &Session,
        layout: LayoutId,
        keys: &[ChunkHash],
        blocks: &[&[u8]],
        block_bytes: u64,
    ) -> Result<()> {
        let per = chunk_blocks(block_bytes);
        let mut sock = self.checkout_for(1 + per, per as u64 * block_bytes)?;
        let mut ids = Vec::new();
        let mut r: Result<()> = Ok(());
        for (ks, bs) in keys.chunks(per).zip(blocks.chunks(per)) {
            let crcs = bs.iter().map(|b| checksum::crc32c(b)).collect();
            let req = Request::Commit(CommitReq {
                client: s.client,
                layout_id: layout,
                keys: ks.to_vec(),
                offsets: None,
                // (none at all from a client told not to send them: a negative control)
                crcs: self.inner.opts.writer_checksums.then_some(crcs),
            });
            match self.send_on(&mut sock, &req, bs) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        self.collect_commits(sock, &ids, r)
    }

    /// Loads `keys` into `out` by `get`s with `inline`, in chunks with a window of
    /// replies owed (module docs); per key, whether it was found and intact. A block
    /// whose bytes do not match its checksum is a miss, named to the daemon.
    pub(crate) fn load_payloads(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
        block_bytes: u64,
    ) -> Result<Vec<bool>> {
        self.renewing(|| {
            self.past_broken_streams(|| {
                self.load_payload_chunks(layout, keys, &mut *out, block_bytes)
            })
        })
    }

    fn load_payload_chunks(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
        block_bytes: u64,
    ) -> Result<Vec<bool>> {
        let per = chunk_blocks(block_bytes);
        let window = (PAYLOAD_WINDOW_BYTES / (per as u64 * block_bytes).max(1)).max(1) as usize;
        let client = self.session().client;
        let mut sock = self.checkout()?;
        let mut found = vec![false; keys.len()];
        let mut damaged = Vec::new();
        let mut owed: VecDeque<(u64, std::ops::Range<usize>)> = VecDeque::new();
        let mut next = 0;
        let mut r: Result<()> = Ok(());
        loop {
            while r.is_ok() && owed.len() < window && next < keys.len() {
                let range = next..(next + per).min(keys.len());
                let req = Request::Get(GetReq {
                    client,
                    layout_id: layout,
                    keys: keys[range.clone()].to_vec(),
                    ttl_ms: None,
                    inline: true,
                });
                match self.send_on(&mut sock, &req, &[]) {
                    Ok(id) => owed.push_back((id, range.clone())),
                    Err(e) => r = Err(e),
                }
                next = range.end;
            }
            if owed.is_empty() {
                break;
            }
            let ids: Vec<u64> = owed.iter().map(|o| o.0).collect();
            // (a broken connection ends the call: nothing is held for these replies)
            let (id, got) =
                self.recv_one_of::<GetResp>(&mut sock, &ids, op::GET, Duration::ZERO)?;
            let Some(at) = owed.iter().position(|o| o.0 == id) else {
                continue;
            };
            let Some((_, range)) = owed.remove(at) else {
                continue;
            };
            match got {
                Ok((resp, frames)) if r.is_ok() => {
                    let start = range.start;
                    r = self.take_inline(
                        &resp,
                        frames,
                        &mut out[range.clone()],
                        &mut found[range],
                        |j| damaged.push(keys[start + j]),
                    );
                }
                Ok(_) => {}
                Err(e) => {
                    if r.is_ok() {
                        r = Err(e);
                    }
                }
            }
        }
        self.report_damaged(layout, &damaged);
        self.finish(sock, r.map(|()| found))
    }

    /// Copies one `get`'s inline blocks into `out` (checking each against its writer
    /// checksum as it copies), setting `found`; `damaged(j)` for the j-th key whose bytes
    /// do not match.
    pub(crate) fn take_inline(
        &self,
        resp: &GetResp,
        frames: Vec<zmq::Message>,
        out: &mut [&mut [u8]],
        found: &mut [bool],
        mut damaged: impl FnMut(usize),
    ) -> Result<()> {
        if resp.offsets.len() != out.len() {
            return Err(Error::Protocol(format!(
                "{} offsets for {} keys",
                resp.offsets.len(),
                out.len()
            )));
        }
        let mut frames = frames.into_iter();
        for (j, (off, (o, hit))) in resp
            .offsets
            .iter()
            .zip(out.iter_mut().zip(found.iter_mut()))
            .enumerate()
        {
            if off.is_none() {
                continue;
            }
            let f = frames
                .next()
                .ok_or_else(|| Error::Protocol("missing payload frame".into()))?;
            if f.len() != o.len() {
                return Err(Error::Protocol(format!(
                    "payload of {} bytes, expected {}",
                    f.len(),
                    o.len()
                )));
            }
            // (the daemon checked the block as it copied it; this checks the way)
            let got = checksum::copy_crc(o, &f);
            *hit = self
                .verifying(resp.crcs.get(j).copied().flatten())
                .is_none_or(|c| c == got);
            if !*hit {
                damaged(j);
            }
        }
        Ok(())
    }
}

/// Blocks per payload chunk: about [`PAYLOAD_CHUNK_BYTES`], at least one.
fn chunk_blocks(block_bytes: u64) -> usize {
    usize::try_from(PAYLOAD_CHUNK_BYTES / block_bytes.max(1))
        .unwrap_or(usize::MAX)
        .max(1)
}
