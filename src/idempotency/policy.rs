//! What [`IdempotencyLayer`](super::IdempotencyLayer) does with a key: replay a stored
//! response, or run the request under a lease and store what it answered.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, response};

use super::record::{Fingerprint, Record, kept_headers};
use crate::backend::contract::Answer;
use crate::backend::records::{Begin, NewRecord, Owner, RecordOwner};
use crate::error::LockError;
use crate::future::Watch;
use crate::future::{BoxError, boxed};
use crate::holder::HolderRef;
use crate::keyed::future::Trailers;
use crate::keyed::policy::Sealed;
use crate::keyed::policy::{Decision, End, Hold, Permit, Policy, Release, Releasing, Verdict};
use crate::lease::Lease;
use crate::lock::handle::Locks;
use crate::lock::policy::{LockPermit, refused};
use crate::lock::watchdog::Renewal;
use crate::observe::IdempotencyResult;
use crate::rejection::{GRPC_MESSAGE, GRPC_STATUS, RejectedBy, Rejection, RejectionKind};

/// The header set on a replayed response: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The fingerprint of a request, put in its extensions once its body is read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestFingerprint(pub(crate) Fingerprint);

/// The policy of [`IdempotencyLayer`](super::IdempotencyLayer): its backend and what it
/// stores. Set through the layer's builder methods.
#[derive(Clone, Debug)]
pub struct IdempotencyPolicy {
    pub(crate) locks: Locks,
    pub(crate) record_ttl: Duration,
    pub(crate) max_response_body: usize,
    pub(crate) stored_headers: Arc<[HeaderName]>,
    pub(crate) storable: fn(StatusCode) -> bool,
    pub(crate) max_wait: Duration,
    pub(crate) renewal: Renewal,
}

impl IdempotencyPolicy {
    fn verdict(
        &self,
        begun: Result<Begin, LockError>,
        fingerprint: Fingerprint,
        owner: Owner,
    ) -> Verdict<IdempotencyPermit> {
        match &begun {
            Ok(Begin::Acquired(_)) => IdempotencyResult::New.count(),
            Ok(Begin::Found(_)) => {} // counted by `replay`, which reads the record
            Err(LockError::Taken { .. }) => IdempotencyResult::InFlight.count(),
            Err(LockError::InvalidKey(_)) => IdempotencyResult::Invalid.count(),
            Err(_) => IdempotencyResult::Unavailable.count(),
        }
        match begun {
            Ok(Begin::Acquired(lease)) => {
                Verdict::Admit(IdempotencyPermit::new(self, lease, fingerprint, owner))
            }
            Ok(Begin::Found(raw)) => Verdict::answer(replay(&raw, &fingerprint)),
            Err(e) => refused::<Self>(e, StatusCode::CONFLICT),
        }
    }
}

impl Sealed for IdempotencyPolicy {}

impl Policy for IdempotencyPolicy {
    type Permit = IdempotencyPermit;
    const REJECTED_BY: RejectedBy = RejectedBy::Idempotency;
    const FAIL_OPEN: bool = false;

    fn prefix(&self) -> &str {
        self.locks.prefix()
    }

    #[inline]
    fn refuses(&self) -> bool {
        self.locks
            .refuses(crate::backend::fallback::User::IdempotencyLayer)
    }

    fn bad_key(&self, missing: bool) {
        if missing {
            IdempotencyResult::Missing
        } else {
            IdempotencyResult::Invalid
        }
        .count();
    }

    fn decide(&self, key: &str, parts: &Parts) -> Decision<IdempotencyPermit> {
        let owner = parts
            .extensions
            .get()
            .map_or(0, |&RecordOwner(owner)| owner);
        let Some(RequestFingerprint(fingerprint)) = parts.extensions.get().copied() else {
            // Only a service built by hand around the core gets here.
            tracing::error!(
                "IdempotencyLayer: a request reached the policy without its fingerprint"
            );
            return Decision::Ready(Verdict::answer(
                Rejection::misconfigured(RejectedBy::Idempotency).into(),
            ));
        };
        let key = Arc::<str>::from(key);
        match self.locks.backend().begin_idempotent(
            key.clone(),
            self.max_wait,
            HolderRef::Request(parts),
        ) {
            Answer::Now(begun) => {
                let begun = begun.map_err(|e| self.locks.estimated(&key, e));
                Decision::Ready(self.verdict(begun, fingerprint, owner))
            }
            Answer::Later(beginning) => {
                let policy = self.clone();
                Decision::Pending(boxed(|| async move {
                    let begun = beginning.await;
                    let begun = begun.map_err(|e| policy.locks.estimated(&key, e));
                    policy.verdict(begun, fingerprint, owner)
                }))
            }
        }
    }
}

