//! The concurrency limit layer on the in-process store, as a tower service: the permit is
//! freed on every path a request can end by.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http_body_util::{BodyExt, Full, StreamBody};
use tokio::sync::Semaphore;
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt, service_fn};

use crate::concurrency::{ConcurrencyLimitLayer, MemoryConcurrencyLimiter};
use crate::key::GlobalKey;

const KEY: &str = "global:all";

type Response = http::Response<Full<Bytes>>;

fn layer(store: &MemoryConcurrencyLimiter, limit: u32) -> ConcurrencyLimitLayer<GlobalKey> {
    ConcurrencyLimitLayer::global(limit).backend(store.clone())
}

fn request() -> http::Request<()> {
    http::Request::builder().uri("/work").body(()).unwrap()
}

/// A handler that answers once `gate` is released.
fn gated(gate: Arc<Semaphore>) -> BoxCloneService<http::Request<()>, Response, Infallible> {
    BoxCloneService::new(service_fn(move |_req: http::Request<()>| {
        let gate = gate.clone();
        async move {
            gate.acquire().await.expect("open").forget();
            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    }))
}

#[tokio::test]
async fn over_the_limit_is_503_with_retry_after_and_a_problem() {
    let store = MemoryConcurrencyLimiter::new();
    let gate = Arc::new(Semaphore::new(0));
    let svc = layer(&store, 1).layer(gated(gate.clone()));
    let first = tokio::spawn(svc.clone().oneshot(request()));
    let held = until(|| store.in_flight(KEY) == 1).await;
    assert!(held, "the first request holds a permit");
    let over = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(over.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(over.headers()[RETRY_AFTER], "1");
    assert_eq!(over.headers()[CONTENT_TYPE], crate::problem::PROBLEM_JSON);
    // Told apart from a lock's 503 by the rejection in the extensions, and the type.
    let rejection = over.extensions().get::<crate::Rejection>().unwrap();
    assert_eq!(rejection.rejected_by(), crate::RejectedBy::ConcurrencyLimit);
    assert_eq!(rejection.kind(), crate::RejectionKind::Limited);
    let body = over.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["status"], 503);
    assert_eq!(problem["type"], "urn:tower-redlock:problem:limited");
    assert_eq!(problem["title"], "Service Unavailable");
    gate.add_permits(1);
    let done = first.await.unwrap().unwrap();
    assert_eq!(done.status(), StatusCode::OK);
    // The body was whole at once: released before the head was handed on.
    assert_eq!(store.in_flight(KEY), 0);
}

#[tokio::test]
async fn a_streamed_body_holds_the_permit_until_it_ends_or_is_dropped() {
    let store = MemoryConcurrencyLimiter::new();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, Infallible>>(1);
    let rx = Arc::new(std::sync::Mutex::new(Some(rx)));
    let svc = layer(&store, 1).layer(service_fn(move |_req: http::Request<()>| {
        let mut rx = rx.lock().unwrap().take().expect("one request");
        let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        async move { Ok::<_, Infallible>(http::Response::new(StreamBody::new(stream))) }
    }));
    let response = svc.oneshot(request()).await.unwrap();
    assert_eq!(store.in_flight(KEY), 1, "held while the body streams");
    let frame = http_body::Frame::data(Bytes::from_static(b"a"));
    tx.send(Ok(frame)).await.unwrap();
    let mut body = response.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "a");
    assert_eq!(store.in_flight(KEY), 1);
    // The client goes away mid-body.
    drop(body);
    assert_eq!(store.in_flight(KEY), 0, "dropping the body releases");
    drop(tx);
}

#[tokio::test]
async fn an_inner_error_and_a_dropped_future_release() {
    let store = MemoryConcurrencyLimiter::new();
    let failing = layer(&store, 1).layer(service_fn(|_req: http::Request<()>| async {
        Err::<http::Response<Full<Bytes>>, _>("boom")
    }));
    assert!(failing.oneshot(request()).await.is_err());
    assert_eq!(store.in_flight(KEY), 0, "released on an inner error");

    let gate = Arc::new(Semaphore::new(0));
    let svc = layer(&store, 1).layer(gated(gate.clone()));
    let pending = tokio::spawn(svc.oneshot(request()));
    assert!(until(|| store.in_flight(KEY) == 1).await);
    // The connection is dropped (or the handler panics): the task ends without an answer.
    pending.abort();
    assert!(pending.await.unwrap_err().is_cancelled());
    let in_flight = store.in_flight(KEY);
    assert_eq!(in_flight, 0, "released when the future is dropped");
}

#[tokio::test]
async fn a_panicking_handler_releases() {
    let store = MemoryConcurrencyLimiter::new();
    let svc = layer(&store, 1).layer(service_fn(|_req: http::Request<()>| async {
        if true {
            panic!("handler panic");
        }
        Ok::<http::Response<Full<Bytes>>, Infallible>(http::Response::new(Full::default()))
    }));
    let task = tokio::spawn(svc.oneshot(request()));
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(store.in_flight(KEY), 0);
}

#[tokio::test]
async fn max_wait_admits_once_a_permit_frees_and_gives_up_at_its_deadline() {
    let store = MemoryConcurrencyLimiter::new();
    let gate = Arc::new(Semaphore::new(0));
    let patient = layer(&store, 1).max_wait(Duration::from_secs(30));
    let svc = patient.layer(gated(gate.clone()));
    let first = tokio::spawn(svc.clone().oneshot(request()));
    assert!(until(|| store.in_flight(KEY) == 1).await);
    let second = tokio::spawn(svc.clone().oneshot(request()));
    tokio::task::yield_now().await;
    assert!(!second.is_finished(), "the second request waits");
    gate.add_permits(2);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(second.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(store.in_flight(KEY), 0);

    // A short wait gives up, with a 503, no earlier than its deadline.
    let wait = Duration::from_millis(120);
    let svc = layer(&store, 1).max_wait(wait).layer(gated(gate.clone()));
    let held = tokio::spawn(svc.clone().oneshot(request()));
    assert!(until(|| store.in_flight(KEY) == 1).await);
    let start = tokio::time::Instant::now();
    let late = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(late.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(start.elapsed() >= wait);
    gate.add_permits(1);
    held.await.unwrap().unwrap();
}

/// Waits (bounded) until `check` holds.
async fn until(mut check: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    check()
}
