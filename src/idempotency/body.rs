//! The response body of [`Idempotency`](super::Idempotency): a stored or collected body in
//! one piece, or the frames already read followed by the rest of the inner body.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The response body of [`Idempotency`](super::Idempotency).
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Full { data: Option<Bytes> },
        Prefixed { frames: VecDeque<Frame<Bytes>>, #[pin] rest: B },
    }
}

impl<B> ResponseBody<B> {
    /// A body of `data` in one frame.
    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// `frames`, already read from `rest`, then what `rest` still holds.
    pub(crate) fn prefixed(frames: VecDeque<Frame<Bytes>>, rest: B) -> Self {
        Self {
            kind: Kind::Prefixed { frames, rest },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Prefixed { frames, rest } => match frames.pop_front() {
                Some(frame) => Poll::Ready(Some(Ok(frame))),
                None => rest.poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Prefixed { frames, rest } => frames.is_empty() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            Kind::Prefixed { frames, rest } => {
                let read: u64 = frames
                    .iter()
                    .filter_map(Frame::data_ref)
                    .map(|d| d.len() as u64)
                    .sum();
                let mut hint = SizeHint::new();
                let inner = rest.size_hint();
                hint.set_lower(inner.lower().saturating_add(read));
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper.saturating_add(read));
                }
                hint
            }
        }
    }
}
