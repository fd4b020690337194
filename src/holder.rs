//! Who holds a lease: the identity recorded beside a lock when it is taken, so that
//! [`Locks::inspect`](crate::Locks::inspect) can answer "who holds this lock?"
//! ([`LockHolder`]).
//!
//! A lease records its backend's replica id (see
//! [`RedlockBuilder::replica_id`](crate::RedlockBuilder::replica_id)) and, when a layer or
//! an extractor takes it, its request's method, route and request id. The record is one
//! line of `name=value` fields, `replica=web-1-4242 method=POST route=/items/{item_id}/buy
//! request_id=3f2a`, the same in process and on Redis (where it follows the lease's token,
//! `<token> replica=..`, at `<prefix>{<lock key>}:holder`).
//!
//! Parts of it come from clients (a header, a path), so each field is bounded and
//! sanitised where it is written: bytes outside printable ASCII, spaces included, become
//! `_`, and a field is cut to its bound (64 bytes for the replica id and the request id,
//! 16 for the method, 128 for the route). A
//! holder is a value, never part of a key name.

use std::fmt;
use std::sync::{Arc, OnceLock};

use http::request::Parts;
use http::{Extensions, HeaderMap, HeaderName, HeaderValue, Method, Uri};

/// The longest replica id kept, in bytes: 64 (a longer one is cut).
pub(crate) const MAX_REPLICA_LEN: usize = 64;
/// The longest method kept, in bytes.
const MAX_METHOD_LEN: usize = 16;
/// The longest route kept, in bytes.
const MAX_ROUTE_LEN: usize = 128;
/// The longest request id kept, in bytes.
const MAX_REQUEST_ID_LEN: usize = 64;
/// The room for a record: at least the longest one, the four fields at their bounds with
/// their names (307 bytes, checked below).
const MAX_RECORD: usize = 320;
const _: () = {
    let longest = "replica=".len()
        + MAX_REPLICA_LEN
        + " method=".len()
        + MAX_METHOD_LEN
        + " route=".len()
        + MAX_ROUTE_LEN
        + " request_id=".len()
        + MAX_REQUEST_ID_LEN;
    assert!(longest == 307 && longest <= MAX_RECORD);
};

/// The request id header read first.
const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// The W3C Trace Context header whose trace id is read when there is no `x-request-id`.
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Who holds a lock, as its lease recorded it when it was taken; the
/// [`holder`](crate::LockInspection::holder) of a [`LockInspection`](crate::LockInspection).
///
/// Each field is printable ASCII without spaces (other bytes read `_`), cut to a bound:
/// the replica id to 64 bytes, the method to 16, the route to 128, the request id to 64. Its `Display` is the form stored beside the lock:
/// `replica=web-1-4242 method=POST route=/items/{item_id}/buy request_id=3f2a`, without
/// the fields that are `None`.
///
/// Recorded for plain, exclusive and fair leases, each key of a lease on several keys,
/// and the [`IdempotencyLayer`](crate::IdempotencyLayer)'s; not for readers
/// ([`LockMode::Shared`](crate::LockMode::Shared)), which share a lock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockHolder {
    /// The replica (process) that took the lease: its backend's replica id, by default
    /// `<hostname>-<pid>` (see
    /// [`RedlockBuilder::replica_id`](crate::RedlockBuilder::replica_id)).
    pub replica: String,
    /// The HTTP method of the request that took it (`POST`); `None` for a lease taken by
    /// a direct call ([`Locks::acquire`](crate::Locks::acquire) and the like).
    pub method: Option<String>,
    /// The route of that request: axum's [`MatchedPath`](axum::extract::MatchedPath)
    /// (`/items/{item_id}/buy`) when the router put one in the request's extensions (a
    /// layer on a route, or `route_layer`), else the request's path without its query
    /// (a layer outside the router sees the path); `None` for a direct call.
    pub route: Option<String>,
    /// The request's id: its `x-request-id` header, or else the trace id of its W3C
    /// `traceparent` header (32 hex digits); `None` when it has neither.
    pub request_id: Option<String>,
}

