//! The rate limit layer on the in-process store, as a tower service.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::StatusCode;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http_body_util::{BodyExt, Full};
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt, service_fn};

use super::policy::{RATELIMIT, RATELIMIT_POLICY};
use crate::key::HeaderKey;
use crate::rate_limit::{MemoryRateLimiter, Quota, RateLimitLayer, Usage};

type Body = Bytes;
type Svc = BoxCloneService<http::Request<()>, http::Response<Body>, Infallible>;

/// The layer around a handler that answers with the count it saw; the response body is
/// collected, so that tests read it as bytes.
fn svc<K: crate::key::KeyExtractor>(layer: RateLimitLayer<K>) -> Svc {
    let layered = ServiceBuilder::new().layer(layer).service(service_fn(
        |req: http::Request<()>| async move {
            let usage = req.extensions().get::<Usage>();
            let seen = usage.map_or_else(|| "uncounted".into(), |u| u.count().to_string());
            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(seen))))
        },
    ));
    BoxCloneService::new(service_fn(move |req| {
        let layered = layered.clone();
        async move {
            let (head, body) = layered.oneshot(req).await?.into_parts();
            let body = body.collect().await.expect("a body").to_bytes();
            Ok::<_, Infallible>(http::Response::from_parts(head, body))
        }
    }))
}

fn request(client: Option<&str>) -> http::Request<()> {
    let mut builder = http::Request::builder().uri("/items/1/buy");
    if let Some(client) = client {
        builder = builder.header("x-client-id", client);
    }
    let peer = SocketAddr::from(([203, 0, 113, 7], 5555));
    builder
        .extension(axum::extract::ConnectInfo(peer))
        .body(())
        .unwrap()
}

fn quota(text: &str) -> Quota {
    text.parse().unwrap()
}

/// A layer keyed on `x-client-id`, at `quota` on `limiter`.
fn by_client(quota_text: &str, limiter: &MemoryRateLimiter) -> RateLimitLayer<HeaderKey> {
    RateLimitLayer::by_header("x-client-id", quota(quota_text)).backend(limiter.clone())
}

/// Sends a request from `client` through a clone of `svc`.
async fn send(svc: &Svc, client: Option<&str>) -> http::Response<Body> {
    svc.clone().oneshot(request(client)).await.unwrap()
}

#[tokio::test]
async fn passes_limit_then_answers_429_with_headers() {
    let svc = svc(by_client("2/60", &MemoryRateLimiter::new()));
    for (count, remaining) in [(1, 1), (2, 0)] {
        let r = send(&svc, Some("a")).await;
        assert_eq!(r.status(), StatusCode::OK);
        let (count, ratelimit) = (count.to_string(), format!("\"default\";r={remaining};t=60"));
        assert_eq!(r.body(), count.as_bytes(), "the handler sees the Usage");
        assert_eq!(r.headers()[&RATELIMIT], ratelimit);
        assert_eq!(r.headers()[&RATELIMIT_POLICY], "\"default\";q=2;w=60");
    }
    let r = send(&svc, Some("a")).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
    assert_eq!(r.headers()[RETRY_AFTER], "60");
    assert_eq!(r.headers()[&RATELIMIT], "\"default\";r=0;t=60");
    // Another key has its own count.
    let r = send(&svc, Some("b")).await;
    assert_eq!(r.status(), StatusCode::OK);
}

#[tokio::test]
async fn missing_key_is_400_when_required_and_passes_when_optional() {
    let limiter = MemoryRateLimiter::new();
    let r = send(&svc(by_client("1/60", &limiter)), None).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
    assert!(!r.headers().contains_key(&RATELIMIT_POLICY));

    let optional = svc(by_client("1/60", &limiter).optional(true));
    for _ in 0..3 {
        let r = send(&optional, None).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.body(), "uncounted".as_bytes());
        assert!(!r.headers().contains_key(&RATELIMIT));
    }
}

#[tokio::test]
async fn invalid_key_is_400_even_when_optional() {
    let svc = svc(by_client("1/60", &MemoryRateLimiter::new()).optional(true));
    for bad in ["\"unterminated", &"k".repeat(crate::key::MAX_KEY_LEN + 1)] {
        let r = send(&svc, Some(bad)).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad}");
    }
}

#[tokio::test]
async fn scope_separates_layers_and_shared_scope_shares_counts() {
    let limiter = MemoryRateLimiter::new();
    let global = || RateLimitLayer::global(quota("1/60")).backend(limiter.clone());
    let (a, b, a2) = (
        global().scope("a"),
        global().scope("b"),
        global().scope("a"),
    );
    assert_eq!(send(&svc(a), None).await.status(), StatusCode::OK);
    assert_eq!(send(&svc(b), None).await.status(), StatusCode::OK);
    let limited = send(&svc(a2), None).await.status();
    assert_eq!(limited, StatusCode::TOO_MANY_REQUESTS);
}
