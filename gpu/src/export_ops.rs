//! The tier's same-node export ops (`gpu_export`, `gpu_pull`, `gpu_export_status`) over the
//! export rules of [`super::exports`].

use std::sync::Arc;
use std::time::Instant;

use kvd_protocol::*;

use super::worker::Work;
use super::{bad, device, geometry, GpuTier, Pending};
use kvd_store::Store;

impl GpuTier {
    /// `gpu_export`: offers blocks of the session's registration to a `gpu_pull` on this
    /// node while the lease lives.
    pub fn export(
        &mut self,
        store: &mut Store,
        r: &GpuExportReq,
        now: Instant,
    ) -> Result<GpuExportResp, WireError> {
        let layout = self.check_blocks(store, r.client, r.registration, &r.keys, &r.blocks, now)?;
        let params = self.exports.insert(
            r.client,
            r.registration,
            &r.transfer_id,
            layout,
            &r.keys,
            &r.blocks,
            r.lease_ms,
            store.incarnation(),
            now,
        )?;
        tracing::debug!(transfer = %r.transfer_id, blocks = r.keys.len(), "gpu export");
        Ok(GpuExportResp { params })
    }

    /// `gpu_pull`: checks the params against the export, copies its blocks device to
    /// device into the session's registration, and answers (later, under `token`) when
    /// the copy is done; the export is then `done` (or `failed`).
    pub fn pull(
        &mut self,
        store: &mut Store,
        r: &GpuPullReq,
        token: u64,
        now: Instant,
    ) -> Result<kvd_store::Answer<GpuPullResp>, WireError> {
        let layout = self.check_blocks(
            store,
            r.client,
            r.registration,
            &r.params.keys,
            &r.blocks,
            now,
        )?;
        if layout != r.params.layout_id {
            return Err(bad(format!(
                "the destination registration has layout {layout}, the export {}",
                r.params.layout_id
            )));
        }
        let e = self
            .exports
            .start_pull(&r.params, store.incarnation(), now)?;
        let (src_id, src_blocks) = (e.registration, e.blocks.clone());
        let planned = self.plan_device(src_id, &src_blocks, r.registration, &r.blocks);
        let queued = planned
            .and_then(|copies| self.submit_work(token, r.registration, Work::Device(copies)));
        if let Err(err) = queued {
            self.exports
                .finish_pull(&r.params.transfer_id, Err(&err.message), now);
            return Err(err);
        }
        self.pending.insert(
            token,
            Pending::Pull {
                registration: r.registration,
                transfer_id: r.params.transfer_id.clone(),
                copied: r.blocks.len() as u64,
            },
        );
        Ok(kvd_store::Answer::Later(token))
    }

    /// `gpu_export_status`.
    pub fn export_status(
        &mut self,
        store: &mut Store,
        r: &GpuExportStatusReq,
        now: Instant,
    ) -> Result<GpuExportStatusResp, WireError> {
        self.worker()?;
        store.check_session(r.client, now)?;
        let (state, message) = self.exports.status(r.client, &r.transfer_id)?;
        Ok(GpuExportStatusResp { state, message })
    }

    /// The device-to-device copies moving `from_blocks` of `from` into `to_blocks` of
    /// `to` (same layout: the same bytes per block, perhaps split differently).
    fn plan_device(
        &self,
        from: u64,
        from_blocks: &[u64],
        to: u64,
        to_blocks: &[u64],
    ) -> Result<Vec<device::DevCopy>, WireError> {
        let gone = |what: &str| {
            WireError::new(
                ErrorCode::TransferFailed,
                format!("the {what} registration ended"),
            )
        };
        let internal = |m: &str| WireError::new(ErrorCode::Internal, m.to_string());
        let src = self.regs.get(&from).ok_or_else(|| gone("exporting"))?;
        let dst = self.regs.get(&to).ok_or_else(|| gone("destination"))?;
        if from_blocks.len() != to_blocks.len() {
            return Err(bad(format!(
                "{} blocks for the export's {}",
                to_blocks.len(),
                from_blocks.len()
            )));
        }
        let mut out = Vec::new();
        for (a, b) in from_blocks.iter().zip(to_blocks) {
            let (ea, eb) = (
                src.geometry
                    .extents(*a)
                    .ok_or_else(|| internal("source block checked"))?,
                dst.geometry
                    .extents(*b)
                    .ok_or_else(|| internal("destination block checked"))?,
            );
            for (x, y) in geometry::pair(ea, eb) {
                out.push(device::DevCopy {
                    src: Arc::clone(
                        src.memory
                            .get(x.region)
                            .ok_or_else(|| internal("region checked"))?,
                    ),
                    src_offset: x.offset,
                    dst: Arc::clone(
                        dst.memory
                            .get(y.region)
                            .ok_or_else(|| internal("region checked"))?,
                    ),
                    dst_offset: y.offset,
                    len: x.len,
                });
            }
        }
        Ok(out)
    }
}
