//! The prefill → decode handoff (SPEC §9): `export` on the prefill side, `pull` or
//! `push_register` on the decode side, the transfer's status, and the pin of what arrived.

use std::time::{Duration, Instant};

use kvd_protocol::*;

use crate::{Client, Error, PinnedBlocks, Result};

impl Client {
    /// Prefill side: pins committed blocks under a lease and returns the
    /// `kv_transfer_params` for the decode side ([`TransferParams::to_msgpack`] gives the
    /// bytes a router forwards).
    pub fn export(
        &self,
        transfer_id: &str,
        layout: LayoutId,
        keys: &[ChunkHash],
        lease: Option<Duration>,
    ) -> Result<TransferParams> {
        let (r, _): (ExportResp, _) = self.call(
            |client| {
                Request::Export(ExportReq {
                    client,
                    transfer_id: transfer_id.to_string(),
                    layout_id: layout,
                    keys: keys.to_vec(),
                    lease_ms: lease.map(|d| d.as_millis() as u64),
                })
            },
            &[],
        )?;
        Ok(r.params)
    }

    /// Decode side: pulls an export into this node's pool. With `wait`, answers when the
    /// transfer ends (done: `pin` holds the blocks for `ttl`, see [`Client::pinned`]);
    /// otherwise at once (follow with [`Client::transfer_status`]).
    pub fn pull(
        &self,
        params: &TransferParams,
        ttl: Option<Duration>,
        wait: bool,
    ) -> Result<TransferResp> {
        let extra = if wait {
            Duration::from_millis(params.lease_ms) * 4
        } else {
            Duration::ZERO
        };
        Ok(self
            .call_waiting(
                |client| {
                    Request::Pull(Box::new(PullReq {
                        client,
                        params: params.clone(),
                        ttl_ms: ttl.map(|d| d.as_millis() as u64),
                        wait,
                        defer: false,
                    }))
                },
                &[],
                extra,
            )?
            .0)
    }

    /// Decode side: admits a transfer without starting it: the daemon heartbeats the
    /// exporter (keeping its lease alive) while the request waits in the engine's queue.
    /// A later [`Client::pull`] of the same params starts it.
    pub fn admit(&self, params: &TransferParams, ttl: Option<Duration>) -> Result<TransferResp> {
        Ok(self
            .call(
                |client| {
                    Request::Pull(Box::new(PullReq {
                        client,
                        params: params.clone(),
                        ttl_ms: ttl.map(|d| d.as_millis() as u64),
                        wait: false,
                        defer: true,
                    }))
                },
                &[],
            )?
            .0)
    }

    /// Decode side: pre-allocates slots for `keys` and registers them with the prefill
    /// node (its `tcp://` control endpoint), which writes into them once it exports
    /// `transfer_id`. Answers at once; wait with [`Client::transfer_status`].
    pub fn push_register(
        &self,
        transfer_id: &str,
        layout: LayoutId,
        keys: &[ChunkHash],
        node: &str,
        ttl: Option<Duration>,
    ) -> Result<TransferResp> {
        Ok(self
            .call(
                |client| {
                    Request::PushRegister(PushRegisterReq {
                        client,
                        transfer_id: transfer_id.to_string(),
                        layout_id: layout,
                        keys: keys.to_vec(),
                        node: node.to_string(),
                        ttl_ms: ttl.map(|d| d.as_millis() as u64),
                        wait: false,
                    })
                },
                &[],
            )?
            .0)
    }

    /// Where a transfer is; waits up to `wait` for it to end.
    pub fn transfer_status(&self, transfer_id: &str, wait: Duration) -> Result<TransferResp> {
        Ok(self
            .call_waiting(
                |client| {
                    Request::TransferStatus(TransferStatusReq {
                        client,
                        transfer_id: transfer_id.to_string(),
                        wait_ms: wait.as_millis() as u64,
                    })
                },
                &[],
                wait,
            )?
            .0)
    }

    /// Ends a transfer on this daemon's side; the other side is told.
    pub fn abort_transfer(&self, transfer_id: &str) -> Result<AbortResp> {
        Ok(self
            .call(
                |client| {
                    Request::Abort(AbortReq {
                        client,
                        transfer_id: transfer_id.to_string(),
                    })
                },
                &[],
            )?
            .0)
    }

    /// The blocks of a finished import, as [`PinnedBlocks`] (releasing them releases the
    /// transfer's pin). The deadline counts from now, which is later than the daemon's
    /// clock: call it as soon as the transfer is done.
    pub fn pinned(&self, layout: LayoutId, done: &TransferResp) -> Result<PinnedBlocks> {
        if done.state != TransferState::Done {
            return Err(Error::Protocol(format!(
                "transfer {} is {:?}, not done",
                done.transfer_id, done.state
            )));
        }
        let info = self.layout_info(layout)?;
        let session = self.session();
        let pool = session.pool.clone().ok_or(Error::NotMapped)?;
        Ok(PinnedBlocks {
            client: self.clone(),
            session: session.client,
            pin: done.pin,
            offsets: done.offsets.clone(),
            pool,
            block_bytes: info.block_bytes as usize,
            deadline: Instant::now() + Duration::from_millis(done.ttl_ms),
        })
    }
}