static GRPC_STATUS_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");

/// The HTTP status of a gRPC status code (`google.rpc.Code`'s mapping; 500 for others),
/// so that `storable` judges gRPC responses as HTTP ones.
fn http_status_of_grpc(code: &HeaderValue) -> StatusCode {
    let code = code.to_str().ok().and_then(|c| c.parse::<u16>().ok());
    let status = match code {
        Some(0) => 200,
        Some(1) => 499,
        Some(3 | 9 | 11) => 400,
        Some(4) => 504,
        Some(5) => 404,
        Some(6 | 10) => 409,
        Some(7) => 403,
        Some(8) => 429,
        Some(12) => 501,
        Some(14) => 503,
        Some(16) => 401,
        _ => 500,
    };
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

fn refusal(kind: RejectionKind, detail: &'static str) -> Response<Bytes> {
    Rejection::new(RejectedBy::Idempotency, kind, detail).into()
}

/// The answer to a retry that found a record.
fn replay(raw: &[u8], fingerprint: &Fingerprint) -> Response<Bytes> {
    let Some(record) = Record::decode(raw) else {
        IdempotencyResult::Invalid.count();
        tracing::error!(
            "an idempotency record could not be read (another program's value, or another format version); answering 500"
        );
        let detail = "The stored result of this idempotency key could not be read.";
        return refusal(RejectionKind::Misconfigured, detail);
    };
    if record.fingerprint() != fingerprint {
        IdempotencyResult::Mismatch.count();
        let detail = "This idempotency key was already used for another request.";
        return refusal(RejectionKind::Mismatch, detail);
    }
    match record {
        Record::Unreplayable { .. } => {
            IdempotencyResult::Invalid.count();
            refusal(
                RejectionKind::Unreplayable,
                "A request with this idempotency key already completed, but its response could not be stored, so it cannot be replayed.",
            )
        }
        Record::Response {
            status,
            headers,
            body,
            trailers,
            ..
        } => {
            IdempotencyResult::Replayed.count();
            let mut response = Response::new(body);
            *response.status_mut() = status;
            // `Extend` and `FromIterator` append: order and repeated fields are kept.
            response.headers_mut().extend(headers);
            if !trailers.is_empty() {
                let trailers: HeaderMap = trailers.into_iter().collect();
                response.extensions_mut().insert(Trailers(trailers));
            }
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            response
        }
    }
}

/// A first request's lease, and what its response leaves to store.
#[doc(hidden)]
pub struct IdempotencyPermit {
    /// The lease, held, renewed and released as a lock layer's.
    lease: LockPermit,
    fingerprint: Fingerprint,
    /// The principal the record belongs to (for the in-process store's bounds).
    owner: Owner,
    record_ttl: Duration,
    max_body: usize,
    stored_headers: Arc<[HeaderName]>,
    storable: fn(StatusCode) -> bool,
    /// The head to store, once the inner service answered with a storable status.
    head: Option<(StatusCode, Vec<(HeaderName, HeaderValue)>)>,
    body: BytesMut,
    /// A gRPC response's trailers (its status), stored after the body.
    trailers: Vec<(HeaderName, HeaderValue)>,
    /// The body went over the cap: the result cannot be replayed.
    over: bool,
}

impl fmt::Debug for IdempotencyPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyPermit")
            .field("lease", &self.lease)
            .field("stored", &self.head.is_some())
            .field("body", &self.body.len())
            .field("over", &self.over)
            .finish_non_exhaustive()
    }
}

