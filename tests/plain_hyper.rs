//! `LockLayer` around a plain tower service served by hyper, in a build without axum:
//! `scripts/test` runs this file with `--no-default-features --features lock` and checks
//! that axum is not in that build's dependency tree.

// A test stops on what it did not expect: its unwraps, indexes and panics are assertions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]
#![cfg(feature = "lock")]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tower::{Layer, service_fn};
use tower_redlock::lock::RequestBody;
use tower_redlock::{LockLayer, Locks, MemoryLocks, RejectionKind};

/// Serves `LockLayer::by_header("x-order-id")` around a handler that waits for `release`
/// (telling `entered`) before it answers. The handler gets the request body the layer
/// read before it took the lock, as a `RequestBody` over hyper's.
async fn serve(entered: Arc<Semaphore>, release: Arc<Notify>) -> SocketAddr {
    let handler = service_fn(move |_request: Request<RequestBody<Incoming>>| {
        let (entered, release) = (entered.clone(), release.clone());
        async move {
            entered.add_permits(1);
            release.notified().await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    });
    let service = LockLayer::by_header("x-order-id")
        .backend(Locks::from(MemoryLocks::new()))
        .layer(handler);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    addr
}

async fn send(addr: SocketAddr, order: &str) -> Response<Incoming> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::builder()
        .uri("/orders")
        .header("x-order-id", order)
        .body(Empty::<Bytes>::new())
        .unwrap();
    sender.send_request(request).await.unwrap()
}

#[tokio::test]
async fn a_lock_layer_guards_a_plain_hyper_service() {
    let (entered, release) = (Arc::new(Semaphore::new(0)), Arc::new(Notify::new()));
    let addr = serve(entered.clone(), release.clone()).await;
    let first = tokio::spawn(send(addr, "42"));
    entered.acquire().await.unwrap().forget();
    // The same order while the first runs: refused by the layer, never run.
    let second = send(addr, "42").await;
    assert_eq!(second.status(), StatusCode::CONFLICT);
    assert_eq!(second.headers()["content-type"], "application/problem+json");
    assert!(second.headers().contains_key("retry-after"));
    let body = second.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], RejectionKind::Taken.type_uri());
    release.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "done");
    // Released with the response: the next request on the key runs.
    let third = tokio::spawn(send(addr, "42"));
    entered.acquire().await.unwrap().forget();
    release.notify_one();
    assert_eq!(third.await.unwrap().status(), StatusCode::OK);
}

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
