//! Refusals: the typed [`Rejection`] every layer answers with, and its two renderings,
//! `application/problem+json` for HTTP (RFC 9457, as [`Problem`] renders
//! it) and a trailers-only answer for gRPC.
//!
//! Every answer a layer gives instead of running the inner service carries its
//! [`Rejection`] in the response's extensions, so outer middleware and tests can tell a
//! lock's 503 from a concurrency limit's:
//!
//! ```
//! use bytes::Bytes;
//! use http::Response;
//! use tower_redlock::{RejectedBy, Rejection, RejectionKind};
//!
//! let response = Response::<Bytes>::from(Rejection::new(
//!     RejectedBy::ConcurrencyLimit,
//!     RejectionKind::Limited,
//!     "Too many requests with this key are running.",
//! ));
//! let rejection = response.extensions().get::<Rejection>().unwrap();
//! assert_eq!(rejection.rejected_by(), RejectedBy::ConcurrencyLimit);
//! assert_eq!(rejection.kind(), RejectionKind::Limited);
//! ```
//!
//! # gRPC
//!
//! A request whose `content-type` starts with `application/grpc` is answered the gRPC
//! way (the gRPC over HTTP/2 protocol, "Responses"): HTTP 200, `content-type:
//! application/grpc`, and a trailers-only answer, `grpc-status` and a percent-encoded
//! `grpc-message` with no message. Where HTTP sends `Retry-After`, gRPC gets
//! `grpc-retry-pushback-ms` (gRPC's retry design, A6), in ms (at least 1) rather than
//! whole seconds. The status of each kind is
//! [`RejectionKind::grpc_code`]; it follows `google.rpc.Code`'s HTTP mapping (409 is
//! `ABORTED`, 429 `RESOURCE_EXHAUSTED`, 503 `UNAVAILABLE`).
//!
//! # Your own answers
//!
//! Every layer has `on_rejection(f)`: `f` turns the [`Rejection`] into the response an
//! HTTP client gets, for an API with its own error format. gRPC requests keep the gRPC
//! answer, the only one a gRPC client can read.

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{HeaderMap, HeaderName, Response, StatusCode};

use crate::error::LockError;
use crate::problem::Problem;

/// Which layer (or extractor) refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectedBy {
    /// [`LockLayer`](crate::LockLayer), or the [`Locked`](crate::Locked) extractors.
    Lock,
    /// [`IdempotencyLayer`](crate::IdempotencyLayer).
    Idempotency,
    /// [`RateLimitLayer`](crate::RateLimitLayer).
    RateLimit,
    /// [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer).
    ConcurrencyLimit,
}

#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
impl RejectedBy {
    /// The layer's name, for `Debug`, logs and metric labels: `"LockLayer"`.
    pub(crate) const fn layer(self) -> &'static str {
        match self {
            RejectedBy::Lock => "LockLayer",
            RejectedBy::Idempotency => "IdempotencyLayer",
            RejectedBy::RateLimit => "RateLimitLayer",
            RejectedBy::ConcurrencyLimit => "ConcurrencyLimitLayer",
        }
    }

    /// What the layer's key is called in its answers: `"lock key"`.
    pub(crate) const fn key_noun(self) -> &'static str {
        match self {
            RejectedBy::Lock => "lock key",
            RejectedBy::Idempotency => "idempotency key",
            RejectedBy::RateLimit => "rate limit key",
            RejectedBy::ConcurrencyLimit => "concurrency limit key",
        }
    }
}