impl LockHolder {
    /// Reads the stored form ([`Display`](fmt::Display)); fields it does not know are
    /// skipped, so that a newer writer's record still reads.
    pub(crate) fn parse(stored: &str) -> Self {
        let mut holder = Self::default();
        for field in stored.split(' ') {
            let Some((name, value)) = field.split_once('=') else {
                continue;
            };
            let value = value.to_owned();
            match name {
                "replica" => holder.replica = value,
                "method" => holder.method = Some(value),
                "route" => holder.route = Some(value),
                "request_id" => holder.request_id = Some(value),
                _ => {}
            }
        }
        holder
    }
}

impl fmt::Display for LockHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replica={}", self.replica)?;
        let optional = [
            ("method", &self.method),
            ("route", &self.route),
            ("request_id", &self.request_id),
        ];
        for (name, value) in optional {
            if let Some(value) = value {
                write!(f, " {name}={value}")?;
            }
        }
        Ok(())
    }
}

/// What a lease records of the request that takes it, owned: cheap clones of the
/// request's method, route and request id header (reference counts, no copy of the
/// text), turned into the record only when it is written ([`Holder::encode`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct Holder {
    method: Option<Method>,
    route: Route,
    request_id: RequestId,
}

#[derive(Clone, Debug, Default)]
enum Route {
    #[default]
    None,
    #[cfg(feature = "axum")]
    Matched(axum::extract::MatchedPath),
    Path(http::uri::PathAndQuery),
}

#[derive(Clone, Debug, Default)]
enum RequestId {
    #[default]
    None,
    Header(HeaderValue),
    TraceParent(HeaderValue),
}

/// Who asks for a lease, as the backend gets it: read only once the lease is taken, so
/// that a refused request costs nothing here.
#[derive(Clone, Copy, Debug)]
pub(crate) enum HolderRef<'a> {
    /// A direct call: the replica id only.
    Direct,
    /// A layer's request, read from its head.
    Request(&'a Parts),
    /// A request read before (an extractor's, a wait's).
    Known(&'a Holder),
}

/// The fields of a holder before they are bounded and sanitised.
struct Fields<'a> {
    method: Option<&'a str>,
    route: Option<&'a str>,
    request_id: Option<&'a [u8]>,
}

#[cfg(feature = "redis")]
impl Fields<'_> {
    /// A direct call's: none.
    const NONE: Self = Fields {
        method: None,
        route: None,
        request_id: None,
    };
}

impl Holder {
    /// What `parts` says of its request (see [`LockHolder`] for where each field comes
    /// from).
    pub(crate) fn of(parts: &Parts) -> Self {
        Self::of_head(&parts.method, &parts.uri, &parts.headers, &parts.extensions)
    }

    /// [`of`](Self::of) for a whole request.
    #[cfg(feature = "axum")]
    pub(crate) fn of_request<B>(request: &http::Request<B>) -> Self {
        let (method, uri) = (request.method(), request.uri());
        Self::of_head(method, uri, request.headers(), request.extensions())
    }

    fn of_head(method: &Method, uri: &Uri, headers: &HeaderMap, extensions: &Extensions) -> Self {
        #[cfg(feature = "axum")]
        let matched = extensions
            .get::<axum::extract::MatchedPath>()
            .cloned()
            .map(Route::Matched);
        #[cfg(not(feature = "axum"))]
        let matched = {
            let _ = extensions;
            None
        };
        let route = matched.unwrap_or_else(|| {
            uri.path_and_query()
                .cloned()
                .map_or(Route::None, Route::Path)
        });
        let request_id = match id_headers(headers) {
            IdHeader::RequestId(id) => RequestId::Header(id.clone()),
            IdHeader::TraceParent(t) => RequestId::TraceParent(t.clone()),
            IdHeader::None => RequestId::None,
        };
        Self {
            method: Some(method.clone()),
            route,
            request_id,
        }
    }

    fn fields(&self) -> Fields<'_> {
        let route = match &self.route {
            Route::None => None,
            #[cfg(feature = "axum")]
            Route::Matched(matched) => Some(matched.as_str()),
            Route::Path(path) => Some(path.path()),
        };
        let request_id = match &self.request_id {
            RequestId::None => None,
            RequestId::Header(id) => Some(id.as_bytes()),
            RequestId::TraceParent(header) => trace_id(header),
        };
        Fields {
            method: self.method.as_ref().map(Method::as_str),
            route,
            request_id,
        }
    }

    /// The record of this holder on the replica `replica`: its [`LockHolder`]'s stored
    /// form, bounded and sanitised.
    pub(crate) fn encode(&self, replica: &str) -> String {
        RecordBuf::of(replica, &self.fields()).as_str().to_owned()
    }
}

