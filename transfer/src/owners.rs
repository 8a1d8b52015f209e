//! Who owns a transfer here: the session that exported or imported it (SPEC §4,
//! "Sessions"); the check every client op on a transfer makes.

use std::time::Instant;

use kvd_protocol::*;

use super::Transfers;
use kvd_store::Store;

impl Transfers {
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
}