/// Why a request was refused. Each kind has its own problem `type` URI
/// ([`type_uri`](Self::type_uri)) and gRPC status ([`grpc_code`](Self::grpc_code)).
///
/// | kind | HTTP | gRPC |
/// | --- | --- | --- |
/// | [`Taken`](Self::Taken) | 409 or 423 | `ABORTED` (10) |
/// | [`InFlight`](Self::InFlight) | 409 | `ABORTED` (10) |
/// | [`MissingKey`](Self::MissingKey), [`InvalidKey`](Self::InvalidKey) | 400 | `INVALID_ARGUMENT` (3) |
/// | [`Mismatch`](Self::Mismatch) | 422 | `INVALID_ARGUMENT` (3) |
/// | [`Unreplayable`](Self::Unreplayable) | 409 | `FAILED_PRECONDITION` (9) |
/// | [`Limited`](Self::Limited) | 429, or 503 for a concurrency limit | `RESOURCE_EXHAUSTED` (8) |
/// | [`TooLarge`](Self::TooLarge) | 413 | `RESOURCE_EXHAUSTED` (8) |
/// | [`RequestTimeout`](Self::RequestTimeout) | 408 | `DEADLINE_EXCEEDED` (4) |
/// | [`Unavailable`](Self::Unavailable), [`Lost`](Self::Lost) | 503 | `UNAVAILABLE` (14) |
/// | [`Misconfigured`](Self::Misconfigured) | 500 | `INTERNAL` (13) |
///
/// The problem types, with the title each status gets, are listed in the guide's
/// [HTTP answers](crate::guide::http_answers#problem-types) chapter.
///
/// A reused idempotency key with another request ([`Mismatch`](Self::Mismatch)) is
/// `INVALID_ARGUMENT`, not `FAILED_PRECONDITION` or `ALREADY_EXISTS`: retrying the same
/// call will never succeed, and the client must fix the call (a new key, or the first
/// request's message), which is what `INVALID_ARGUMENT` tells a gRPC client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectionKind {
    /// The lock is held by another request.
    Taken,
    /// A request with the same idempotency key is still running.
    InFlight,
    /// The request lacks its key (a header, a path parameter, a function's `None`).
    MissingKey,
    /// The key is unusable: empty, too long, or with control characters.
    InvalidKey,
    /// An idempotency key reused with another request (method, path or body).
    Mismatch,
    /// The request with this idempotency key completed, but its response could not be
    /// stored, so it cannot be replayed: a new key runs the request again.
    Unreplayable,
    /// Over a rate limit or a concurrency limit.
    Limited,
    /// A request body over the bound the layer reads.
    TooLarge,
    /// A request body that did not arrive within the time the layer waits for it before
    /// taking its lock: 408 Request Timeout (RFC 9110, section 15.5.9), gRPC
    /// `DEADLINE_EXCEEDED`.
    RequestTimeout,
    /// The store cannot decide: no quorum, Redis unreachable.
    Unavailable,
    /// The lease or permit was lost while the request ran.
    Lost,
    /// The server is set up so that the layer cannot work; the details are logged.
    Misconfigured,
}

impl RejectionKind {
    /// The HTTP status of this kind by default: the table above (409 for
    /// [`Taken`](Self::Taken) and 429 for [`Limited`](Self::Limited), which layers
    /// change).
    pub fn default_status(self) -> StatusCode {
        match self {
            Self::Taken | Self::InFlight | Self::Unreplayable => StatusCode::CONFLICT,
            Self::MissingKey | Self::InvalidKey => StatusCode::BAD_REQUEST,
            // 422 Unprocessable Content (RFC 9110, section 15.5.21); the `http` crate
            // keeps RFC 4918's name for the constant.
            Self::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Limited => StatusCode::TOO_MANY_REQUESTS,
            // 413 Content Too Large (RFC 9110, section 15.5.14); RFC 7231's name here.
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::Unavailable | Self::Lost => StatusCode::SERVICE_UNAVAILABLE,
            Self::Misconfigured => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The gRPC status code (`google.rpc.Code`) a gRPC client gets: see the table above.
    pub fn grpc_code(self) -> u16 {
        match self {
            Self::Taken | Self::InFlight => 10,
            Self::Unreplayable => 9,
            Self::MissingKey | Self::InvalidKey | Self::Mismatch => 3,
            Self::Limited | Self::TooLarge => 8,
            Self::RequestTimeout => 4,
            Self::Unavailable | Self::Lost => 14,
            Self::Misconfigured => 13,
        }
    }

    /// The problem details' `type` (RFC 9457, section 3.1.1): a URN per kind,
    /// `urn:tower-redlock:problem:` and the kind's name in kebab case, such as
    /// `urn:tower-redlock:problem:taken`. An identifier for clients to match on, stable
    /// across releases; it does not resolve to a page (RFC 9457 allows a non-resolvable
    /// type URI): the guide's [HTTP answers](crate::guide::http_answers#problem-types)
    /// chapter documents each one.
    pub fn type_uri(self) -> &'static str {
        match self {
            Self::Taken => "urn:tower-redlock:problem:taken",
            Self::InFlight => "urn:tower-redlock:problem:in-flight",
            Self::MissingKey => "urn:tower-redlock:problem:missing-key",
            Self::InvalidKey => "urn:tower-redlock:problem:invalid-key",
            Self::Mismatch => "urn:tower-redlock:problem:mismatch",
            Self::Unreplayable => "urn:tower-redlock:problem:unreplayable",
            Self::Limited => "urn:tower-redlock:problem:limited",
            Self::TooLarge => "urn:tower-redlock:problem:too-large",
            Self::RequestTimeout => "urn:tower-redlock:problem:request-timeout",
            Self::Unavailable => "urn:tower-redlock:problem:unavailable",
            Self::Lost => "urn:tower-redlock:problem:lost",
            Self::Misconfigured => "urn:tower-redlock:problem:misconfigured",
        }
    }
}

/// A refusal: which layer, why, the HTTP status and a human-readable detail, and how long
/// to wait before a retry. It becomes an `application/problem+json` response with
/// `Response::from(rejection)`, a gRPC one with [`into_grpc_response`](Self::into_grpc_response),
/// and with the `axum` feature, through axum's `IntoResponse`; either response carries the
/// rejection in its extensions.
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Response, StatusCode};
/// use tower_redlock::{RejectedBy, Rejection, RejectionKind};
///
/// let rejection = Rejection::new(RejectedBy::Lock, RejectionKind::Taken, "held")
///     .with_status(StatusCode::LOCKED)
///     .retry_after(Duration::from_secs(2));
/// let response = Response::<Bytes>::from(rejection);
/// assert_eq!(response.status(), StatusCode::LOCKED);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// assert_eq!(response.headers()["retry-after"], "2");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    by: RejectedBy,
    kind: RejectionKind,
    problem: Problem,
}