impl HolderRef<'_> {
    /// The holder, owned (for a wait, or a record kept in process).
    pub(crate) fn to_holder(self) -> Holder {
        match self {
            HolderRef::Direct => Holder::default(),
            HolderRef::Request(parts) => Holder::of(parts),
            HolderRef::Known(holder) => holder.clone(),
        }
    }

    /// The record of this holder on the replica `replica`, as [`Holder::encode`]: made on
    /// the stack, in one allocation.
    #[cfg(feature = "redis")]
    pub(crate) fn encode(self, replica: &str) -> Arc<str> {
        let head = RecordBuf::of(replica, &Fields::NONE);
        self.encode_after(head.as_str())
    }

    /// [`encode`](Self::encode) after `head`, the record of a direct call on the replica
    /// (`replica=..`, as `HolderRef::Direct.encode` made it): the replica's field is copied
    /// as it is, not bounded and sanitised again.
    #[cfg(feature = "redis")]
    pub(crate) fn encode_after(self, head: &str) -> Arc<str> {
        let fields = match self {
            HolderRef::Direct => Fields::NONE,
            HolderRef::Request(parts) => Fields {
                method: Some(parts.method.as_str()),
                route: route_of(parts),
                request_id: request_id_of(&parts.headers),
            },
            HolderRef::Known(holder) => holder.fields(),
        };
        Arc::from(RecordBuf::after(head, &fields).as_str())
    }
}

/// The route of `parts`, as [`Holder::of`] reads it, borrowed.
#[cfg(feature = "redis")]
fn route_of(parts: &Parts) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return Some(matched.as_str());
    }
    parts.uri.path_and_query().map(|p| p.path())
}

/// The request id of `headers`, as [`Holder::of`] reads it, borrowed.
#[cfg(feature = "redis")]
fn request_id_of(headers: &HeaderMap) -> Option<&[u8]> {
    match id_headers(headers) {
        IdHeader::RequestId(id) => Some(id.as_bytes()),
        IdHeader::TraceParent(t) => trace_id(t),
        IdHeader::None => None,
    }
}

/// The header a request id is read from: the first `x-request-id`, else the first
/// `traceparent`.
enum IdHeader<'a> {
    RequestId(&'a HeaderValue),
    TraceParent(&'a HeaderValue),
    None,
}

/// Up to this many header names, [`id_headers`] reads them in turn.
const SCANNED: usize = 8;

/// The [`IdHeader`] of `headers`. A request with a few headers is read once for both
/// names, cheaper than two hashed look-ups (which a request with neither pays in full);
/// one with more is looked up.
fn id_headers(headers: &HeaderMap) -> IdHeader<'_> {
    if headers.keys_len() > SCANNED {
        return match headers.get(X_REQUEST_ID) {
            Some(id) => IdHeader::RequestId(id),
            None => headers
                .get(TRACEPARENT)
                .map_or(IdHeader::None, IdHeader::TraceParent),
        };
    }
    let mut found = IdHeader::None;
    // Each name's values come together, its first value first.
    for (name, value) in headers {
        if *name == X_REQUEST_ID {
            return IdHeader::RequestId(value);
        }
        if *name == TRACEPARENT && matches!(found, IdHeader::None) {
            found = IdHeader::TraceParent(value);
        }
    }
    found
}

/// The trace id of a W3C `traceparent` header (`00-<32 hex>-<16 hex>-<2 hex>`): its 32
/// lowercase hex digits, unless they are all zero (invalid, W3C Trace Context § 3.2.2.3).
fn trace_id(header: &HeaderValue) -> Option<&[u8]> {
    let mut parts = header.as_bytes().split(|&b| b == b'-');
    let _version = parts.next()?;
    let id = parts.next()?;
    let hex = id.len() == 32 && id.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    (hex && id.iter().any(|&b| b != b'0')).then_some(id)
}

/// A record being written, on the stack: printable ASCII and spaces, at most
/// [`MAX_RECORD`] bytes.
struct RecordBuf {
    bytes: [u8; MAX_RECORD],
    len: usize,
}

