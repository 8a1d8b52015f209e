//! Which transport reaches a peer (RDMA when both sides have it, else TCP), and the
//! RDMA pushes that landed here.

use std::sync::Arc;

use kvd_protocol::*;

use super::dataplane::Transport;
use super::Transfers;

impl Transfers {
    /// The transport to a remote peer: RDMA when both sides have it, else TCP.
    pub(super) fn remote_transport(&self, peer: &PeerRef) -> Arc<dyn Transport> {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            if peer.rdma.is_some() {
                return r.clone();
            }
        }
        let _ = peer;
        self.tcp.clone()
    }

    /// Whether pushes to `peer` complete on its side with no server check (RDMA): then
    /// the writer's immediate, not a byte count, says every write landed.
    pub(super) fn rdma_with(&self, peer: &PeerRef) -> bool {
        self.remote_transport(peer).caps().remote_completion
    }

    pub(super) fn collect_landed(&mut self) {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            self.landed.extend(r.landed());
        }
    }
}