impl Rejection {
    /// A rejection by `by`, of `kind`, with the kind's
    /// [`default_status`](RejectionKind::default_status) and a human-readable `detail`.
    pub fn new(by: RejectedBy, kind: RejectionKind, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            by,
            kind,
            problem: Problem::new(kind.default_status(), detail).with_type(kind.type_uri()),
        }
    }

    /// Another HTTP status (423 for a locked resource, 503 for a concurrency limit).
    #[must_use]
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.problem.status = status;
        self
    }

    /// Adds `Retry-After` (RFC 9110, section 10.2.3), sent in whole seconds rounded up,
    /// at least 1; gRPC gets it as `grpc-retry-pushback-ms`.
    #[must_use]
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.problem = self.problem.retry_after(after);
        self
    }

    /// Which layer refused.
    pub fn rejected_by(&self) -> RejectedBy {
        self.by
    }

    /// Why.
    pub fn kind(&self) -> RejectionKind {
        self.kind
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.problem.status()
    }

    /// The answer an HTTP client gets: the status, the kind's type URI, the detail text
    /// and the delay before a retry, if the client may retry.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// The rejection of a lock error, as [`LockLayer`](crate::LockLayer) answers it:
    /// [`Taken`](RejectionKind::Taken) with `taken_status` (409 or 423) and `Retry-After`
    /// when the lock is held, [`InvalidKey`](RejectionKind::InvalidKey) (400) for an
    /// invalid key, [`Misconfigured`](RejectionKind::Misconfigured) (500) for an
    /// unsupported request or no backend chosen, [`Unavailable`](RejectionKind::Unavailable) (503, with
    /// `Retry-After: 1`) when the backend cannot answer, without internal details (log
    /// the error instead).
    ///
    /// For a handler that takes its locks itself, as the layer would answer:
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_redlock::{LockError, Rejection, RejectionKind};
    ///
    /// let taken = LockError::Taken { retry_after: std::time::Duration::from_secs(1) };
    /// let rejection = Rejection::from_lock_error(&taken, StatusCode::LOCKED);
    /// assert_eq!(rejection.kind(), RejectionKind::Taken);
    /// assert_eq!(rejection.status(), StatusCode::LOCKED);
    /// ```
    pub fn from_lock_error(error: &LockError, taken_status: StatusCode) -> Self {
        Self::of_lock_error(RejectedBy::Lock, error, taken_status)
    }

    /// [`from_lock_error`](Self::from_lock_error) for `by`: a held lock is
    /// [`InFlight`](RejectionKind::InFlight) for the idempotency layer.
    pub(crate) fn of_lock_error(
        by: RejectedBy,
        error: &LockError,
        taken_status: StatusCode,
    ) -> Self {
        match error {
            LockError::Taken { retry_after } => {
                let in_flight = by == RejectedBy::Idempotency;
                let detail = if in_flight || taken_status == StatusCode::CONFLICT {
                    "A request with the same key is still in progress."
                } else {
                    "The resource is locked by another request; retry after the Retry-After delay."
                };
                let kind = if in_flight {
                    RejectionKind::InFlight
                } else {
                    RejectionKind::Taken
                };
                Rejection::new(by, kind, detail)
                    .with_status(taken_status)
                    .retry_after(*retry_after)
            }
            LockError::InvalidKey(e) => Rejection::invalid_key(by, "lock key", e),
            LockError::Unsupported(_) | LockError::NoBackendChosen => Rejection::misconfigured(by),
            _ => Rejection::unavailable(by),
        }
    }

    /// 400 for a key the backend refused: "Invalid {noun}: {error}."
    pub(crate) fn invalid_key(by: RejectedBy, noun: &str, error: &dyn std::fmt::Display) -> Self {
        Rejection::new(
            by,
            RejectionKind::InvalidKey,
            format!("Invalid {noun}: {error}."),
        )
    }

    /// 503 with `Retry-After: 1` for a store that cannot answer, with nothing internal in it.
    pub(crate) fn unavailable(by: RejectedBy) -> Self {
        let detail = match by {
            RejectedBy::Lock | RejectedBy::Idempotency => "The lock service",
            RejectedBy::RateLimit => "The rate limit service",
            RejectedBy::ConcurrencyLimit => "The concurrency limit service",
        };
        let detail = format!("{detail} is unavailable; retry later.");
        Rejection::new(by, RejectionKind::Unavailable, detail).retry_after(Duration::from_secs(1))
    }

    /// The answer to a server mistake: 500 with nothing internal in it (the details go
    /// to the log).
    pub(crate) fn misconfigured(by: RejectedBy) -> Self {
        Rejection::new(
            by,
            RejectionKind::Misconfigured,
            "The server is misconfigured; the details are in its log.",
        )
    }

    /// The gRPC answer: HTTP 200, `content-type: application/grpc`, and in the head (a
    /// trailers-only response) `grpc-status` ([`RejectionKind::grpc_code`]), the
    /// percent-encoded detail as `grpc-message`, and `grpc-retry-pushback-ms` when the
    /// client may retry. The body is empty. The response carries the rejection in its
    /// extensions.
    pub fn into_grpc_response<B: Default>(self) -> Response<B> {
        let mut response = Response::new(B::default());
        *response.headers_mut() = self.grpc_status();
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        response.extensions_mut().insert(self);
        response
    }

    /// The gRPC status fields: `grpc-status`, `grpc-message`, and
    /// `grpc-retry-pushback-ms` when the client may retry; in the head of a
    /// trailers-only answer, or the trailers of a stream that ends with this rejection.
    pub(crate) fn grpc_status(&self) -> HeaderMap {
        let mut headers = HeaderMap::with_capacity(4);
        let code = HeaderValue::from(self.kind.grpc_code());
        headers.insert(GRPC_STATUS.clone(), code);
        if let Ok(message) = HeaderValue::from_str(&grpc_message(self.problem.detail())) {
            headers.insert(GRPC_MESSAGE.clone(), message);
        }
        if let Some(after) = self.problem.retry_after_delay() {
            // At least 1 ms: a pushback of 0 asks for an immediate retry.
            let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1);
            headers.insert(GRPC_RETRY_PUSHBACK_MS.clone(), HeaderValue::from(ms));
        }
        headers
    }
}

pub(crate) static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub(crate) static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
static GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// Percent-encodes a `grpc-message` (gRPC over HTTP/2: every byte outside printable ASCII
/// `0x20..=0x7E`, and `%` itself, as `%XX`).
fn grpc_message(detail: &str) -> String {
    let mut out = String::with_capacity(detail.len());
    for byte in detail.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

impl<B: From<Bytes>> From<Rejection> for Response<B> {
    /// The `application/problem+json` response ([`Problem`]): the status, the body
    /// (`type` the kind's [`type_uri`](RejectionKind::type_uri), `title`, `status`,
    /// `detail`), `Retry-After` when set, and the rejection in the extensions.
    fn from(rejection: Rejection) -> Self {
        let mut response = rejection.problem.to_response();
        response.extensions_mut().insert(rejection);
        response
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl axum::response::IntoResponse for Rejection {
    fn into_response(self) -> axum::response::Response {
        Response::from(self)
    }
}

#[cfg(test)]
mod tests;
