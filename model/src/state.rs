//! The recurrent state of the sequences of a model with Gated DeltaNet layers: a fixed
//! number of slots, each a sequence's live state and the snapshot a forward took of it
//! ([`crate::Sequence::snapshot_at`]), every recurrent layer's state back to back. Both
//! are one buffer of `[slot][elems]`; the snapshots are shared memory when the KV cache
//! is ([`crate::Model::new_shared`]), so the daemon's GPU tier copies a snapshot out of
//! and into its slot as it copies KV blocks (the slot is the block id of the state's
//! registration).

use anyhow::{ensure, Context, Result};

use crate::backend::Backend;
use crate::shared::SharedRegion;

/// Slots: the sequences with a recurrent state at once (a reference engine's concurrency).
pub const STATE_SLOTS: usize = 32;

pub(crate) struct States<B: Backend> {
    /// Elements of one slot (0: the model has no recurrent layer, and no buffers).
    pub(crate) elems: usize,
    pub(crate) slots: usize,
    pub(crate) live: Option<B::Buf>,
    pub(crate) snaps: Option<B::Buf>,
    /// The snapshots' shared memory (with a shared cache).
    pub(crate) region: Option<SharedRegion>,
    free: Vec<usize>,
}

impl<B: Backend> States<B> {
    /// `slots` slots of `elems` elements (none when `elems` is 0); the snapshots in shared
    /// memory `<prefix>-state` in `dir` when `shared`.
    pub(crate) fn new(
        b: &B,
        elems: usize,
        slots: usize,
        shared: Option<(&std::path::Path, &str)>,
    ) -> Result<Self> {
        let slots = if elems == 0 { 0 } else { slots.max(1) };
        let (live, snaps, region) = if elems == 0 {
            (None, None, None)
        } else {
            let live = b.zeros(slots * elems)?;
            match shared {
                None => (Some(live), Some(b.zeros(slots * elems)?), None),
                Some((dir, prefix)) => {
                    let (buf, r) = b
                        .zeros_shared(slots * elems, dir, &format!("{prefix}-state"))
                        .context("the recurrent states' snapshots in shared memory")?;
                    (Some(live), Some(buf), Some(r))
                }
            }
        };
        Ok(States {
            elems,
            slots,
            live,
            snaps,
            region,
            free: (0..slots).rev().collect(),
        })
    }

    /// A free slot.
    pub(crate) fn take(&mut self) -> Result<usize> {
        self.free.pop().with_context(|| {
            format!(
                "every recurrent state slot is taken ({} sequences at once)",
                self.slots
            )
        })
    }

    /// Gives slot `i` back.
    pub(crate) fn give(&mut self, i: usize) {
        if i < self.slots && !self.free.contains(&i) {
            self.free.push(i);
        }
    }

    /// Where slot `i` starts in either buffer.
    pub(crate) fn off(&self, i: usize) -> usize {
        i * self.elems
    }

    /// Sets slot `i`'s live state to `v` (the host's), or to zero.
    pub(crate) fn set(&mut self, b: &B, i: usize, v: Option<&[f32]>) -> Result<()> {
        let off = self.off(i);
        let tmp = match v {
            Some(v) => {
                ensure!(
                    v.len() == self.elems,
                    "a state block of {} values, the model's state has {}",
                    v.len(),
                    self.elems
                );
                b.upload(v)?
            }
            None => b.zeros(self.elems)?,
        };
        let live = self.live.as_mut().context("no recurrent state")?;
        b.copy(&tmp, 0, live, off, self.elems)
    }

    /// Slot `i`'s snapshot becomes its live state (after the GPU tier copied one in).
    pub(crate) fn restore(&mut self, b: &B, i: usize) -> Result<()> {
        let off = self.off(i);
        let (Some(live), Some(snaps)) = (self.live.as_mut(), self.snaps.as_ref()) else {
            anyhow::bail!("no recurrent state");
        };
        b.copy(snaps, off, live, off, self.elems)
    }

    /// Slot `i`'s snapshot, on the host.
    pub(crate) fn snapshot(&self, b: &B, i: usize) -> Result<Vec<f32>> {
        let snaps = self.snaps.as_ref().context("no recurrent state")?;
        let mut tmp = b.zeros(self.elems)?;
        b.copy(snaps, self.off(i), &mut tmp, 0, self.elems)?;
        b.download(&tmp, self.elems)
    }

    /// The snapshots' buffer back to its backend (shared memory is freed its own way).
    pub(crate) fn drop_with(&mut self, b: &B) {
        if self.region.is_some() {
            if let Some(s) = self.snaps.take() {
                b.drop_shared(s);
            }
        }
    }
}
