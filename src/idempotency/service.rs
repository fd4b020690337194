//! The service of [`IdempotencyLayer`](super::IdempotencyLayer): reads the request body
//! to fingerprint it, then hands the request to the keyed core.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use tower_service::Service;

use super::key::IdempotencyKey;
use super::layer::FingerprintFn;
use super::policy::{IdempotencyPolicy, RequestFingerprint};
use crate::keyed::Keyed;
use crate::keyed::answers::{RenderFn, Rendering};
use crate::keyed::policy::{BoxError, BoxFuture};
use crate::rejection::{RejectedBy, Rejection, RejectionKind};

/// The service of [`IdempotencyLayer`](super::IdempotencyLayer) around `S`.
pub type Idempotency<S> = ReadBody<Keyed<S, IdempotencyKey, IdempotencyPolicy>>;

/// Reads the request body (413 over the bound), puts its fingerprint in the extensions
/// and hands the request on with the same bytes as a [`Full<Bytes>`] body.
#[derive(Clone)]
pub struct ReadBody<S> {
    pub(super) inner: S,
    pub(super) max: usize,
    pub(super) fingerprint: Arc<FingerprintFn>,
    pub(super) on_rejection: Option<Arc<RenderFn>>,
}

impl<S> ReadBody<S> {
    crate::keyed::inner_service_accessors!();
}

impl<S: fmt::Debug> fmt::Debug for ReadBody<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadBody")
            .field("inner", &self.inner)
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ReadBody<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: From<Bytes> + 'static,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResB>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // Call the service that was driven to readiness.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (max, fingerprint) = (self.max, self.fingerprint.clone());
        let on_rejection = self.on_rejection.clone();
        // Split here, not in the future: a future keeps what it captures until it ends,
        // so a split inside it would hold the request and its head both, and copy the
        // head once more.
        let (mut parts, body) = req.into_parts();
        crate::future::boxed(|| async move {
            let bytes = match Limited::new(body, max).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(e) => {
                    let (kind, detail): (_, Cow<'static, str>) = if e.is::<LengthLimitError>() {
                        let detail = format!(
                            "The request body is over {max} bytes, the most this endpoint reads."
                        );
                        (RejectionKind::TooLarge, detail.into())
                    } else {
                        // The client's body stream broke off: a request to send again.
                        let detail = "The request body could not be read.";
                        (RejectionKind::InvalidKey, detail.into())
                    };
                    let rejection = Rejection::new(RejectedBy::Idempotency, kind, detail);
                    let answers = Rendering::for_request(&parts.headers, on_rejection.as_ref());
                    return Ok(answers.render(rejection.into()).map(ResB::from));
                }
            };
            parts
                .extensions
                .insert(RequestFingerprint(fingerprint(&parts, &bytes)));
            inner
                .call(Request::from_parts(parts, Full::new(bytes)))
                .await
        })
    }
}
