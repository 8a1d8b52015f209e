//! The transfers' records as one owned part of [`super::Transfers`]: exports, imports
//! (with the progress words layer-wise imports borrow) and peers' push registrations,
//! by transfer id; who owns a transfer here (the session that exported or imported it,
//! SPEC §4 "Sessions") and the check every client op on a transfer makes, returning the
//! record so that an op looks it up once; how a transfer is described; the limit on
//! live transfers. Each record's own transitions are in `export.rs`, `import.rs`,
//! `registration.rs`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::*;
use kvd_store::Store;

use super::export::Export;
use super::grants::Grants;
use super::import::Import;
use super::progress::ProgressBoard;
use super::registration::Registration;

/// See the module docs.
pub(super) struct Records {
    pub(super) exports: HashMap<String, Export>,
    pub(super) imports: HashMap<String, Import>,
    pub(super) regs: HashMap<String, Registration>,
    /// Progress words of layer-wise imports (SPEC §16).
    pub(super) progress: ProgressBoard,
    /// How long an ended transfer is remembered (`transfer.retain`).
    retain: Duration,
    /// At most this many live transfers (`transfer.max_transfers`).
    max_live: usize,
}

impl Records {
    pub(super) fn new(progress: ProgressBoard, retain: Duration, max_live: usize) -> Records {
        Records {
            exports: HashMap::new(),
            imports: HashMap::new(),
            regs: HashMap::new(),
            progress,
            retain,
            max_live,
        }
    }

    /// The session that owns transfer `id` here (the import when both are here: this
    /// daemon's own transfer, imported from itself; none for a peer's push registration
    /// with no export here).
    pub(super) fn owner_of(&self, id: &str) -> Option<ClientId> {
        match (self.imports.get(id), self.exports.get(id)) {
            (Some(i), _) => Some(i.client()),
            (None, Some(e)) => Some(e.client()),
            (None, None) => None,
        }
    }

    /// Checks that `client` (a live session, refreshed by this call) owns transfer `id`:
    /// the session that exported or imported it. Push registrations from peers belong to
    /// no client here.
    pub(super) fn check_owner(
        &self,
        store: &mut Store,
        client: ClientId,
        id: &str,
        now: Instant,
    ) -> Result<(), WireError> {
        store.check_session(client, now)?;
        let owner = self.owner_of(id);
        if owner.is_none() && !self.regs.contains_key(id) {
            return Err(self.unknown(id));
        }
        if owner != Some(client) {
            return Err(WireError::new(
                ErrorCode::NotOwner,
                format!("transfer {id:?} belongs to another session"),
            ));
        }
        Ok(())
    }

    /// The state of the import or export `id` (a peer's push registration with no
    /// export here has none).
    pub(super) fn state_of(&self, id: &str) -> Option<TransferState> {
        match (self.imports.get(id), self.exports.get(id)) {
            (Some(i), _) => Some(i.state()),
            (None, Some(e)) => Some(e.state()),
            (None, None) => None,
        }
    }

    /// How transfer `id` stands (the import when both are here).
    pub(super) fn describe(&self, grants: &Grants, id: &str, now: Instant) -> Option<TransferResp> {
        match (self.imports.get(id), self.exports.get(id)) {
            (Some(i), _) => Some(TransferResp {
                parts_done: i.parts_landed(grants),
                ..i.describe(id, now)
            }),
            (None, Some(e)) => Some(e.describe(id, now)),
            (None, None) => None,
        }
    }

    /// [`Records::describe`], or why there is nothing to describe.
    pub(super) fn answer(
        &self,
        grants: &Grants,
        id: &str,
        now: Instant,
    ) -> Result<TransferResp, WireError> {
        self.describe(grants, id, now)
            .ok_or_else(|| self.unknown(id))
    }

    /// The error for a transfer not known here.
    pub(super) fn unknown(&self, id: &str) -> WireError {
        WireError::new(
            ErrorCode::UnknownTransfer,
            format!(
                "transfer {id:?} is not known here (never created, or ended more than {} s ago)",
                self.retain.as_secs()
            ),
        )
    }

    /// Live exports, imports and registrations.
    pub(super) fn live(&self) -> usize {
        self.exports.values().filter(|e| !e.is_final()).count()
            + self.imports.values().filter(|i| !i.is_final()).count()
            + self.regs.len()
    }

    /// Refuses a new transfer while `transfer.max_transfers` are live.
    pub(super) fn check_capacity(&self) -> Result<(), WireError> {
        if self.live() >= self.max_live {
            return Err(WireError::new(
                ErrorCode::LimitReached,
                format!("{} transfers are live (limit)", self.max_live),
            ));
        }
        Ok(())
    }

    /// [`Records::check_capacity`], and the limit of the tenant whose blocks a new
    /// transfer of `layout` would move (SPEC §18: exports, imports and push
    /// registrations of its layouts, whoever started them).
    pub(super) fn check_capacity_for(
        &self,
        store: &Store,
        layout: LayoutId,
    ) -> Result<(), WireError> {
        self.check_capacity()?;
        let Some(tenant) = store.layout_tenant(layout).filter(|_| store.tenancy()) else {
            return Ok(());
        };
        let max = store.tenant_transfers_max(tenant);
        if max == u64::MAX {
            return Ok(());
        }
        let mine = |l: LayoutId| store.layout_tenant(l) == Some(tenant);
        let live = self
            .exports
            .values()
            .filter(|e| !e.is_final() && mine(e.layout()))
            .count()
            + self
                .imports
                .values()
                .filter(|i| !i.is_final() && mine(i.layout()))
                .count()
            + self.regs.values().filter(|r| mine(r.layout())).count();
        if live as u64 >= max {
            return Err(WireError::new(
                ErrorCode::LimitReached,
                format!(
                    "tenant {:?} has {live} transfers live (its limit)",
                    store.tenant_name(tenant)
                ),
            ));
        }
        Ok(())
    }

    /// The sessions owning live transfers (to keep them from idling out), and those of
    /// them whose transfers need their client (imports, staged exports).
    pub(super) fn live_owners(&self) -> (Vec<ClientId>, Vec<ClientId>) {
        let all = self
            .exports
            .values()
            .filter_map(|e| e.live_owner())
            .chain(self.imports.values().filter_map(|i| i.live_owner()))
            .collect();
        let needing = self
            .exports
            .values()
            .filter(|e| e.staging())
            .filter_map(|e| e.live_owner())
            .chain(self.imports.values().filter_map(|i| i.live_owner()))
            .collect();
        (all, needing)
    }
}