impl RecordBuf {
    /// The stored form of `fields` on `replica`.
    fn of(replica: &str, fields: &Fields<'_>) -> Self {
        let mut record = RecordBuf::empty();
        record.field("replica=", replica.as_bytes(), MAX_REPLICA_LEN);
        record.optional(fields);
        record
    }

    /// The stored form of `fields` after `head`, a record of the replica alone.
    #[cfg(feature = "redis")]
    fn after(head: &str, fields: &Fields<'_>) -> Self {
        let mut record = RecordBuf::empty();
        record.push(head.as_bytes(), MAX_RECORD);
        record.optional(fields);
        record
    }

    fn empty() -> Self {
        RecordBuf {
            bytes: [0; MAX_RECORD],
            len: 0,
        }
    }

    /// The fields that are there, each after a space.
    fn optional(&mut self, fields: &Fields<'_>) {
        let optional = [
            (" method=", fields.method.map(str::as_bytes), MAX_METHOD_LEN),
            (" route=", fields.route.map(str::as_bytes), MAX_ROUTE_LEN),
            (" request_id=", fields.request_id, MAX_REQUEST_ID_LEN),
        ];
        for (name, value, max) in optional {
            if let Some(value) = value {
                self.field(name, value, max);
            }
        }
    }

    /// `name` (with its `=`), then the value bounded to `max` bytes and sanitised.
    fn field(&mut self, name: &str, value: &[u8], max: usize) {
        self.push(name.as_bytes(), usize::MAX);
        let written = self.push(value, max);
        for byte in written {
            if !byte.is_ascii_graphic() {
                *byte = b'_';
            }
        }
    }

    /// The first `max` bytes of `text`, as far as there is room, copied at once; the
    /// bytes written.
    fn push(&mut self, text: &[u8], max: usize) -> &mut [u8] {
        let start = self.len;
        let room = self.bytes.len().saturating_sub(start);
        let n = text.len().min(max).min(room);
        self.len = start.saturating_add(n);
        let (Some(slots), Some(text)) = (self.bytes.get_mut(start..self.len), text.get(..n)) else {
            return &mut [];
        };
        slots.copy_from_slice(text);
        slots
    }

    fn as_str(&self) -> &str {
        let bytes = self.bytes.get(..self.len).unwrap_or_default();
        // Only ASCII is written.
        std::str::from_utf8(bytes).unwrap_or_default()
    }
}

/// The first `max` bytes of `value`, each outside printable ASCII (or a space) as `_`.
fn push_clean(out: &mut String, value: &[u8], max: usize) {
    out.extend(value.iter().take(max).map(|&b| {
        if b.is_ascii_graphic() {
            char::from(b)
        } else {
            '_'
        }
    }));
}

/// A replica id as it is kept: sanitised and bounded as a holder's fields are.
pub(crate) fn replica_id(id: &str) -> Arc<str> {
    let mut out = String::with_capacity(id.len().min(MAX_REPLICA_LEN));
    push_clean(&mut out, id.as_bytes(), MAX_REPLICA_LEN);
    Arc::from(out)
}

/// The default replica id, worked out once per process: `<hostname>-<pid>`, the host
/// name read from `/proc/sys/kernel/hostname` or `/etc/hostname` (no environment
/// variable), `unknown` when neither has one; the host name is cut so that the pid stays.
pub(crate) fn default_replica_id() -> Arc<str> {
    static DEFAULT: OnceLock<Arc<str>> = OnceLock::new();
    DEFAULT
        .get_or_init(|| {
            let host = ["/proc/sys/kernel/hostname", "/etc/hostname"]
                .iter()
                .find_map(|path| {
                    let name = std::fs::read_to_string(path).ok()?;
                    Some(name.trim().to_owned()).filter(|name| !name.is_empty())
                })
                .unwrap_or_else(|| "unknown".to_owned());
            let pid = std::process::id().to_string();
            let room = MAX_REPLICA_LEN.saturating_sub(pid.len().saturating_add(1));
            let mut id = String::with_capacity(MAX_REPLICA_LEN);
            push_clean(&mut id, host.as_bytes(), room);
            id.push('-');
            id.push_str(&pid);
            Arc::from(id)
        })
        .clone()
}

#[cfg(test)]
mod tests;
