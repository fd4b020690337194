//! Idempotent replay (in progress).
pub(crate) mod memory;
pub(crate) mod record;
pub(crate) mod fingerprint;
