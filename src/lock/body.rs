//! The request body before the lock: [`LockLayer`](crate::LockLayer) reads a request's body
//! whole, within a bound in bytes and in time, before it takes the lock, so that a client
//! that sends its body slowly holds no lock while it does.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::future::{BoxError, PolledFrame};
use crate::keyed::answers::{RenderFn, Rendering};
use crate::rejection::{RejectedBy, Rejection, RejectionKind};

/// Default bound on a request body that [`LockLayer`](crate::LockLayer) reads before it
/// takes its lock: 1 MiB (413 Content Too Large beyond).
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;

/// Default time a request body has to arrive whole before
/// [`LockLayer`](crate::LockLayer) takes its lock: 10 s (408 Request Timeout beyond).
pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// How a layer reads the request body before its lock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyRule {
    /// Read first; `false` streams the body to the inner service under the lock.
    pub(crate) read_first: bool,
    pub(crate) max: usize,
    pub(crate) timeout: Duration,
}

impl Default for BodyRule {
    fn default() -> Self {
        Self {
            read_first: true,
            max: DEFAULT_MAX_REQUEST_BODY,
            timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
        }
    }
}

pin_project! {
    /// The request body the service inside [`LockLayer`](crate::LockLayer) gets: the bytes
    /// read before the lock was taken, or, for a request without a body or behind a layer
    /// that streams ([`LockLayer::stream_request_body`](crate::LockLayer::stream_request_body)),
    /// the body as it came. Its data is [`Bytes`] and its error a boxed error, as axum's
    /// and tonic's services take.
    pub struct RequestBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Read {
            data: Option<Bytes>,
            trailers: Option<HeaderMap>,
        },
        Streamed {
            #[pin]
            body: B,
        },
    }
}

impl<B> RequestBody<B> {
    /// The body as it came, handed on unread.
    pub fn streamed(body: B) -> Self {
        Self {
            kind: Kind::Streamed { body },
        }
    }

    /// A body read whole: its data and its trailers.
    fn read(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: Kind::Read {
                data: Some(data).filter(|d| !d.is_empty()),
                trailers,
            },
        }
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Read { .. } => "Read",
            Kind::Streamed { .. } => "Streamed",
        };
        f.debug_struct("RequestBody").field("kind", &kind).finish()
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> PolledFrame {
        match self.project().kind.project() {
            KindProj::Read { data, trailers } => {
                if let Some(data) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            KindProj::Streamed { body } => body.poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Read { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Streamed { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Read { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Streamed { body } => body.size_hint(),
        }
    }
}

/// Reads the request body whole, within a bound in bytes (413 beyond) and in time (408
/// beyond), before it calls `S`, then hands the request on with a [`RequestBody`]. A
/// request whose body is already at its end (a `GET`, an empty body) goes on at once.
///
/// [`LockLayer`](crate::LockLayer) is this service around its keyed core, so that a
/// client that sends its body slowly holds no lock; [`ReadRequestBodyLayer`] puts it in
/// front of a handler whose [`Locked`](crate::Locked) extractor locks before a body
/// extractor reads the body.
#[derive(Clone)]
pub struct ReadRequestBody<S> {
    pub(crate) inner: S,
    pub(crate) rule: BodyRule,
    pub(crate) on_rejection: Option<Arc<RenderFn>>,
}

impl<S> ReadRequestBody<S> {
    crate::keyed::inner_service_accessors!();
}

impl<S: fmt::Debug> fmt::Debug for ReadRequestBody<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadRequestBody")
            .field("inner", &self.inner)
            .field("read_first", &self.rule.read_first)
            .field("max", &self.rule.max)
            .field("timeout", &self.rule.timeout)
            .finish_non_exhaustive()
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for ReadRequestBody<S>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone,
    ReqB: Body<Data = Bytes>,
    ReqB::Error: Into<BoxError>,
    ResB: From<Bytes>,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ReadRequestBodyFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let (parts, body) = req.into_parts();
        if !self.rule.read_first || body.is_end_stream() {
            let req = Request::from_parts(parts, RequestBody::streamed(body));
            return ReadRequestBodyFuture {
                state: State::Calling {
                    future: self.inner.call(req),
                },
            };
        }
        let rule = self.rule;
        let answers = Rendering::for_request(&parts.headers, self.on_rejection.as_ref());
        if body.size_hint().lower() > rule.max as u64 {
            return ReadRequestBodyFuture::refused(too_large(rule.max), &answers);
        }
        // The service that was driven to readiness is the one called, once the body is in.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ReadRequestBodyFuture {
            state: State::Reading {
                collect: http_body_util::BodyExt::collect(http_body_util::Limited::new(
                    body, rule.max,
                )),
                deadline: tokio::time::sleep(rule.timeout),
                call: Some((inner, parts, answers)),
                rule,
            },
        }
    }
}

