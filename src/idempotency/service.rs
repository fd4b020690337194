//! The [`Idempotency`] service.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;

use super::body::ResponseBody;
use super::layer::Config;
use super::record::{Fingerprint, Record, kept_headers};
use super::store::Begin;
use crate::backend::watchdog::{Protected, Watchdog};
use crate::error::LockError;
use crate::key::{HeaderKey, KeyExtractor, push_escaped, shared_key, validate_value};
use crate::lease::Lease;
use crate::problem::Problem;

/// The header set on a replayed response: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service of [`IdempotencyLayer`](super::IdempotencyLayer).
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

/// The response future of [`Idempotency`].
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static>>;

impl<S, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    ReqB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB::Error: Send,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // The service that was driven to readiness is the one we call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        Box::pin(handle(inner, config, req))
    }
}

fn problem<B>(problem: Problem) -> Response<ResponseBody<B>> {
    let response: Response<Bytes> = problem.into_response();
    response.map(ResponseBody::full)
}

async fn handle<S, ReqB, ResB>(
    mut inner: S,
    config: Arc<Config>,
    req: Request<ReqB>,
) -> Result<Response<ResponseBody<ResB>>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ReqB: Body<Data = Bytes> + From<Bytes>,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin,
{
    let (mut parts, body) = req.into_parts();
    let extractor = HeaderKey::new(config.header.clone());
    let value = match extractor.extract(&mut parts) {
        Ok(Some(value)) => value,
        Ok(None) => {
            return Ok(problem(Problem::new(
                StatusCode::BAD_REQUEST,
                format!("This request needs an {} header.", config.header),
            )));
        }
        Err(e) => return Ok(problem(Problem::new(StatusCode::BAD_REQUEST, format!("Invalid idempotency key: {e}.")))),
    };
    if let Err(e) = validate_value(&value) {
        return Ok(problem(Problem::new(
            StatusCode::BAD_REQUEST,
            format!("Invalid idempotency key: {e}."),
        )));
    }
    let tenant = match &config.tenant {
        None => None,
        Some(tenant) => match tenant(&parts) {
            Some(t) if validate_value(&t).is_ok() => Some(t),
            _ => {
                return Ok(problem(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "This request does not say whose idempotency key it is.",
                )));
            }
        },
    };
    let bytes = match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return Ok(problem(Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "The request body is over {} bytes, the most this endpoint reads.",
                    config.max_request_body
                ),
            )));
        }
        Err(_) => {
            return Ok(problem(Problem::new(
                StatusCode::BAD_REQUEST,
                "The request body could not be read.",
            )));
        }
    };
    let fingerprint = (config.fingerprint)(&parts, &bytes);
    let key = shared_key(|out| {
        out.push_str(config.store.locks.prefix());
        let scope_at = out.len();
        if let Some(tenant) = &tenant {
            out.push_str("tenant ");
            push_escaped(out, tenant);
            out.push(' ');
        }
        extractor.write_scope(&parts, out);
        crate::key::escape_from(out, scope_at);
        out.push(':');
        push_escaped(out, &value);
    });
    let lease = match config.store.begin(key, config.max_wait).await {
        Ok(Begin::Found(raw)) => return Ok(replay(&raw, &fingerprint)),
        Ok(Begin::Acquired(lease)) => lease,
        Err(LockError::Taken { retry_after }) => {
            return Ok(problem(
                Problem::new(
                    StatusCode::CONFLICT,
                    "A request with the same idempotency key is still in progress.",
                )
                .retry_after(retry_after),
            ));
        }
        Err(e) => {
            if !matches!(e, LockError::InvalidKey(_)) {
                tracing::warn!(error = %e, "idempotency store unavailable; answering 503");
            }
            return Ok(problem(Problem::from_lock_error(&e, StatusCode::CONFLICT)));
        }
    };
    run(inner.call(with_lease(parts, bytes, &lease)), config, lease, fingerprint).await
}

fn with_lease<ReqB: From<Bytes>>(
    mut parts: http::request::Parts,
    bytes: Bytes,
    lease: &Lease,
) -> Request<ReqB> {
    parts.extensions.insert(lease.clone());
    Request::from_parts(parts, ReqB::from(bytes))
}

