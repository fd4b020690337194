//! `ClientIpKey` through real servers on 127.0.0.1 served with `ConnectInfo`, and a real
//! HTTP client: the test client's peer address is 127.0.0.1, a trusted proxy or not as
//! each test configures, and the headers it sends are what a proxy would have forwarded.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use reqwest::StatusCode;
use support::serve;
use tokio::sync::{Notify, Semaphore};
use tokio::time::timeout;
use tower_redlock::key::{ClientIpKey, ClientIpSource};
use tower_redlock::{
    ConcurrencyLimitLayer, ConfigError, LockLayer, MemoryConcurrencyLimiter, MemoryLocks,
    MemoryRateLimiter, Quota, RateLimitLayer,
};

/// A key on `source`, believed from peers in `trusted`.
fn key(source: ClientIpSource, trusted: &[&str]) -> ClientIpKey {
    ClientIpKey::new(source).trusted_proxies(trusted).unwrap()
}

/// Serves `POST /buy` limited to one request a minute per `key`; returns its base URL.
async fn one_a_minute(key: ClientIpKey) -> String {
    let quota: Quota = "1/60".parse().unwrap();
    let layer = RateLimitLayer::by_client_ip(key, quota).backend(MemoryRateLimiter::new());
    serve(Router::new().route("/buy", post(|| async { "bought" }).layer(layer))).await
}