/// A [`Layer`](tower_layer::Layer) that reads the request body whole before the service
/// it wraps is called ([`ReadRequestBody`]): at most `max` bytes (413 Content Too Large
/// beyond, RFC 9110, section 15.5.14), arriving within `timeout` (408 Request Timeout
/// beyond, RFC 9110, section 15.5.9). Defaults 1 MiB and 10 s, as
/// [`LockLayer`](crate::LockLayer)'s.
///
/// axum runs the extractor that reads the body last, so a handler that takes
/// [`Locked<Path<..>>`](crate::Locked) and a body (`String`, `Json<T>`) holds its lock while
/// the client sends the body. Put this layer on such a route, and the body has arrived
/// before the lock is taken:
///
/// ```
/// use axum::{Router, extract::Path, routing::post};
/// use tower_redlock::Locked;
/// use tower_redlock::lock::ReadRequestBodyLayer;
///
/// async fn pay(order: Locked<Path<u64>>, body: String) -> String {
///     format!("order {} paid with {body}", order.0)
/// }
///
/// let app: Router = Router::new()
///     .route("/orders/{id}/pay", post(pay).layer(ReadRequestBodyLayer::new()))
///     .with_state(tower_redlock::Locks::default());
/// ```
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct ReadRequestBodyLayer {
    rule: BodyRule,
}

impl Default for ReadRequestBodyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl ReadRequestBodyLayer {
    /// At most 1 MiB, within 10 s.
    pub fn new() -> Self {
        Self {
            rule: BodyRule::default(),
        }
    }

    /// The largest body read, in bytes; a longer one is answered 413.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.rule.max = bytes;
        self
    }

    /// How long the body has to arrive whole, from the request's arrival at this layer; a
    /// slower one is answered 408.
    pub fn request_body_timeout(mut self, timeout: Duration) -> Self {
        self.rule.timeout = timeout;
        self
    }
}

impl<S> tower_layer::Layer<S> for ReadRequestBodyLayer {
    type Service = ReadRequestBody<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReadRequestBody {
            inner,
            rule: self.rule,
            on_rejection: None,
        }
    }
}

fn too_large(max: usize) -> Rejection {
    let detail = format!(
        "The request body is over {max} bytes, the most this endpoint reads before it takes its lock."
    );
    Rejection::new(RejectedBy::Lock, RejectionKind::TooLarge, detail)
}

pin_project! {
    /// The response future of [`ReadRequestBody`].
    pub struct ReadRequestBodyFuture<S, ReqB>
    where
        S: Service<Request<RequestBody<ReqB>>>,
        ReqB: Body,
        ReqB::Error: Into<BoxError>,
    {
        #[pin]
        state: State<S, ReqB>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB>
    where
        S: Service<Request<RequestBody<ReqB>>>,
        ReqB: Body,
        ReqB::Error: Into<BoxError>,
    {
        // Reading the body, until the deadline.
        Reading {
            #[pin]
            collect: http_body_util::combinators::Collect<http_body_util::Limited<ReqB>>,
            #[pin]
            deadline: Sleep,
            call: Option<(S, Parts, Rendering)>,
            rule: BodyRule,
        },
        // The inner service runs.
        Calling {
            #[pin]
            future: S::Future,
        },
        // The layer answers itself.
        Refused {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, ReqB> fmt::Debug for ReadRequestBodyFuture<S, ReqB>
where
    S: Service<Request<RequestBody<ReqB>>>,
    ReqB: Body,
    ReqB::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadRequestBodyFuture")
            .finish_non_exhaustive()
    }
}

impl<S, ReqB> ReadRequestBodyFuture<S, ReqB>
where
    S: Service<Request<RequestBody<ReqB>>>,
    ReqB: Body,
    ReqB::Error: Into<BoxError>,
{
    fn refused(rejection: Rejection, answers: &Rendering) -> Self {
        Self {
            state: State::Refused {
                response: Some(answers.render(rejection.into())),
            },
        }
    }
}

impl<S, ReqB, ResB> Future for ReadRequestBodyFuture<S, ReqB>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ReqB: Body<Data = Bytes>,
    ReqB::Error: Into<BoxError>,
    ResB: From<Bytes>,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Calling { future } => return future.poll(cx),
                StateProj::Refused { response } => {
                    let response = response.take().unwrap_or_default();
                    return Poll::Ready(Ok(response.map(ResB::from)));
                }
                StateProj::Reading {
                    collect,
                    deadline,
                    call,
                    rule,
                } => {
                    let read = match collect.poll(cx) {
                        Poll::Ready(read) => Some(read),
                        Poll::Pending => {
                            ready!(deadline.poll(cx));
                            None
                        }
                    };
                    let Some((mut service, parts, answers)) = call.take() else {
                        // Polled again after it answered: nothing left to do.
                        return Poll::Pending;
                    };
                    match read {
                        Some(Ok(collected)) => {
                            let trailers = collected.trailers().cloned();
                            let body = RequestBody::read(collected.to_bytes(), trailers);
                            let req = Request::from_parts(parts, body);
                            State::Calling {
                                future: service.call(req),
                            }
                        }
                        Some(Err(e)) => {
                            let rejection = if e.is::<http_body_util::LengthLimitError>() {
                                too_large(rule.max)
                            } else {
                                // The client's body stream broke off.
                                let detail = "The request body could not be read.";
                                Rejection::new(RejectedBy::Lock, RejectionKind::InvalidKey, detail)
                            };
                            ReadRequestBodyFuture::<S, ReqB>::refused(rejection, &answers).state
                        }
                        None => {
                            let detail = format!(
                                "The request body did not arrive within {} ms; send it whole, then the lock is taken.",
                                rule.timeout.as_millis()
                            );
                            let rejection = Rejection::new(
                                RejectedBy::Lock,
                                RejectionKind::RequestTimeout,
                                detail,
                            );
                            ReadRequestBodyFuture::<S, ReqB>::refused(rejection, &answers).state
                        }
                    }
                }
            };
            this.state.set(next);
        }
    }
}
