//! The layers in front of a tonic gRPC server, called with tonic's own client: every
//! refusal reaches the client as a gRPC status (the table in `tower_redlock::rejection`),
//! with the retry pushback where HTTP sends `Retry-After`; streaming calls keep their lease
//! until the stream ends; idempotent unary calls are replayed with their trailers. The
//! service is tonic-health's prebuilt `grpc.health.v1.Health` (unary `Check`,
//! server-streaming `Watch`), so no `.proto` is compiled.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use support::{RedisNode, eventually, nodes, urls};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::HealthReporter;
use tower_redlock::{
    ConcurrencyLimitLayer, ConcurrencyLimiter, IdempotencyLayer, LockLayer, Locks,
    MemoryConcurrencyLimiter, MemoryLocks, MemoryRateLimiter, Quota, RateLimitLayer, RateLimiter,
    RedisConcurrencyLimiter, RedisRateLimiter, Redlock,
};

/// Serves tonic-health behind `$layer` on a free port; the health reporter says the
/// service `""` is serving.
macro_rules! serve {
    ($layer:expr) => {{
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Server::builder().layer($layer).add_service(service);
        tokio::spawn(router.serve_with_incoming(TcpListenerStream::new(listener)));
        Served { addr, reporter }
    }};
}

struct Served {
    addr: SocketAddr,
    /// Kept so that the watch streams stay open.
    #[allow(dead_code)]
    reporter: HealthReporter,
}

impl Served {
    async fn client(&self) -> HealthClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        HealthClient::new(channel)
    }
}

/// A request for `service`'s health with the metadata `pairs`.
fn request(service: &str, pairs: &[(&'static str, &str)]) -> tonic::Request<HealthCheckRequest> {
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: service.to_owned(),
    });
    for (name, value) in pairs {
        request.metadata_mut().insert(*name, value.parse().unwrap());
    }
    request
}

