//! [`IdempotencyLayer`] and its settings.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, StatusCode, header};
use tower_layer::Layer;

use super::fingerprint::default_fingerprint;
use super::record::Fingerprint;
use super::service::Idempotency;
use super::store::Store;
use crate::backend::handle::Locks;
use crate::backend::watchdog::Renewal;

/// Default record TTL: 24 hours, as Stripe keeps its keys.
pub const DEFAULT_RECORD_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// Default bound on a request body, buffered to fingerprint it: 1 MiB (413 beyond).
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;
/// Default bound on a stored response body: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 1024 * 1024;

/// The response headers stored with a record by default: those that describe the result
/// rather than one transmission of it.
pub const DEFAULT_STORED_HEADERS: [HeaderName; 8] = [
    header::CONTENT_TYPE,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::CACHE_CONTROL,
    header::LINK,
];

/// Whether a response is stored for replay, by default: 2xx, 3xx and 4xx, except 408
/// Request Timeout, 409 Conflict, 423 Locked, 425 Too Early and 429 Too Many Requests,
/// which say "not now" rather than give a result; never 1xx or 5xx, so that a retry
/// after a server error runs again.
pub fn default_storable(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..500).contains(&code) && !matches!(code, 408 | 409 | 423 | 425 | 429)
}

pub(crate) type FingerprintFn = dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync;
pub(crate) type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

pub(crate) struct Config {
    pub(crate) header: HeaderName,
    pub(crate) store: Store,
    pub(crate) record_ttl: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) storable: fn(StatusCode) -> bool,
    pub(crate) fingerprint: Arc<FingerprintFn>,
    pub(crate) tenant: Option<Arc<TenantFn>>,
    pub(crate) max_wait: Duration,
    pub(crate) renewal: Renewal,
}

impl Clone for Config {
    fn clone(&self) -> Self {
        Self {
            header: self.header.clone(),
            store: self.store.clone(),
            record_ttl: self.record_ttl,
            max_request_body: self.max_request_body,
            max_response_body: self.max_response_body,
            stored_headers: self.stored_headers.clone(),
            storable: self.storable,
            fingerprint: self.fingerprint.clone(),
            tenant: self.tenant.clone(),
            max_wait: self.max_wait,
            renewal: self.renewal,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("header", &self.header)
            .field("backend", &self.store.locks)
            .field("record_ttl", &self.record_ttl)
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field("stored_headers", &self.stored_headers)
            .field("tenant", &self.tenant.is_some())
            .field("max_wait", &self.max_wait)
            .finish_non_exhaustive()
    }
}

/// Answers a retried request with the response of the first, across replicas: the
/// `Idempotency-Key` header (IETF draft "The Idempotency-Key HTTP Header Field",
/// draft-ietf-httpapi-idempotency-key-header-07).
///
/// See the [module docs](crate::idempotency) for the answers and guarantees. Cloning this
/// layer shares its settings and, in process, its records.
#[derive(Clone, Debug)]
#[must_use]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl Default for IdempotencyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyLayer {
    /// Keys from the `Idempotency-Key` header, required (400 without), on the process-wide
    /// in-process backend ([`Locks::default`]), with every default of this page.
    pub fn new() -> Self {
        Self::with_header(HeaderName::from_static("idempotency-key"))
    }

    /// Keys from the header `name` instead of `Idempotency-Key`.
    pub fn with_header(name: HeaderName) -> Self {
        Self {
            config: Arc::new(Config {
                header: name,
                store: Store {
                    locks: Locks::default(),
                },
                record_ttl: DEFAULT_RECORD_TTL,
                max_request_body: DEFAULT_MAX_REQUEST_BODY,
                max_response_body: DEFAULT_MAX_RESPONSE_BODY,
                stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
                storable: default_storable,
                fingerprint: Arc::new(default_fingerprint),
                tenant: None,
                max_wait: Duration::ZERO,
                renewal: Renewal::default(),
            }),
        }
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The lock backend, which also keeps the records: on Redis ([`Redlock`](crate::Redlock))
    /// they live on the lock's nodes and are shared by every replica; in process, beside
    /// the locks, in bounded memory ([`MemoryLocksBuilder::max_records`](crate::MemoryLocksBuilder::max_records)).
    pub fn backend(mut self, locks: impl Into<Locks>) -> Self {
        self.config().store.locks = locks.into();
        self
    }

    /// How long a record is kept, from the end of its first request. Default 24 hours
    /// ([`DEFAULT_RECORD_TTL`]); a retry after that runs again. Publish it to your clients,
    /// as the draft asks.
    pub fn record_ttl(mut self, ttl: Duration) -> Self {
        self.config().record_ttl = ttl;
        self
    }

    /// The largest request body buffered, in bytes; a longer one is answered 413 Content
    /// Too Large. Default 1 MiB. The body is handed on to the service unchanged.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config().max_request_body = bytes;
        self
    }

    /// The largest response body stored, in bytes. Default 1 MiB. A longer body (or one
    /// that does not end within the lease) is sent in full but not stored: retries within
    /// the record TTL get a problem saying that the result cannot be replayed, and the
    /// request never runs twice.
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config().max_response_body = bytes;
        self
    }

    /// The response headers stored and replayed; default [`DEFAULT_STORED_HEADERS`].
    /// Headers about one transmission (`date`, `content-length`, `set-cookie`, ...) are
    /// left out on purpose.
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config().stored_headers = names.into_iter().collect();
        self
    }

    /// Which statuses are stored; default [`default_storable`].
    pub fn storable(mut self, storable: fn(StatusCode) -> bool) -> Self {
        self.config().storable = storable;
        self
    }

    /// The fingerprint that tells a retry from another request reusing its key; default
    /// [`default_fingerprint`] (method, route and body). Use your own to fingerprint
    /// selected fields of the body.
    pub fn fingerprint<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync + 'static,
    {
        self.config().fingerprint = Arc::new(f);
        self
    }

    /// A tenant part of the key taken from the request (an account id, an API key's
    /// owner), as the draft's security considerations ask: without it, two clients that
    /// choose the same key share it, and one could be replayed the other's response.
    /// A request for which the function returns `None` is answered 400.
    pub fn tenant<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.config().tenant = Some(Arc::new(f));
        self
    }

    /// How long a retry that arrives while the first request runs waits for it to finish
    /// (and then gets its response). Default zero: 409 Conflict with `Retry-After` at once.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.config().max_wait = max_wait;
        self
    }

    /// How the lease of a running first request is renewed; default [`Renewal::default`].
    pub fn renewal(mut self, renewal: Renewal) -> Self {
        self.config().renewal = renewal;
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.config.clone())
    }
}
