//! Keyed layers over inner services whose response body is not `Unpin`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use tower::{Layer, service_fn};
use tower_redlock::lock::RequestBody;
use tower_redlock::{LockLayer, Locks, MemoryLocks};

/// A response body fed from a channel: the handler's stream, one frame per message.
struct Channel(tokio::sync::mpsc::Receiver<Bytes>);

impl hyper::body::Body for Channel {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|data| data.map(|data| Ok(hyper::body::Frame::data(data))))
    }
}

#[tokio::test]
async fn a_lock_layer_holds_its_lock_over_a_body_that_is_not_unpin() {
    use tower::ServiceExt;
    use tower_http::timeout::ResponseBodyTimeoutLayer;

    // The first request streams from `tx`; later ones answer "again" at once.
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    let first_body = Arc::new(std::sync::Mutex::new(Some(rx)));
    let handler = service_fn(move |_request: Request<RequestBody<Empty<Bytes>>>| {
        let rx = first_body.lock().unwrap().take().unwrap_or_else(|| {
            let (again, rx) = tokio::sync::mpsc::channel(1);
            again.try_send(Bytes::from_static(b"again")).unwrap();
            rx
        });
        async move { Ok::<_, Infallible>(Response::new(Channel(rx))) }
    });
    // The lock layer's inner body is a `TimeoutBody<Channel>`, which is not `Unpin` (it
    // pins its timer).
    let service = LockLayer::by_header("x-order-id")
        .backend(Locks::from(MemoryLocks::new()))
        .layer(ResponseBodyTimeoutLayer::new(Duration::from_secs(30)).layer(handler));
    let request = || {
        Request::builder()
            .uri("/orders")
            .header("x-order-id", "42")
            .body(Empty::<Bytes>::new())
            .unwrap()
    };

    let response = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // Not `Unpin` either: read where it is pinned.
    let mut body = std::pin::pin!(response.into_body());
    tx.send(Bytes::from_static(b"a")).await.unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "a");
    // Held while the body streams: the same order is refused.
    let second = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(second.status(), StatusCode::CONFLICT);
    tx.send(Bytes::from_static(b"b")).await.unwrap();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "b");
    let second = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(second.status(), StatusCode::CONFLICT, "held until the end");
    // The body ends: released before its end is handed on.
    drop(tx);
    assert!(body.frame().await.is_none());
    let third = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK, "released at the body's end");
    let body = third.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "again");
}
