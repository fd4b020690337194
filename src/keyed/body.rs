use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::policy::{BoxError, End, Permit, Policy, Release, Releasing};
use crate::future::PolledFrame;
use crate::future::{Lost, poll_guarded};
use crate::rejection::Rejection;

pin_project! {
    /// The response body of a keyed middleware: the inner service's body, or the
    /// layer's own answer (a problem, `application/problem+json`).
    ///
    /// When the permit is held until the body ends (a lock lease, by default), the body
    /// keeps it, as tower-http's `TimeoutBody` keeps its timer: the lease is renewed while
    /// the body streams, never polled past its validity (a lease lost mid-body ends the
    /// body with an error), and released as the last frame is handed on, before the
    /// client can see the end of the response. A client that sends its next request once
    /// it has read this response never finds its own lock still held. Dropping the body
    /// early (the client went away) releases in the background.
    pub struct ResponseBody<B, P>
    where
        P: Policy,
    {
        #[pin]
        kind: BodyKind<B, P::Permit>,
    }
}

pin_project! {
    #[project = BodyKindProj]
    enum BodyKind<B, H> {
        Answer {
            data: Option<Bytes>,
            // After the data: a replayed gRPC response's status.
            trailers: Option<Box<HeaderMap>>,
        },
        Plain {
            #[pin]
            body: B,
        },
        Held {
            held: HeldBody<B, H>,
        },
    }
}

/// The inner body under its permit until it ends: the one place a held permit's loss and
/// release are handled once the inner service has answered. The response future polls it
/// first (before the head is handed on, see [`ResponseFuture`](super::ResponseFuture)),
/// then the [`ResponseBody`] does. Pinned in a box, so that any body will do (as
/// tower-http's `TimeoutBody`): the response future looks at it before moving it into the
/// response.
pub(crate) struct HeldBody<B, H> {
    body: Pin<Box<B>>,
    // What the response future's first look took from the body, handed on first.
    first: Option<Item>,
    state: Holding<H>,
    // Bytes left to the end, when the body said how many it has: read once a frame did
    // not end it (`None` before), then counted down.
    remaining: Option<Option<u64>>,
    // A gRPC response that loses its permit ends with its status in trailers.
    grpc: bool,
}

enum Holding<H> {
    /// The permit is held; `lost` once it was lost and the body streams on unprotected.
    Streaming {
        permit: H,
        lost: bool,
    },
    /// The permit is being released; `item` is handed on once it is.
    Releasing {
        release: Releasing,
        item: Item,
    },
    Done,
}

/// What one poll of a body yields, kept small (it moves with the body): data, trailers
/// (boxed: they are rare), an error, or the end.
pub(crate) enum Item {
    Data(Bytes),
    Trailers(Box<HeaderMap>),
    Error(BoxError),
    End,
}

impl Item {
    pub(crate) fn from_poll<E: Into<BoxError>>(polled: Option<Result<Frame<Bytes>, E>>) -> Self {
        match polled {
            None => Item::End,
            Some(Err(e)) => Item::Error(e.into()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => Item::Data(data),
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => Item::Trailers(Box::new(trailers)),
                    // A kind of frame that http-body 1 does not have.
                    Err(_) => Item::Data(Bytes::new()),
                },
            },
        }
    }

    fn into_poll(self) -> Option<Result<Frame<Bytes>, BoxError>> {
        match self {
            Item::Data(data) => Some(Ok(Frame::data(data))),
            Item::Trailers(trailers) => Some(Ok(Frame::trailers(*trailers))),
            Item::Error(e) => Some(Err(e)),
            Item::End => None,
        }
    }

    /// The data's length.
    fn len(&self) -> u64 {
        match self {
            Item::Data(data) => data.len() as u64,
            _ => 0,
        }
    }
}

impl<B, P: Policy> fmt::Debug for ResponseBody<B, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            BodyKind::Answer { .. } => "Answer",
            BodyKind::Plain { .. } => "Plain",
            BodyKind::Held { .. } => "Held",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