/// Runs the first request under its lease, then stores what can be replayed and
/// releases.
async fn run<F, ResB, E>(
    call: F,
    config: Arc<Config>,
    lease: Lease,
    fingerprint: Fingerprint,
) -> Result<Response<ResponseBody<ResB>>, E>
where
    F: Future<Output = Result<Response<ResB>, E>>,
    ResB: Body<Data = Bytes> + Unpin,
{
    let store = &config.store;
    let mut guard = crate::backend::handle::LeaseGuard::new(store.locks.clone(), lease.clone());
    let watchdog = Watchdog::new(store.locks.clone(), lease.clone(), config.renewal);
    let response = match Protected::new(call, watchdog).await {
        Ok(Ok(response)) => response,
        // A service error or a lost lease: nothing is stored, a retry runs again.
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Ok(problem(
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "The lock was lost while the request ran, so its work was stopped; retry the request.",
                )
                .retry_after(std::time::Duration::from_secs(1)),
            ));
        }
    };
    guard.disarm();
    let (parts, mut body) = response.into_parts();
    if !(config.storable)(parts.status) {
        finish(&config, lease, None).await;
        return Ok(Response::from_parts(parts, ResponseBody::prefixed(VecDeque::new(), body)));
    }
    // Read the body, up to the cap and within the lease, to store it.
    let mut frames = VecDeque::new();
    let mut collected = BytesMut::new();
    let mut complete = false;
    let mut failed = false;
    let read = async {
        loop {
            match body.frame().await {
                None => {
                    complete = true;
                    break;
                }
                Some(Ok(frame)) => {
                    let Some(data) = frame.data_ref() else {
                        // Trailers are not stored: pass them on, store nothing replayable.
                        frames.push_back(frame);
                        break;
                    };
                    if collected.len().saturating_add(data.len()) > config.max_response_body {
                        frames.push_back(frame);
                        break;
                    }
                    collected.extend_from_slice(data);
                    frames.push_back(frame);
                }
                Some(Err(_)) => {
                    failed = true;
                    break;
                }
            }
        }
    };
    let left = lease.remaining();
    let in_time = tokio::time::timeout(left, read).await.is_ok();
    if failed {
        // The client gets a cut body; nothing stored, a retry runs again.
        finish(&config, lease, None).await;
        return Ok(Response::from_parts(
            parts,
            ResponseBody::prefixed(VecDeque::new(), body),
        ));
    }
    let record = if in_time && complete {
        Record::Response {
            fingerprint,
            status: parts.status,
            headers: kept_headers(&parts.headers, &config.stored_headers),
            body: collected.freeze(),
        }
    } else {
        Record::Unreplayable { fingerprint }
    };
    let stored = record.encode().or_else(|| Record::Unreplayable { fingerprint }.encode());
    finish(&config, lease, stored).await;
    Ok(Response::from_parts(parts, ResponseBody::prefixed(frames, body)))
}

async fn finish(config: &Config, lease: Lease, record: Option<Bytes>) {
    if let Err(e) = config.store.finish(lease, record, config.record_ttl).await {
        tracing::warn!(error = %e, "the idempotency record could not be stored on a quorum; a retry may run again");
    }
}

/// The answer to a retry that found a record.
fn replay<B>(raw: &[u8], fingerprint: &Fingerprint) -> Response<ResponseBody<B>> {
    let Some(record) = Record::decode(raw) else {
        tracing::error!("an idempotency record could not be read (another program's value, or another format version); answering 500");
        return problem(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The stored result of this idempotency key could not be read.",
        ));
    };
    if record.fingerprint() != fingerprint {
        return problem(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "This idempotency key was already used for another request.",
        ));
    }
    match record {
        Record::Unreplayable { .. } => problem(Problem::new(
            StatusCode::CONFLICT,
            "A request with this idempotency key already completed, but its response could not be stored, so it cannot be replayed.",
        )),
        Record::Response {
            status,
            headers,
            body,
            ..
        } => {
            let mut response = Response::new(ResponseBody::full(body));
            *response.status_mut() = status;
            for (name, value) in headers {
                response.headers_mut().append(name, value);
            }
            response.headers_mut().insert(
                http::HeaderName::from_static(IDEMPOTENT_REPLAYED),
                HeaderValue::from_static("true"),
            );
            response
        }
    }
}
