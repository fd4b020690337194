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
use tower_redlock::{LockLayer, Locks, MemoryLocks};

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
    assert_eq!(problem["type"], "urn:tower-redlock:problem:taken");
    assert_eq!(problem["title"], "Conflict");
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