/// The status of `POST {base}/buy` with `headers`.
async fn buy(base: &str, headers: &[(&str, &str)]) -> StatusCode {
    let mut request = reqwest::Client::new().post(format!("{base}/buy"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap().status()
}

async fn buy_as(base: &str, forwarded_for: &str) -> StatusCode {
    buy(base, &[("x-forwarded-for", forwarded_for)]).await
}

#[tokio::test]
async fn a_forged_left_most_x_forwarded_for_does_not_change_the_clients_key() {
    let base = one_a_minute(key(
        ClientIpSource::RightmostXForwardedFor,
        &["127.0.0.1/32"],
    ))
    .await;
    assert_eq!(buy_as(&base, "203.0.113.7").await, StatusCode::OK);
    // The same client, with a new left-most entry each time: still its one request.
    for forged in [
        "198.51.100.1, 203.0.113.7",
        "192.0.2.1, 10.0.0.1, 203.0.113.7",
    ] {
        assert_eq!(
            buy_as(&base, forged).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{forged}"
        );
    }
    // Another client behind the same proxy has its own count.
    assert_eq!(buy_as(&base, "203.0.113.8").await, StatusCode::OK);
}

#[tokio::test]
async fn several_trusted_hops_are_skipped_from_the_right() {
    let trusted = ["127.0.0.1/32", "10.0.0.0/8"];
    let base = one_a_minute(key(ClientIpSource::RightmostXForwardedFor, &trusted)).await;
    assert_eq!(
        buy_as(&base, "203.0.113.7, 10.0.0.2, 10.1.0.3").await,
        StatusCode::OK
    );
    // The client is the first address from the right outside the trusted ranges, whatever
    // stands left of it or however many trusted hops follow it.
    assert_eq!(
        buy_as(&base, "198.51.100.1, 203.0.113.7, 10.0.0.2").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Had the right-most trusted hop been the key, this would share the first one's.
    assert_eq!(
        buy_as(&base, "203.0.113.8, 10.0.0.2, 10.1.0.3").await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn an_untrusted_peers_x_forwarded_for_is_ignored() {
    // The test client (127.0.0.1) is no trusted proxy: it is keyed by its own address.
    let base = one_a_minute(key(ClientIpSource::RightmostXForwardedFor, &["10.0.0.0/8"])).await;
    assert_eq!(buy_as(&base, "203.0.113.7").await, StatusCode::OK);
    assert_eq!(
        buy_as(&base, "203.0.113.8").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(buy(&base, &[]).await, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn ipv6_clients_in_one_64_share_a_key_and_in_other_64s_do_not() {
    let base = one_a_minute(key(ClientIpSource::RightmostXForwardedFor, &["127.0.0.1"])).await;
    assert_eq!(buy_as(&base, "2001:db8:7:1::1").await, StatusCode::OK);
    // Another address of the same /64: the same key.
    assert_eq!(
        buy_as(&base, "2001:db8:7:1:ffff:ffff:ffff:fffe").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // The neighbouring /64s: keys of their own.
    assert_eq!(buy_as(&base, "2001:db8:7:2::1").await, StatusCode::OK);
    assert_eq!(buy_as(&base, "2001:db8:7::1").await, StatusCode::OK);
}

#[tokio::test]
async fn the_forwarded_header_is_read_by_its_right_most_for_parameters() {
    let trusted = ["127.0.0.1/32", "10.0.0.0/8"];
    let base = one_a_minute(key(ClientIpSource::RightmostForwarded, &trusted)).await;
    let forwarded = |value: &'static str| {
        let base = base.clone();
        async move { buy(&base, &[("forwarded", value)]).await }
    };
    // RFC 7239's forms: a quoted IPv6 address with a port, parameters, two elements.
    let first = r#"for=192.0.2.60;proto=http, for="[2001:db8:cafe::17]:4711";by=10.0.0.1"#;
    assert_eq!(forwarded(first).await, StatusCode::OK);
    // The same client (the same /64), behind a forged element and a trusted hop.
    let again = r#"for=198.51.100.1, for="[2001:db8:cafe::99]", for=10.0.0.2;proto=https"#;
    assert_eq!(forwarded(again).await, StatusCode::TOO_MANY_REQUESTS);
    // The left-most element alone was that client: the right-most is another one.
    assert_eq!(
        forwarded("for=\"[2001:db8:cafe::17]\", for=192.0.2.61").await,
        StatusCode::OK
    );
    // An address the proxy does not know (RFC 7239, section 6) is no key: 400.
    assert_eq!(forwarded("for=unknown").await, StatusCode::BAD_REQUEST);
    assert_eq!(
        forwarded("for=198.51.100.1, for=_hidden").await,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn a_trusted_proxys_request_without_the_header_has_no_key() {
    let base = one_a_minute(key(ClientIpSource::XRealIp, &["127.0.0.1/32"])).await;
    let resp = reqwest::Client::new()
        .post(format!("{base}/buy"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    let body: serde_json::Value = resp.json().await.unwrap();
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains("x-real-ip"), "{detail}");
    // With the header, the proxy's client is counted.
    assert_eq!(
        buy(&base, &[("x-real-ip", "203.0.113.7")]).await,
        StatusCode::OK
    );
}

#[test]
fn a_bad_cidr_is_an_error_when_the_key_is_built() {
    let key = ClientIpKey::new(ClientIpSource::RightmostXForwardedFor);
    for bad in [
        "10.0.0.0/33",
        "10.0.0/8",
        "proxy.internal",
        "2001:db8::/129",
    ] {
        let error = key
            .clone()
            .trusted_proxies(["127.0.0.1/32", bad])
            .unwrap_err();
        assert!(
            matches!(&error, ConfigError::InvalidProxyRange(text) if text == bad),
            "{bad}: {error}"
        );
        assert!(error.to_string().contains("10.0.0.0/8"), "{error}");
    }
    assert!(matches!(
        key.ipv6_prefix(129),
        Err(ConfigError::InvalidPrefixLength { len: 129, .. })
    ));
}

/// A handler that says when it has started, then waits for the test to let it finish.
#[derive(Clone)]
struct Gate {
    entered: Arc<Notify>,
    release: Arc<Semaphore>,
}

impl Gate {
    fn new() -> Self {
        Self {
            entered: Arc::new(Notify::new()),
            release: Arc::new(Semaphore::new(0)),
        }
    }

    async fn pass(self) -> &'static str {
        self.entered.notify_one();
        self.release.acquire().await.unwrap().forget();
        "done"
    }
}

#[tokio::test]
async fn the_lock_and_the_concurrency_limit_take_the_client_ip_key() {
    let client = key(ClientIpSource::RightmostXForwardedFor, &["127.0.0.1/32"]);
    let gate = Gate::new();
    let (lock_gate, limit_gate) = (gate.clone(), gate.clone());
    let app = Router::new()
        .route(
            "/lock",
            post(move || lock_gate.clone().pass())
                .layer(LockLayer::new(client.clone()).backend(MemoryLocks::new())),
        )
        .route(
            "/limit",
            post(move || limit_gate.clone().pass()).layer(
                ConcurrencyLimitLayer::by_client_ip(client, 1)
                    .backend(MemoryConcurrencyLimiter::new()),
            ),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let send = |path: &str, forwarded_for: &'static str| {
        client
            .post(format!("{base}{path}"))
            .header("x-forwarded-for", forwarded_for)
            .send()
    };
    for (path, busy) in [
        ("/lock", StatusCode::LOCKED),
        ("/limit", StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let held = tokio::spawn(send(path, "203.0.113.7"));
        gate.entered.notified().await;
        // The same client, whatever it puts on the left, waits its turn.
        let forged = send(path, "198.51.100.1, 203.0.113.7");
        // Let in (a regression), it would wait at the gate: a timeout fails the test.
        let forged = timeout(Duration::from_secs(10), forged).await;
        let forged = forged.expect("refused at once").unwrap();
        assert_eq!(forged.status(), busy, "{path}");
        // Another client does not.
        let other = tokio::spawn(send(path, "203.0.113.8"));
        gate.entered.notified().await;
        gate.release.add_permits(2);
        assert_eq!(held.await.unwrap().unwrap().status(), StatusCode::OK);
        assert_eq!(other.await.unwrap().unwrap().status(), StatusCode::OK);
    }
}
