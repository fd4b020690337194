use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::policy::{BoxError, End, Permit, Policy, Release, Releasing};
use crate::future::PolledFrame;
use crate::protect::{Lost, poll_guarded};
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
        // What the response future already took from the body, handed on first.
        first: Option<Item>,
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
        // Pinned in a box: the response future looked at its first frame before handing it on.
        Held {
            body: Pin<Box<B>>,
            state: Holding<H>,
            // Bytes left to the end, when the body said how many it has.
            remaining: Option<u64>,
        },
    }
}

enum Holding<H> {
    /// The permit is held; `lost` once it was lost and the body streams on unprotected.
    /// A gRPC response that loses its permit ends with its status in trailers.
    Streaming {
        permit: H,
        lost: bool,
        grpc: bool,
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
        f.debug_struct("ResponseBody")
            .field("kind", &kind)
            .field("first", &self.first.is_some())
            .finish()
    }
}

impl<B, P: Policy> ResponseBody<B, P> {
    /// The layer's own answer: `data`, then `trailers` if any.
    pub(crate) fn answer(data: Bytes, trailers: Option<Box<HeaderMap>>) -> Self {
        Self {
            first: None,
            kind: BodyKind::Answer {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    /// The inner body, nothing held.
    pub(crate) fn plain(body: B) -> Self {
        Self {
            first: None,
            kind: BodyKind::Plain { body },
        }
    }

    /// The inner body, whose permit was released after `first` (taken from it already,
    /// its last frame) was read: `first` is handed on, then the body's end.
    pub(crate) fn released(body: Pin<Box<B>>, first: Option<Item>) -> Self {
        Self {
            first,
            kind: BodyKind::Held {
                body,
                state: Holding::Done,
                remaining: None,
            },
        }
    }

    /// The inner body, holding `permit` until it ends; `first` (taken from it already, not
    /// its last frame) is handed on first. A `grpc` body that loses its permit ends with
    /// the gRPC status `UNAVAILABLE` in trailers, not an error.
    pub(crate) fn held(
        body: Pin<Box<B>>,
        permit: P::Permit,
        lost: bool,
        grpc: bool,
        first: Option<Item>,
    ) -> Self
    where
        B: Body,
    {
        let remaining = body.size_hint().exact();
        Self {
            first,
            kind: BodyKind::Held {
                body,
                state: Holding::Streaming { permit, lost, grpc },
                remaining,
            },
        }
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
        let this = self.project();
        if let Some(first) = this.first.take() {
            return Poll::Ready(first.into_poll());
        }
        match this.kind.project() {
            BodyKindProj::Answer { data, trailers } => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
            BodyKindProj::Plain { body } => body.poll_frame(cx).map_err(Into::into),
            BodyKindProj::Held {
                body,
                state,
                remaining,
            } => poll_held(body.as_mut(), state, remaining, cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.first {
            Some(Item::End) => return true,
            Some(_) => return false,
            None => {}
        }
        match &self.kind {
            BodyKind::Answer { data, trailers } => data.is_none() && trailers.is_none(),
            BodyKind::Plain { body } => body.is_end_stream(),
            BodyKind::Held { state, .. } => matches!(state, Holding::Done),
        }
    }

    fn size_hint(&self) -> SizeHint {
        let inner = match &self.kind {
            BodyKind::Answer { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            BodyKind::Plain { body } => body.size_hint(),
            BodyKind::Held { body, state, .. } => match state {
                Holding::Streaming { .. } => body.size_hint(),
                Holding::Releasing { item, .. } => SizeHint::with_exact(item.len()),
                Holding::Done => SizeHint::with_exact(0),
            },
        };
        let Some(first) = self.first.as_ref().map(Item::len).filter(|len| *len > 0) else {
            return inner;
        };
        let mut hint = SizeHint::new();
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(first));
        }
        hint.set_lower(inner.lower().saturating_add(first));
        hint
    }
}

/// One step of a held body: the next frame under the permit, and the release before the
/// last one is handed on.
fn poll_held<B, H>(
    mut body: Pin<&mut B>,
    state: &mut Holding<H>,
    remaining: &mut Option<u64>,
    cx: &mut Context<'_>,
) -> PolledFrame
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
    H: Permit,
{
    loop {
        let (permit, lost, grpc) = match state {
            Holding::Streaming { permit, lost, grpc } => (permit, lost, *grpc),
            Holding::Releasing { release, item } => {
                ready!(Pin::new(release).poll(cx));
                let item = std::mem::replace(item, Item::End);
                *state = Holding::Done;
                return Poll::Ready(item.into_poll());
            }
            Holding::Done => return Poll::Ready(None),
        };
        let polled = if *lost {
            ready!(body.as_mut().poll_frame(cx))
        } else {
            match ready!(poll_guarded(permit, cx, |cx| body.as_mut().poll_frame(cx))) {
                Ok(polled) => polled,
                Err(Lost) => {
                    if permit.abort_on_loss() {
                        let Holding::Streaming { permit, .. } =
                            std::mem::replace(state, Holding::Done)
                        else {
                            unreachable!("matched as Streaming above")
                        };
                        if !grpc {
                            return Poll::Ready(Some(Err(permit.lost_error())));
                        }
                        // The status a gRPC client reads, where HTTP gets an error.
                        let answer = permit.lost_response();
                        let trailers = answer
                            .extensions()
                            .get::<Rejection>()
                            .map(Rejection::grpc_status)
                            .unwrap_or_default();
                        return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                    }
                    tracing::warn!("the permit was lost; the response body streams on unprotected");
                    *lost = true;
                    continue;
                }
            }
        };
        let end = match &polled {
            None => End::Complete,
            Some(Err(_)) => End::Failed,
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    permit.on_data(data);
                    if let Some(left) = remaining.as_mut() {
                        *left = left.saturating_sub(data.len() as u64);
                    }
                } else if let Some(trailers) = frame.trailers_ref() {
                    permit.on_trailers(trailers);
                }
                // The last frame: release before the client can see it.
                if body.is_end_stream() || *remaining == Some(0) {
                    End::Complete
                } else {
                    return Poll::Ready(polled.map(|r| r.map_err(Into::into)));
                }
            }
        };
        let Holding::Streaming { permit, .. } = std::mem::replace(state, Holding::Done) else {
            unreachable!("matched as Streaming above")
        };
        match permit.release(end) {
            Release::Done => return Poll::Ready(polled.map(|r| r.map_err(Into::into))),
            Release::Pending(release) => {
                *state = Holding::Releasing {
                    release,
                    item: Item::from_poll(polled),
                }
            }
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
