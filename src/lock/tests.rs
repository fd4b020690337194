//! LockLayer on the in-process backend, as a tower service.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use tokio::sync::{Notify, Semaphore};
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt, service_fn};

use crate::{
    Lease, LeaseStatus, LockLayer, Locks, MemoryLocks, RejectedBy, Rejection, RejectionKind,
};
use http_body::Body as _;

/// The request body the service inside the layer gets.
type Inner = crate::lock::RequestBody<Empty<Bytes>>;

/// A handler that holds its request until `release` is notified, telling `entered`.
#[derive(Clone)]
struct Gate {
    entered: Arc<Semaphore>,
    release: Arc<Notify>,
}

impl Gate {
    fn new() -> Self {
        Self {
            entered: Arc::new(Semaphore::new(0)),
            release: Arc::new(Notify::new()),
        }
    }

    fn service(&self) -> BoxCloneService<Request<Inner>, Response<Full<Bytes>>, Infallible> {
        let gate = self.clone();
        BoxCloneService::new(service_fn(move |req: Request<Inner>| {
            let gate = gate.clone();
            async move {
                let status = req.extensions().get::<LeaseStatus>();
                let lease = status.map(|s| s.lease().key().to_owned());
                gate.entered.add_permits(1);
                gate.release.notified().await;
                Ok(Response::new(Full::new(Bytes::from(
                    lease.unwrap_or_default(),
                ))))
            }
        }))
    }

    async fn wait_entered(&self) {
        let entered = tokio::time::timeout(Duration::from_secs(5), self.entered.acquire()).await;
        entered.expect("the handler was entered").unwrap().forget();
    }
}

fn with_header(name: &str, value: &str) -> Request<Empty<Bytes>> {
    Request::builder()
        .header(name, value)
        .body(Empty::new())
        .unwrap()
}

fn keyed(key: &str) -> Request<Empty<Bytes>> {
    with_header("job", key)
}

/// Reads the key from the `job` header.
type JobFn = fn(&http::request::Parts) -> Option<String>;

fn by_job() -> LockLayer<crate::key::FnKey<JobFn>> {
    fn job(parts: &http::request::Parts) -> Option<String> {
        parts.headers.get("job")?.to_str().ok().map(str::to_owned)
    }
    LockLayer::by_fn(job as JobFn)
}

#[tokio::test]
async fn taken_status_is_what_contention_answers() {
    let locks = Locks::from(MemoryLocks::new());
    let gate = Gate::new();
    let layer = by_job()
        .backend(locks)
        .taken_status(StatusCode::TOO_MANY_REQUESTS);
    let svc = layer.layer(gate.service());
    let first = tokio::spawn(svc.clone().oneshot(keyed("a")));
    gate.wait_entered().await;
    let second = svc.clone().oneshot(keyed("a")).await.unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(second.headers().contains_key(http::header::RETRY_AFTER));
    let rejection = second.extensions().get::<Rejection>().unwrap();
    assert_eq!(rejection.rejected_by(), RejectedBy::Lock);
    assert_eq!(rejection.kind(), RejectionKind::Taken);
    gate.release.notify_one();
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
}

#[tokio::test]
async fn on_rejection_shapes_http_refusals_and_grpc_keeps_its_answer() {
    let locks = Locks::from(MemoryLocks::new());
    let gate = Gate::new();
    let layer = by_job().backend(locks).on_rejection(|rejection| {
        let mut response = Response::new(Bytes::from(format!("{:?}", rejection.kind())));
        *response.status_mut() = StatusCode::IM_A_TEAPOT;
        response
    });
    let svc = layer.layer(gate.service());
    let first = tokio::spawn(svc.clone().oneshot(keyed("a")));
    gate.wait_entered().await;
    // HTTP: the application's own answer, with the rejection still in the extensions.
    let http = svc.clone().oneshot(keyed("a")).await.unwrap();
    assert_eq!(http.status(), StatusCode::IM_A_TEAPOT);
    let kind = http.extensions().get::<Rejection>().unwrap().kind();
    assert_eq!(kind, RejectionKind::Taken);
    let body = http.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "Taken");
    // gRPC: the gRPC answer, which a gRPC client can read, hook or not.
    let grpc = Request::builder()
        .header("job", "a")
        .header("content-type", "application/grpc");
    let grpc = svc
        .clone()
        .oneshot(grpc.body(Empty::new()).unwrap())
        .await
        .unwrap();
    assert_eq!(grpc.status(), StatusCode::OK);
    assert_eq!(grpc.headers()["grpc-status"], "10");
    assert!(grpc.headers().contains_key("grpc-retry-pushback-ms"));
    assert!(grpc.body().is_end_stream(), "a trailers-only answer");
    // A missing key too: the hook sees every refusal of the layer.
    let missing = svc
        .clone()
        .oneshot(Request::new(Empty::new()))
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::IM_A_TEAPOT);
    let body = missing.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "MissingKey");
    gate.release.notify_one();
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
}

