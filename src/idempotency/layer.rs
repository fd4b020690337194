//! [`IdempotencyLayer`] and its settings.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, StatusCode, header};
use tower_layer::Layer;

use super::fingerprint::default_fingerprint;
use super::key::IdempotencyKey;
use super::policy::IdempotencyPolicy;
use super::record::Fingerprint;
use super::service::{Idempotency, ReadBody};
use crate::keyed::{Keyed, KeyedLayer};
use crate::lock::handle::Locks;
use crate::lock::watchdog::Renewal;
use crate::rejection::Rejection;

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

/// Whether a response is stored for replay, by default: 2xx, 3xx and 4xx, except
/// - 401 Unauthorized, 403 Forbidden and 407 Proxy Authentication Required: the caller was
///   not allowed, and a retry with valid credentials must run the handler rather than be
///   given the refusal (Stripe saves a result only once the endpoint has started
///   executing; the IETF draft's security considerations warn of keys used by others);
/// - 408 Request Timeout, 409 Conflict, 423 Locked, 425 Too Early, 429 Too Many Requests
///   and 499 (a request the client cancelled), which say "not now" rather than give a
///   result;
///
/// and never 1xx or 5xx, so that a retry after a server error runs again. A response that
/// is not stored leaves no record: its lease is released and a retry runs the handler.
///
/// A gRPC response is judged by its `grpc-status`, as the HTTP status that
/// `google.rpc.Code` maps it to: `OK` 200 (stored); `INVALID_ARGUMENT`,
/// `FAILED_PRECONDITION`, `OUT_OF_RANGE` 400, `NOT_FOUND` 404 (stored); `UNAUTHENTICATED`
/// 401, `PERMISSION_DENIED` 403, `ALREADY_EXISTS`, `ABORTED` 409, `RESOURCE_EXHAUSTED`
/// 429, `CANCELLED` 499, and every 5xx (`UNIMPLEMENTED` 501, `UNAVAILABLE` 503,
/// `DEADLINE_EXCEEDED` 504, `UNKNOWN`, `INTERNAL`, `DATA_LOSS` 500) not stored.
pub fn default_storable(status: StatusCode) -> bool {
    let code = status.as_u16();
    (200..500).contains(&code)
        && !matches!(code, 401 | 403 | 407 | 408 | 409 | 423 | 425 | 429 | 499)
}

pub(crate) type FingerprintFn = dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync;

/// Answers a retried request with the response of the first, across replicas: the
/// `Idempotency-Key` header (IETF draft "The Idempotency-Key HTTP Header Field",
/// draft-ietf-httpapi-idempotency-key-header-07).
///
/// The guide's [idempotency chapter](crate::guide::idempotency) gives the answers and
/// guarantees. It is a keyed layer ([`KeyedLayer`]) with an idempotency policy, behind a
/// step that reads the request body to fingerprint it. Cloning this layer shares its
/// settings.
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    keyed: KeyedLayer<IdempotencyKey, IdempotencyPolicy>,
    max_request_body: usize,
    fingerprint: Arc<FingerprintFn>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("keyed", &self.keyed)
            .field("max_request_body", &self.max_request_body)
            .finish_non_exhaustive()
    }
}

impl Default for IdempotencyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyLayer {
    /// Keys from the `Idempotency-Key` header, required (400 without), on the app's default
    /// backend ([`Locks::set_default`], else in process), with every default of this page.
    pub fn new() -> Self {
        Self::with_header(HeaderName::from_static("idempotency-key"))
    }

    /// Keys from the header `name` instead of `Idempotency-Key`.
    pub fn with_header(name: HeaderName) -> Self {
        let missing = Cow::Owned(format!("This request needs an {name} header."));
        let policy = IdempotencyPolicy {
            locks: Locks::default(),
            record_ttl: DEFAULT_RECORD_TTL,
            max_response_body: DEFAULT_MAX_RESPONSE_BODY,
            stored_headers: Arc::from(DEFAULT_STORED_HEADERS.as_slice()),
            storable: default_storable,
            max_wait: Duration::ZERO,
            renewal: Renewal::default(),
        };
        Self {
            keyed: KeyedLayer::from_parts(IdempotencyKey::new(name), policy, missing),
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            fingerprint: Arc::new(default_fingerprint),
        }
    }

    /// The policy's settings, to change.
    fn policy_mut(&mut self) -> &mut IdempotencyPolicy {
        self.keyed.policy_mut()
    }

