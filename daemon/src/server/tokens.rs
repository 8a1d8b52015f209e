//! Tokens of deferred replies: the one place they are made.

use crate::transfer::TOKEN_BIT;

/// Tokens of the replies the server defers for the transfers and the GPU tier (the
/// store numbers its own deferred replies; these have [`TOKEN_BIT`] set, so the two never
/// meet): the one place they are made.
#[derive(Debug, Default)]
pub(super) struct Tokens(u64);

impl Tokens {
    pub(super) fn next(&mut self) -> u64 {
        self.0 += 1;
        TOKEN_BIT | self.0
    }
}