async fn check(
    client: &mut HealthClient<Channel>,
    pairs: &[(&'static str, &str)],
) -> Result<tonic::Response<HealthCheckResponse>, Status> {
    client.check(request("", pairs)).await
}

/// The refusal's code, and its retry pushback in ms if it has one.
fn refusal(result: Result<tonic::Response<HealthCheckResponse>, Status>) -> (Code, Option<u64>) {
    let status = result.expect_err("refused");
    let pushback = status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    (status.code(), pushback)
}

/// Opens a `Watch` stream with the metadata `pairs` and reads its first message: the call
/// is admitted and its response streams on while the returned stream lives.
async fn watching(
    client: &mut HealthClient<Channel>,
    pairs: &[(&'static str, &str)],
) -> tonic::Streaming<HealthCheckResponse> {
    let mut stream = client
        .watch(request("", pairs))
        .await
        .expect("the watch is admitted")
        .into_inner();
    let first = stream.message().await.unwrap().expect("a first status");
    assert_eq!(first.status, 1, "SERVING");
    stream
}

/// Every refusal of a lock layer, and a streaming call's lease, on `locks`.
async fn lock_answers(locks: Locks) {
    let served = serve!(LockLayer::by_header("x-order-id").backend(locks));
    let mut client = served.client().await;
    let key = [("x-order-id", "42")];
    assert!(check(&mut client, &key).await.is_ok(), "a unary call runs");
    // A server-streaming call holds the lock until its stream ends.
    let stream = watching(&mut client, &key).await;
    let (code, pushback) = refusal(check(&mut client, &key).await);
    assert_eq!(code, Code::Aborted);
    assert!(pushback.is_some_and(|ms| ms > 0), "{pushback:?}");
    assert!(check(&mut client, &[("x-order-id", "43")]).await.is_ok());
    drop(stream);
    assert!(
        eventually(Duration::from_secs(5), || {
            let mut client = client.clone();
            async move { check(&mut client, &key).await.is_ok() }
        })
        .await,
        "the lock is released when the stream ends"
    );
    // The key missing, or unusable.
    assert_eq!(
        refusal(check(&mut client, &[]).await).0,
        Code::InvalidArgument
    );
    let long = "k".repeat(300);
    assert_eq!(
        refusal(check(&mut client, &[("x-order-id", &long)]).await).0,
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn lock_refusals_are_grpc_statuses_in_process() {
    lock_answers(Locks::from(MemoryLocks::new())).await;
}

#[tokio::test]
async fn lock_refusals_are_grpc_statuses_on_redis() {
    let nodes = nodes(3);
    let redlock = Redlock::builder(urls(&nodes)).build().await.unwrap();
    lock_answers(Locks::from(redlock)).await;
}

#[tokio::test]
async fn no_quorum_is_unavailable_with_a_pushback() {
    let mut node = RedisNode::start();
    let redlock = Redlock::builder([node.url()])
        .node_timeout(Duration::from_millis(200))
        .retry_count(0)
        .build()
        .await
        .unwrap();
    let served = serve!(LockLayer::by_header("x-order-id").backend(redlock));
    let mut client = served.client().await;
    let key = [("x-order-id", "42")];
    assert!(check(&mut client, &key).await.is_ok());
    node.kill();
    let (code, pushback) = refusal(check(&mut client, &key).await);
    assert_eq!(code, Code::Unavailable);
    assert_eq!(pushback, Some(1000));
}

#[tokio::test]
async fn a_misconfigured_layer_is_internal() {
    // A path parameter outside an axum Router: there is none to lock on, a server mistake.
    let served = serve!(LockLayer::by_path_param("order_id").backend(MemoryLocks::new()));
    let mut client = served.client().await;
    let (code, _) = refusal(check(&mut client, &[("x-order-id", "42")]).await);
    assert_eq!(code, Code::Internal);
}

async fn rate_limit_answers(limiter: RateLimiter) {
    let quota = Quota::new(1, Duration::from_secs(60)).unwrap();
    let served = serve!(RateLimitLayer::by_header("x-tenant", quota).backend(limiter));
    let mut client = served.client().await;
    let tenant = [("x-tenant", "acme")];
    assert!(check(&mut client, &tenant).await.is_ok());
    let (code, pushback) = refusal(check(&mut client, &tenant).await);
    assert_eq!(code, Code::ResourceExhausted);
    assert!(
        pushback.is_some_and(|ms| ms > 0 && ms <= 60_000),
        "{pushback:?}"
    );
}

#[tokio::test]
async fn a_rate_limit_is_resource_exhausted_with_a_pushback_in_process() {
    rate_limit_answers(RateLimiter::from(MemoryRateLimiter::new())).await;
}

#[tokio::test]
async fn a_rate_limit_is_resource_exhausted_with_a_pushback_on_redis() {
    let node = RedisNode::start();
    let limiter = RedisRateLimiter::builder(node.url()).build().await.unwrap();
    rate_limit_answers(RateLimiter::from(limiter)).await;
}

async fn concurrency_answers(limiter: ConcurrencyLimiter) {
    let served = serve!(ConcurrencyLimitLayer::by_header("x-tenant", 1).backend(limiter));
    let mut client = served.client().await;
    let tenant = [("x-tenant", "acme")];
    let stream = watching(&mut client, &tenant).await;
    let (code, pushback) = refusal(check(&mut client, &tenant).await);
    assert_eq!(code, Code::ResourceExhausted);
    assert!(pushback.is_some());
    drop(stream);
    assert!(
        eventually(Duration::from_secs(5), || {
            let mut client = client.clone();
            async move { check(&mut client, &tenant).await.is_ok() }
        })
        .await,
        "the permit is released when the stream ends"
    );
}

#[tokio::test]
async fn a_concurrency_limit_is_resource_exhausted_while_a_stream_runs_in_process() {
    concurrency_answers(ConcurrencyLimiter::from(MemoryConcurrencyLimiter::new())).await;
}

#[tokio::test]
async fn a_concurrency_limit_is_resource_exhausted_while_a_stream_runs_on_redis() {
    let node = RedisNode::start();
    let limiter = RedisConcurrencyLimiter::builder(node.url())
        .build()
        .await
        .unwrap();
    concurrency_answers(ConcurrencyLimiter::from(limiter)).await;
}

/// A unary call retried with its `idempotency-key` gets the first response back, message
/// and trailers; a non-OK status is stored by the HTTP rule (NOT_FOUND, 404: stored); the
/// key with another message is INVALID_ARGUMENT.
async fn idempotent_answers(locks: Locks) {
    let served = serve!(IdempotencyLayer::new().backend(locks));
    let mut client = served.client().await;
    let first = client
        .check(request("", &[("idempotency-key", "k1")]))
        .await
        .unwrap();
    assert!(first.metadata().get("idempotent-replayed").is_none());
    // The service stops serving: a call that ran again would say so.
    served
        .reporter
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    let replayed = client
        .check(request("", &[("idempotency-key", "k1")]))
        .await
        .unwrap();
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(replayed.get_ref(), first.get_ref(), "the first message");
    assert_eq!(
        replayed.get_ref().status,
        1,
        "SERVING, as the first call saw"
    );

    let unknown = [("idempotency-key", "k2")];
    let status = client.check(request("nope", &unknown)).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    served
        .reporter
        .set_service_status("nope", tonic_health::ServingStatus::Serving)
        .await;
    let again = client.check(request("nope", &unknown)).await.unwrap_err();
    assert_eq!(again.code(), Code::NotFound, "replayed, not run again");
    assert_eq!(again.message(), status.message());

    let (code, _) = refusal(
        client
            .check(request("other", &[("idempotency-key", "k1")]))
            .await,
    );
    assert_eq!(
        code,
        Code::InvalidArgument,
        "the key reused with another message"
    );
    let (code, _) = refusal(client.check(request("", &[])).await);
    assert_eq!(code, Code::InvalidArgument, "no key");
}

#[tokio::test]
async fn idempotent_unary_calls_are_replayed_with_their_trailers_in_process() {
    idempotent_answers(Locks::from(MemoryLocks::new())).await;
}

#[tokio::test]
async fn idempotent_unary_calls_are_replayed_with_their_trailers_on_redis() {
    let nodes = nodes(3);
    let redlock = Redlock::builder(urls(&nodes)).build().await.unwrap();
    idempotent_answers(Locks::from(redlock)).await;
}

#[tokio::test]
async fn an_idempotent_call_in_flight_is_aborted() {
    let served = serve!(IdempotencyLayer::new().backend(MemoryLocks::new()));
    let mut client = served.client().await;
    // A watch never ends by itself: its request stays in flight while the stream lives.
    let key = [("idempotency-key", "k1")];
    let _stream = watching(&mut client, &key).await;
    let (code, pushback) = refusal(
        client
            .watch(request("", &key))
            .await
            .map(|_| tonic::Response::new(HealthCheckResponse { status: 0 })),
    );
    assert_eq!(code, Code::Aborted);
    assert!(pushback.is_some());
}

#[tokio::test]
async fn a_stream_whose_lease_is_lost_ends_with_unavailable_in_its_trailers() {
    let node = RedisNode::start();
    let redlock = Redlock::builder([node.url()])
        .ttl(Duration::from_millis(1_500))
        .build()
        .await
        .unwrap();
    let served = serve!(LockLayer::by_header("x-order-id").backend(redlock));
    let mut client = served.client().await;
    let mut stream = watching(&mut client, &[("x-order-id", "42")]).await;
    // Another holder takes the key behind the lease's back: its next renewal (a third of
    // the TTL) finds it gone, and the stream is stopped.
    let mut conn = node.conn().await;
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("tower-redlock:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    // The lock key, not the keys beside it (`<prefix>{<lock key>}:holder`).
    keys.retain(|key| !key.contains('{'));
    assert_eq!(keys.len(), 1, "{keys:?}");
    let _: () = redis::cmd("SET")
        .arg(&keys[0])
        .arg("another-holder")
        .arg("PX")
        .arg(30_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("the stream ends within the lease's TTL");
    let status = ended.expect_err("the stream ends with a status, not a message");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("lock was lost"), "{status:?}");
}
