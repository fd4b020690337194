//! The layers in front of a tonic gRPC server, and what a gRPC client sees when they refuse.
//!
//! ```sh
//! cargo run -p extras --example grpc
//! ```
//!
//! The server is tonic-health's `grpc.health.v1.Health` service (unary `Check`,
//! server-streaming `Watch`) behind a rate limit per `x-tenant` and a lock per
//! `x-order-id`, both in process. The example then calls it with tonic's client: a watch
//! stream holds order 42's lock while it is open, so a `Check` on order 42 is refused
//! with `ABORTED` and a retry pushback; once a tenant has made 5 calls within 10 s, its
//! next ones are refused with `RESOURCE_EXHAUSTED`. Every refusal is a gRPC status (see
//! `tower_redlock::rejection`), never an HTTP error body a gRPC client cannot read.

// An example keeps to its point: it stops on a failed setup or a poisoned lock.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::time::Duration;

use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Channel, Server};
use tonic_health::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower::ServiceBuilder;
use tower_redlock::{LockLayer, Quota, RateLimitLayer};

/// A `Check` request carrying the tenant and the order as metadata.
fn check(tenant: &str, order: &str) -> tonic::Request<HealthCheckRequest> {
    let mut request = tonic::Request::new(HealthCheckRequest::default());
    let metadata = request.metadata_mut();
    metadata.insert("x-tenant", tenant.parse().expect("ASCII"));
    metadata.insert("x-order-id", order.parse().expect("ASCII"));
    request
}

/// One line per call: the answer, or the gRPC status with its retry pushback.
fn show<T: std::fmt::Debug>(what: &str, result: Result<tonic::Response<T>, tonic::Status>) {
    match result {
        Ok(response) => println!("{what}: OK {:?}", response.get_ref()),
        Err(status) => {
            let pushback = status
                .metadata()
                .get("grpc-retry-pushback-ms")
                .and_then(|v| v.to_str().ok())
                .map(|ms| format!(", retry in {ms} ms"))
                .unwrap_or_default();
            println!(
                "{what}: {:?} \"{}\"{pushback}",
                status.code(),
                status.message()
            );
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;

    let five_per_10s = Quota::new(5, Duration::from_secs(10))?;
    let layers = ServiceBuilder::new()
        .layer(RateLimitLayer::by_header("x-tenant", five_per_10s))
        .layer(LockLayer::by_header("x-order-id"))
        .into_inner();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        Server::builder()
            .layer(layers)
            .add_service(health)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    println!("gRPC server on {addr}");

    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = HealthClient::new(channel);

    // A watch on order 42 holds its lock for as long as the stream is open.
    let mut watch = client.watch(check("acme", "42")).await?.into_inner();
    let first = watch.message().await?;
    println!("watch order 42: streaming, first message {first:?}");
    show(
        "check order 42 while it is watched",
        client.check(check("acme", "42")).await,
    );
    show("check order 43", client.check(check("acme", "43")).await);
    drop(watch);
    // The lock goes with the stream, released as the stream closes: a client that
    // honours the pushback gets through.
    let mut after = client.check(check("acme", "42")).await;
    while let Err(status) = &after {
        let pushback = status.metadata().get("grpc-retry-pushback-ms");
        let Some(ms) = pushback.and_then(|v| v.to_str().ok()?.parse().ok()) else {
            break;
        };
        tokio::time::sleep(Duration::from_millis(ms)).await;
        after = client.check(check("acme", "42")).await;
    }
    show("check order 42 after the watch", after);

    // Tenant acme has made 4 calls, or more with retries: the limit of 5 per 10 s is
    // reached by the first of these two at the latest.
    for call in ["5th or later", "6th or later"] {
        show(
            &format!("{call} call of tenant acme, on order 44"),
            client.check(check("acme", "44")).await,
        );
    }
    show(
        "first call of tenant globex",
        client.check(check("globex", "44")).await,
    );
    Ok(())
}