#[tokio::test]
async fn max_wait_waits_for_the_holder_on_the_in_process_backend() {
    let locks = Locks::from(MemoryLocks::new());
    let gate = Gate::new();
    let waiting = by_job()
        .backend(locks.clone())
        .max_wait(Duration::from_secs(5))
        .layer(gate.service());
    let holder = tokio::spawn(waiting.clone().oneshot(keyed("w")));
    gate.wait_entered().await;
    let waiter = tokio::spawn(waiting.clone().oneshot(keyed("w")));
    // The waiter is not let in while the holder runs.
    let entered = tokio::time::timeout(Duration::from_millis(100), gate.wait_entered()).await;
    assert!(entered.is_err());
    let released = Instant::now();
    gate.release.notify_one();
    assert_eq!(holder.await.unwrap().unwrap().status(), StatusCode::OK);
    gate.wait_entered().await;
    assert!(
        released.elapsed() < Duration::from_secs(1),
        "woken by the release, not by a timer"
    );
    gate.release.notify_one();
    assert_eq!(waiter.await.unwrap().unwrap().status(), StatusCode::OK);

    // A wait that runs out answers as contention does.
    let short = by_job()
        .backend(locks)
        .max_wait(Duration::from_millis(50))
        .layer(gate.service());
    let holder = tokio::spawn(short.clone().oneshot(keyed("s")));
    gate.wait_entered().await;
    let start = Instant::now();
    let late = short.clone().oneshot(keyed("s")).await.unwrap();
    assert_eq!(late.status(), StatusCode::LOCKED);
    assert!(start.elapsed() >= Duration::from_millis(50));
    gate.release.notify_one();
    holder.await.unwrap().unwrap();
}

#[test]
#[should_panic(expected = "LockLayer::by_header(\"Idempotency Key\"): not a header name")]
fn a_bad_header_name_stops_the_app_as_the_layer_is_built() {
    let _ = LockLayer::by_header("Idempotency Key");
}

#[test]
#[should_panic(expected = "LockLayer::fencing_header(\"Fencing Token\"): not a header name")]
fn a_bad_fencing_header_name_stops_the_app_as_the_layer_is_built() {
    let _ = LockLayer::by_header("Idempotency-Key").fencing_header("Fencing Token");
}

#[tokio::test]
async fn header_names_are_case_insensitive_and_may_be_typed() {
    let locks = Locks::from(MemoryLocks::new());
    for layer in [
        LockLayer::by_header("IDEMPOTENCY-KEY"),
        LockLayer::by_header(http::HeaderName::from_static("idempotency-key")),
    ] {
        let svc =
            layer
                .backend(locks.clone())
                .layer(service_fn(|req: Request<Inner>| async move {
                    let status = req.extensions().get::<LeaseStatus>().unwrap();
                    let key = Bytes::from(status.lease().key().to_owned());
                    Ok::<_, Infallible>(Response::new(Full::new(key)))
                }));
        let response = svc
            .oneshot(with_header("Idempotency-Key", "k"))
            .await
            .unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "tower-redlock:idempotency-key GET:k");
    }
}

#[tokio::test]
async fn the_handler_gets_one_status_that_carries_the_lease() {
    let locks = Locks::from(MemoryLocks::builder().fencing_tokens(true).build().unwrap());
    let svc = by_job()
        .backend(locks)
        .layer(service_fn(|req: Request<Inner>| async move {
            let status = req.extensions().get::<LeaseStatus>().cloned().unwrap();
            let lease = req.extensions().get::<Lease>();
            assert!(lease.is_none(), "one extension only");
            assert!(!status.is_lost());
            assert_eq!(status.lease().key(), "tower-redlock::j");
            assert!(status.lease().fencing_token().is_some());
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }));
    let response = svc.oneshot(keyed("j")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[test]
fn the_default_once_used_cannot_be_replaced() {
    // Any use fixes the default (here, in process): a later choice would leave the
    // layers built before it locking per process.
    assert!(Locks::default().is_in_process());
    assert!(matches!(
        Locks::set_default(MemoryLocks::new()),
        Err(crate::ConfigError::DefaultAlreadyChosen { handle: "Locks" })
    ));
}

#[cfg(feature = "axum")]
#[test]
fn names_compares_the_escaped_key() {
    let memory = MemoryLocks::new();
    let locks = Locks::from(memory.clone());
    let lease = memory.try_lock("order:{7}").unwrap();
    assert!(locks.names(&lease, "order:{7}"));
    assert!(!locks.names(&lease, "order:7"));
    let other = Locks::from(MemoryLocks::new());
    assert!(!other.names(&lease, "order:{7}"), "another backend's lease");
}
