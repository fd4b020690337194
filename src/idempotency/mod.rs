//! [`IdempotencyLayer`]: a retried request gets the first response back.
mod fingerprint;
mod key;
mod layer;
mod policy;
pub(crate) mod record;
mod service;

pub use crate::backend::records::{
    DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_RECORDS, DEFAULT_MAX_RECORDS_PER_PRINCIPAL,
};
pub use fingerprint::default_fingerprint;
pub use key::{DEFAULT_CREDENTIAL_HEADERS, IdempotencyKey};
pub use layer::{
    DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY, DEFAULT_RECORD_TTL,
    DEFAULT_STORED_HEADERS, IdempotencyLayer, default_storable,
};
pub use policy::{IDEMPOTENT_REPLAYED, IdempotencyPolicy};
pub use record::Fingerprint;
pub use service::{Idempotency, ReadBody};