    crate::keyed::layer_setters! {
        /// The lock backend, which also keeps the records: on Redis
        /// ([`Redlock`](crate::Redlock)) they live on the lock's nodes and are shared by
        /// every replica; in process, beside the locks, in bounded memory
        /// ([`MemoryLocksBuilder::max_records`](crate::MemoryLocksBuilder::max_records)).
        /// Default: the app's default backend ([`Locks::set_default`]'s, else the
        /// in-process fallback, refused with a 500 in a process that built a `Redlock`:
        /// see [`Locks::default`]).
        fn backend(locks: impl Into<Locks>) => locks;

        /// How long a record is kept, from the end of its first request. Default 24 hours
        /// ([`DEFAULT_RECORD_TTL`]); a retry after that runs again. Publish it to your
        /// clients, as the draft asks.
        fn record_ttl(ttl: Duration) => record_ttl;

        /// The largest response body stored, in bytes. Default 1 MiB
        /// ([`DEFAULT_MAX_RESPONSE_BODY`]). A longer body (or one that does not end within
        /// the lease) is sent in full but not stored: retries within the record TTL get a
        /// problem saying that the result cannot be replayed, and the request never runs
        /// twice.
        fn max_response_body(bytes: usize) => max_response_body;

        /// Which statuses are stored; default [`default_storable`].
        fn storable(storable: fn(StatusCode) -> bool) => storable;

        /// How long a retry that arrives while the first request runs waits for it to
        /// finish (and then gets its response). Default zero: 409 Conflict with
        /// `Retry-After` at once.
        fn max_wait(max_wait: Duration) => max_wait;

        /// How the lease of a running first request is renewed; default
        /// [`Renewal::default`].
        fn renewal(renewal: Renewal) => renewal;
    }

    /// Answers this layer's refusals in the application's own format, for HTTP clients;
    /// see [`LockLayer::on_rejection`](crate::LockLayer::on_rejection).
    pub fn on_rejection<F>(mut self, render: F) -> Self
    where
        F: Fn(&Rejection) -> http::Response<Bytes> + Send + Sync + 'static,
    {
        self.keyed = self.keyed.on_rejection(std::sync::Arc::new(render));
        self
    }

    /// Shadow (dry-run) mode: the layer looks up and stores records as usual, counts and
    /// logs what it would have answered itself (a replay, a 409 for a request in flight,
    /// a 422 for a key reused), and runs the service instead; see
    /// [`Shadow`](crate::Shadow). Default off.
    pub fn shadow(mut self, shadow: impl Into<crate::Shadow>) -> Self {
        self.keyed = self.keyed.shadow(shadow.into());
        self
    }

    /// The largest request body read, in bytes; a longer one is answered 413 Content Too
    /// Large. Default 1 MiB ([`DEFAULT_MAX_REQUEST_BODY`]). The body is handed on to the
    /// service unchanged.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// The response headers stored and replayed; default [`DEFAULT_STORED_HEADERS`].
    /// Headers about one transmission (`date`, `content-length`, `set-cookie`, ...) are
    /// left out on purpose.
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.policy_mut().stored_headers = names.into_iter().collect();
        self
    }

    /// The fingerprint that tells a retry from another request reusing its key; default
    /// [`default_fingerprint`](super::default_fingerprint) (method, route, path and query,
    /// and body). Use your own to fingerprint selected fields of the body.
    pub fn fingerprint<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync + 'static,
    {
        self.fingerprint = Arc::new(f);
        self
    }

    /// The principal a key belongs to, taken from the request (an account id, an API
    /// key's owner), instead of the credentials ([`credential_headers`](Self::credential_headers)):
    /// a record is replayed only to requests of the same tenant, and the same key sent by
    /// two tenants names two records (the IETF draft's security considerations; Stripe
    /// scopes keys per account). A request for which the function returns `None` is
    /// answered 400. The tenant is part of the key in Redis, so keep it short: it is
    /// bounded as a key value is (see [`key`](crate::key)).
    pub fn tenant<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        let core = self.keyed.core_mut();
        core.extractor = Arc::new(core.extractor.with_tenant(Arc::new(f)));
        self
    }

    /// The request headers whose values name the caller, when the layer has no
    /// [`tenant`](Self::tenant); default [`DEFAULT_CREDENTIAL_HEADERS`](super::DEFAULT_CREDENTIAL_HEADERS) (`Authorization`
    /// and `Cookie`). A record is replayed only to requests that carry the same values of
    /// these headers: the key is bound to a digest of them (never to the values in
    /// clear), so another caller that sends the same key gets a key of its own, and no
    /// answer tells it whether the key was used. Requests with none of these headers
    /// share one anonymous principal.
    ///
    /// Name the headers that identify a caller and stay the same across its retries: a
    /// cookie that changes between a request and its retry (a rolling session, an
    /// analytics cookie) makes the retry another key, which runs again. In that case,
    /// name the principal with [`tenant`](Self::tenant).
    ///
    /// ```
    /// use http::header::AUTHORIZATION;
    /// use tower_redlock::IdempotencyLayer;
    ///
    /// // Bearer tokens name the caller; cookies do not.
    /// let layer = IdempotencyLayer::new().credential_headers([AUTHORIZATION]);
    /// ```
    pub fn credential_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names: Arc<[HeaderName]> = names.into_iter().collect();
        let core = self.keyed.core_mut();
        core.extractor = Arc::new(core.extractor.with_credentials(names));
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReadBody {
            inner: Keyed::new(inner, self.keyed.clone()),
            max: self.max_request_body,
            fingerprint: self.fingerprint.clone(),
            on_rejection: self.keyed.core.on_rejection.clone(),
        }
    }
}