impl IdempotencyPermit {
    fn new(
        policy: &IdempotencyPolicy,
        lease: Lease,
        fingerprint: Fingerprint,
        owner: Owner,
    ) -> Self {
        Self {
            owner,
            lease: LockPermit::for_lease(policy.locks.clone(), lease, policy.renewal),
            fingerprint,
            record_ttl: policy.record_ttl,
            max_body: policy.max_response_body,
            stored_headers: policy.stored_headers.clone(),
            storable: policy.storable,
            head: None,
            body: BytesMut::new(),
            trailers: Vec::new(),
            over: false,
        }
    }

    /// Whether `more` bytes fit under the cap; if not, the result is unreplayable.
    fn fits(&mut self, more: usize) -> bool {
        if self.body.len().saturating_add(more) > self.max_body {
            self.over = true;
            self.body = BytesMut::new();
            return false;
        }
        true
    }

    /// What to store as the request ends.
    fn record(&mut self, end: End) -> Option<Bytes> {
        let (status, headers) = self.head.take()?;
        let fingerprint = self.fingerprint;
        let record = match end {
            End::Complete if !self.over => Record::Response {
                fingerprint,
                status,
                headers,
                body: std::mem::take(&mut self.body).freeze(),
                trailers: std::mem::take(&mut self.trailers),
            },
            End::Complete => Record::Unreplayable { fingerprint },
            // A body cut because the lease ran out: the request ran, its result is gone.
            End::Failed if !self.lease.is_valid() => Record::Unreplayable { fingerprint },
            // The service or its body failed: nothing stored, a retry runs again.
            End::Failed => return None,
        };
        record
            .encode()
            .or_else(|| Record::Unreplayable { fingerprint }.encode())
    }
}

impl Watch for IdempotencyPermit {
    fn lost_before_poll(&mut self, cx: &mut Context<'_>) -> bool {
        self.lease.lost_before_poll(cx)
    }

    fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        Watch::poll_lost(&mut self.lease, cx)
    }
}

impl Permit for IdempotencyPermit {
    fn admit<B>(&mut self, request: &mut Request<B>) {
        self.lease.admit(request);
    }

    fn abort_on_loss(&self) -> bool {
        self.lease.abort_on_loss()
    }

    fn shadowed(&mut self) {
        self.lease.shadowed();
    }

    fn lost_response(self) -> Response<Bytes> {
        self.lease.lost_response()
    }

    fn lost_error(self) -> BoxError {
        self.lease.lost_error()
    }

    fn on_response(&mut self, head: &mut response::Parts) -> Hold {
        if !(self.storable)(head.status) {
            return Hold::BodyEnd;
        }
        let mut kept = kept_headers(&head.headers, &self.stored_headers);
        // A trailers-only gRPC response has its status in the head: judged and kept too.
        let grpc = crate::keyed::answers::is_grpc(&head.headers);
        if let Some(code) = grpc.then(|| head.headers.get(&GRPC_STATUS)).flatten() {
            if !(self.storable)(http_status_of_grpc(code)) {
                return Hold::BodyEnd;
            }
            let status_fields = [&GRPC_STATUS, &GRPC_MESSAGE, &GRPC_STATUS_DETAILS];
            kept.extend(kept_headers(
                &head.headers,
                &status_fields.map(Clone::clone),
            ));
        }
        self.head = Some((head.status, kept));
        Hold::BodyEnd
    }

    fn on_trailers(&mut self, trailers: &HeaderMap) {
        if self.head.is_none() || self.over {
            return;
        }
        let status = trailers.get(&GRPC_STATUS);
        if status.is_some_and(|code| !(self.storable)(http_status_of_grpc(code))) {
            self.head = None;
            return;
        }
        let size = trailers.iter().map(|(n, v)| n.as_str().len() + v.len());
        if self.fits(size.sum()) {
            self.trailers = trailers
                .iter()
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect();
        }
    }

    fn on_data(&mut self, data: &Bytes) {
        if self.head.is_some() && !self.over && self.fits(data.len()) {
            self.body.extend_from_slice(data);
        }
    }

    fn release(mut self, end: End) -> Release {
        let record = self.record(end).map(|raw| NewRecord {
            raw,
            owner: self.owner,
            ttl: self.record_ttl,
        });
        let (locks, lease) = self.lease.disarm();
        match locks.backend().finish_idempotent(lease, record) {
            Answer::Now(()) => Release::Done,
            Answer::Later(release) => Release::Pending(Releasing::finishing(release)),
        }
    }
}