impl<B, P: Policy> ResponseBody<B, P> {
    /// The layer's own answer: `data`, then `trailers` if any.
    pub(crate) fn answer(data: Bytes, trailers: Option<Box<HeaderMap>>) -> Self {
        Self {
            kind: BodyKind::Answer {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    /// The inner body, nothing held.
    pub(crate) fn plain(body: B) -> Self {
        Self {
            kind: BodyKind::Plain { body },
        }
    }

    /// The inner body under its permit.
    pub(crate) fn held(held: HeldBody<B, P::Permit>) -> Self {
        Self {
            kind: BodyKind::Held { held },
        }
    }
}

impl<B: Body<Data = Bytes>, H: Permit> HeldBody<B, H>
where
    B::Error: Into<BoxError>,
{
    /// `body` under `permit` (`lost` already: it streams unprotected). A `grpc` body that
    /// loses its permit ends with the gRPC status `UNAVAILABLE` in trailers, not an error.
    pub(crate) fn new(body: B, permit: H, lost: bool, grpc: bool) -> Self {
        Self {
            remaining: None,
            body: Box::pin(body),
            first: None,
            state: Holding::Streaming { permit, lost },
            grpc,
        }
    }

    /// Hands `item` (taken by [`poll_next`](Self::poll_next)) on first.
    pub(crate) fn put_back(&mut self, item: Item) {
        self.first = Some(item);
    }

    /// Whether the permit is being released (the last frame waits for it).
    pub(crate) fn is_releasing(&self) -> bool {
        matches!(self.state, Holding::Releasing { .. })
    }

    /// The next frame under the permit, the permit released before the last one is handed
    /// on; `Err` with the permit when it was lost and aborts on loss (the work is cut).
    #[inline(always)]
    pub(crate) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<Item, H>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Ok(first));
        }
        let body = &mut self.body;
        loop {
            let (permit, lost) = match &mut self.state {
                Holding::Streaming { permit, lost } => (permit, lost),
                Holding::Releasing { release, item } => {
                    ready!(Pin::new(release).poll(cx));
                    let item = std::mem::replace(item, Item::End);
                    self.state = Holding::Done;
                    return Poll::Ready(Ok(item));
                }
                Holding::Done => return Poll::Ready(Ok(Item::End)),
            };
            let polled = if *lost {
                ready!(body.as_mut().poll_frame(cx))
            } else {
                match ready!(poll_guarded(permit, cx, |cx| body.as_mut().poll_frame(cx))) {
                    Ok(polled) => polled,
                    Err(Lost) if permit.abort_on_loss() => {
                        let Holding::Streaming { permit, .. } =
                            std::mem::replace(&mut self.state, Holding::Done)
                        else {
                            unreachable!("matched as Streaming above")
                        };
                        return Poll::Ready(Err(permit));
                    }
                    Err(Lost) => {
                        tracing::warn!(
                            "the permit was lost; the response body streams on unprotected"
                        );
                        *lost = true;
                        continue;
                    }
                }
            };
            let end = match &polled {
                None => End::Complete,
                Some(Err(_)) => End::Failed,
                Some(Ok(frame)) => {
                    let mut len = 0;
                    if let Some(data) = frame.data_ref() {
                        permit.on_data(data);
                        len = data.len() as u64;
                    } else if let Some(trailers) = frame.trailers_ref() {
                        permit.on_trailers(trailers);
                    }
                    // The last frame: release before the client can see it. Most bodies say
                    // they ended; the size of one that did not is read once, then counted down.
                    let last = match &mut self.remaining {
                        Some(left) => {
                            *left = left.map(|left| left.saturating_sub(len));
                            *left == Some(0) || body.is_end_stream()
                        }
                        None => {
                            body.is_end_stream()
                                || *self.remaining.insert(body.size_hint().exact()) == Some(0)
                        }
                    };
                    if last {
                        End::Complete
                    } else {
                        return Poll::Ready(Ok(Item::from_poll(polled)));
                    }
                }
            };
            let Holding::Streaming { permit, .. } =
                std::mem::replace(&mut self.state, Holding::Done)
            else {
                unreachable!("matched as Streaming above")
            };
            let item = Item::from_poll(polled);
            match permit.release(end) {
                Release::Done => return Poll::Ready(Ok(item)),
                Release::Pending(release) => self.state = Holding::Releasing { release, item },
            }
        }
    }

    /// What a client reads where the body's permit was lost: an error, or for gRPC the
    /// status in trailers.
    fn lost(&self, permit: H) -> Option<Result<Frame<Bytes>, BoxError>> {
        if !self.grpc {
            return Some(Err(permit.lost_error()));
        }
        let answer = permit.lost_response();
        let trailers = answer
            .extensions()
            .get::<Rejection>()
            .map(Rejection::grpc_status)
            .unwrap_or_default();
        Some(Ok(Frame::trailers(trailers)))
    }

    fn is_end_stream(&self) -> bool {
        match &self.first {
            Some(Item::End) => true,
            Some(_) => false,
            None => matches!(self.state, Holding::Done),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let rest = match &self.state {
            Holding::Streaming { .. } => self.body.size_hint(),
            Holding::Releasing { item, .. } => SizeHint::with_exact(item.len()),
            Holding::Done => SizeHint::with_exact(0),
        };
        let Some(first) = self.first.as_ref().map(Item::len).filter(|len| *len > 0) else {
            return rest;
        };
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(first));
        }
        hint.set_lower(rest.lower().saturating_add(first));
        hint
    }
}

impl<B, P> Body for ResponseBody<B, P>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    P: Policy,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> PolledFrame {
        match self.project().kind.project() {
            BodyKindProj::Answer { data, trailers } => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
            BodyKindProj::Plain { body } => body.poll_frame(cx).map_err(Into::into),
            BodyKindProj::Held { held } => Poll::Ready(match ready!(held.poll_next(cx)) {
                Ok(item) => item.into_poll(),
                Err(permit) => held.lost(permit),
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            BodyKind::Answer { data, trailers } => data.is_none() && trailers.is_none(),
            BodyKind::Plain { body } => body.is_end_stream(),
            BodyKind::Held { held } => held.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            BodyKind::Answer { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            BodyKind::Plain { body } => body.size_hint(),
            BodyKind::Held { held } => held.size_hint(),
        }
    }
}

impl<B, P: Policy> From<Bytes> for ResponseBody<B, P> {
    /// A whole body of `data`: how a layer in front of the core (such as the idempotency
    /// layer's body read) answers by itself.
    fn from(data: Bytes) -> Self {
        Self::answer(data, None)
    }
}
