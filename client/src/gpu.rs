//! The GPU tier (SPEC §13): engine memory registered with the daemon, blocks stored from
//! and loaded into it, and GPU-to-GPU handoffs.

use std::time::Duration;

use kvd_protocol::*;

use crate::{Client, Result};

impl Client {
    /// Registers engine memory (CUDA IPC handles, or files in the daemon's
    /// `gpu.host_dir` for the host stand-in) with a block geometry. The registration lives
    /// while this session keeps sending ops (see `idle_ttl_ms`; [`Client::gpu_list`] is a
    /// cheap keep-alive).
    pub fn gpu_register(
        &self,
        layout: LayoutId,
        device: u32,
        regions: &[GpuRegion],
        num_blocks: u64,
        segments: &[GpuSegment],
    ) -> Result<GpuRegisterResp> {
        Ok(self
            .call(
                |client| {
                    Request::GpuRegister(GpuRegisterReq {
                        client,
                        layout_id: layout,
                        device,
                        regions: regions.to_vec(),
                        num_blocks,
                        segments: segments.to_vec(),
                    })
                },
                &[],
            )?
            .0)
    }

    /// Ends a registration.
    pub fn gpu_unregister(&self, registration: u64) -> Result<GpuUnregisterResp> {
        Ok(self
            .call(
                |client| {
                    Request::GpuUnregister(GpuUnregisterReq {
                        client,
                        registration,
                    })
                },
                &[],
            )?
            .0)
    }

    /// This session's registrations (also keeps them alive).
    pub fn gpu_list(&self) -> Result<GpuListResp> {
        Ok(self
            .call(|client| Request::GpuList(GpuListReq { client }), &[])?
            .0)
    }

    /// Copies `blocks` of a registration into the cache under `keys` (one block per key);
    /// answers when the copies are done and committed.
    pub fn gpu_store(
        &self,
        registration: u64,
        keys: &[ChunkHash],
        blocks: &[u64],
    ) -> Result<GpuStoreResp> {
        Ok(self
            .call(
                |client| {
                    Request::GpuStore(GpuStoreReq {
                        client,
                        registration,
                        keys: keys.to_vec(),
                        blocks: blocks.to_vec(),
                    })
                },
                &[],
            )?
            .0)
    }

    /// Copies the longest cached prefix of `keys` into `blocks` of a registration;
    /// answers when the copies are done with how many leading keys were loaded.
    pub fn gpu_load(&self, registration: u64, keys: &[ChunkHash], blocks: &[u64]) -> Result<u64> {
        let (r, _): (GpuLoadResp, _) = self.call(
            |client| {
                Request::GpuLoad(GpuLoadReq {
                    client,
                    registration,
                    keys: keys.to_vec(),
                    blocks: blocks.to_vec(),
                })
            },
            &[],
        )?;
        Ok(r.loaded)
    }

    /// Offers blocks of a registration to a [`Client::gpu_pull`] by another engine on
    /// this node (device to device); keep them until [`Client::gpu_export_status`] says
    /// a final state.
    pub fn gpu_export(
        &self,
        registration: u64,
        transfer_id: &str,
        keys: &[ChunkHash],
        blocks: &[u64],
        lease: Option<Duration>,
    ) -> Result<GpuTransferParams> {
        let (r, _): (GpuExportResp, _) = self.call(
            |client| {
                Request::GpuExport(GpuExportReq {
                    client,
                    registration,
                    transfer_id: transfer_id.to_string(),
                    keys: keys.to_vec(),
                    blocks: blocks.to_vec(),
                    lease_ms: lease.map(|d| d.as_millis() as u64),
                })
            },
            &[],
        )?;
        Ok(r.params)
    }

    /// Copies an export's blocks into `blocks` of this session's registration; answers
    /// when the copy is done.
    pub fn gpu_pull(
        &self,
        registration: u64,
        blocks: &[u64],
        params: &GpuTransferParams,
    ) -> Result<u64> {
        let (r, _): (GpuPullResp, _) = self.call(
            |client| {
                Request::GpuPull(Box::new(GpuPullReq {
                    client,
                    registration,
                    blocks: blocks.to_vec(),
                    params: params.clone(),
                }))
            },
            &[],
        )?;
        Ok(r.copied)
    }

    /// Where this session's `gpu_export` stands.
    pub fn gpu_export_status(&self, transfer_id: &str) -> Result<GpuExportStatusResp> {
        Ok(self
            .call(
                |client| {
                    Request::GpuExportStatus(GpuExportStatusReq {
                        client,
                        transfer_id: transfer_id.to_string(),
                    })
                },
                &[],
            )?
            .0)
    }
}
