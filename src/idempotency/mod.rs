//! [`IdempotencyLayer`]: a retried request gets the first response back.
pub(crate) mod body;
pub(crate) mod fingerprint;
mod layer;
pub(crate) mod record;
mod service;
pub(crate) mod store;

pub use body::ResponseBody;
pub use fingerprint::default_fingerprint;
pub use layer::{
    DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY, DEFAULT_RECORD_TTL,
    DEFAULT_STORED_HEADERS, IdempotencyLayer, default_storable,
};
pub use crate::backend::records::{DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_RECORDS};
pub use record::Fingerprint;
pub use service::{IDEMPOTENT_REPLAYED, Idempotency, ResponseFuture};
