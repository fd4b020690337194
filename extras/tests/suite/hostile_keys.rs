//! Keys a hostile client chooses: empty, huge and malformed values for every way a key is
//! read from a request (a header, a path parameter, a function, the peer IP, the
//! idempotency key with and without a tenant, the rate-limit and concurrency-limit keys,
//! and `Locked<T>` over a path, a body and a type of the app's own), over real HTTP. Each
//! is answered 400 (or, where the HTTP server itself refuses the request before any layer
//! sees it, its own 4xx): never a panic, a 500 or a connection closed without an answer.
//! The empty key set is also tried on a real `redis-server`.

use crate::support;

use std::borrow::Cow;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{FromRequestParts, Path};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::routing::post;
use reqwest::header::HeaderValue;
use support::serve;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_redlock::key::{MAX_KEY_LEN, MAX_KEYS_PER_LEASE};
use tower_redlock::{
    ConcurrencyLimitLayer, IdempotencyLayer, LockError, LockKey, LockKeys, LockLayer, LockRequest,
    Locked, Locks, MemoryConcurrencyLimiter, MemoryLocks, MemoryRateLimiter, Quota, RateLimitLayer,
};

/// 1 MB: larger than any key, and than the HTTP server's bound on a request head.
const MB: usize = 1 << 20;

/// A key one byte too long.
fn too_long() -> String {
    "k".repeat(MAX_KEY_LEN + 1)
}

/// Ids named in a JSON body, each one lock key, all held with one lease.
#[derive(serde::Deserialize)]
struct Batch {
    ids: Vec<String>,
}

impl LockKeys for Batch {
    const SCOPE: &'static str = "item";
    fn lock_keys(&self) -> Vec<Cow<'_, str>> {
        self.ids
            .iter()
            .map(|id| Cow::Borrowed(id.as_str()))
            .collect()
    }
}

/// An order id from the path, with a scope of its own.
#[derive(serde::Deserialize)]
struct OrderId(String);

impl LockKey for OrderId {
    const SCOPE: &'static str = "order";
    fn lock_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// An extractor of the app's own: the `X-Account` header's bytes, read leniently (invalid
/// UTF-8 becomes U+FFFD), so that whatever the client sent reaches the key check.
struct Account(String);

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let value = parts
            .headers
            .get("x-account")
            .ok_or(StatusCode::BAD_REQUEST)?;
        Ok(Account(
            String::from_utf8_lossy(value.as_bytes()).into_owned(),
        ))
    }
}

impl LockKey for Account {
    const SCOPE: &'static str = "account";
    fn lock_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// A header's bytes, read leniently, for the function keys.
fn lenient(parts: &Parts, name: &str) -> Option<String> {
    let value = parts.headers.get(name)?;
    Some(String::from_utf8_lossy(value.as_bytes()).into_owned())
}

/// The keys of `X-Keys`, comma-separated, empty items dropped: `""` is an empty list.
fn keys_of(parts: &Parts) -> Option<Vec<String>> {
    let keys = lenient(parts, "x-keys")?;
    Some(
        keys.split(',')
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
            .collect(),
    )
}

async fn batch(batch: Locked<Json<Batch>>) -> String {
    batch.ids.len().to_string()
}

/// Every key path of the crate, one route each, on `locks` and in-process limiters.
fn app(locks: Locks) -> Router {
    let quota: Quota = "1000/60".parse().unwrap();
    let rate = MemoryRateLimiter::new();
    let concurrency = MemoryConcurrencyLimiter::new();
    let ok = || post(|| async { "ok" });
    Router::new()
        .route(
            "/lock/header",
            ok().layer(LockLayer::by_header("Idempotency-Key").backend(locks.clone())),
        )
        .route(
            "/lock/path/{id}",
            ok().layer(LockLayer::by_path_param("id").backend(locks.clone())),
        )
        .route(
            "/lock/fn",
            ok().layer(LockLayer::by_fn(|p: &Parts| lenient(p, "x-key")).backend(locks.clone())),
        )
        .route(
            "/lock/fn_all",
            ok().layer(LockLayer::by_fn_all(keys_of).backend(locks.clone())),
        )
        .route(
            "/rate/header",
            ok().layer(RateLimitLayer::by_header("X-Client-Id", quota).backend(rate.clone())),
        )
        .route(
            "/rate/either",
            ok().layer(
                RateLimitLayer::by_header_or_peer_ip("X-Client-Id", quota).backend(rate.clone()),
            ),
        )
        .route(
            "/rate/ip",
            ok().layer(RateLimitLayer::by_peer_ip(peer_ip_quota()).backend(rate.clone())),
        )
        .route(
            "/rate/path/{id}",
            ok().layer(RateLimitLayer::by_path_param("id", quota).backend(rate.clone())),
        )
        .route(
            "/rate/fn",
            ok().layer(RateLimitLayer::by_fn(|p: &Parts| lenient(p, "x-key"), quota).backend(rate)),
        )
        .route(
            "/concurrency/header",
            ok().layer(
                ConcurrencyLimitLayer::by_header("X-Client-Id", 100).backend(concurrency.clone()),
            ),
        )
        .route(
            "/concurrency/path/{id}",
            ok().layer(ConcurrencyLimitLayer::by_path_param("id", 100).backend(concurrency)),
        )
        .route(
            "/idempotency",
            ok().layer(IdempotencyLayer::new().backend(locks.clone())),
        )
        .route(
            "/idempotency/tenant",
            ok().layer(
                IdempotencyLayer::new()
                    .backend(locks.clone())
                    .tenant(|p| lenient(p, "x-tenant")),
            ),
        )
        .route("/locked/json", post(batch))
        .route(
            "/locked/string/{id}",
            post(|id: Locked<Path<String>>| async move { id.0.clone() }),
        )
        .route(
            "/locked/number/{id}",
            post(|id: Locked<Path<u64>>| async move { id.0.to_string() }),
        )
        .route(
            "/locked/order/{id}",
            post(|order: Locked<Path<OrderId>>| async move { order.0.0.clone() }),
        )
        .route(
            "/locked/account",
            post(|account: Locked<Account>| async move { account.0.clone() }),
        )
        .with_state(locks)
}

/// Asserts that `resp` is this crate's 400: `application/problem+json` with the status in
/// the body.
async fn assert_problem_400(resp: reqwest::Result<reqwest::Response>, case: &str) {
    let resp = resp.unwrap_or_else(|e| panic!("{case}: no answer: {e}"));
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{case}");
    assert_eq!(
        resp.headers()["content-type"],
        "application/problem+json",
        "{case}"
    );
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["status"], 400, "{case}: {body}");
}

/// Asserts that `resp` is a 400 (an extractor's own rejection, in its own format).
fn assert_400(resp: reqwest::Result<reqwest::Response>, case: &str) {
    let resp = resp.unwrap_or_else(|e| panic!("{case}: no answer: {e}"));
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{case}");
}

/// The status of the answer to `request`, sent as raw bytes over a new connection (for
/// bytes a client library refuses to send); panics when the connection closes without
/// an answer. The request is written while the answer is read, so that a server that
/// answers before reading all of it is heard.
async fn raw_status(base: &str, request: Vec<u8>) -> u16 {
    let addr = base.trim_start_matches("http://");
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        // The server may close once it has answered; what it did not read is moot.
        let _ = write.write_all(&request).await;
        write
    });
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut answer));
    // A reset after the answer (unread bytes when the server closed) keeps what was read.
    let _ = read.await.expect("an answer within 10 s");
    drop(writer.await);
    let head = String::from_utf8_lossy(&answer);
    let status = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok());
    status.unwrap_or_else(|| panic!("the connection closed without an answer: {head:?}"))
}

/// A raw `POST path` with one extra header line `name: value` (bytes as given).
fn raw_post(path: &str, name: &str, value: &[u8]) -> Vec<u8> {
    let mut request =
        format!("POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{name}: ").into_bytes();
    request.extend_from_slice(value);
    request.extend_from_slice(b"\r\ncontent-length: 0\r\n\r\n");
    request
}

/// Header values that reach the key check and are refused there, each with what it is.
fn bad_header_values() -> Vec<(&'static str, HeaderValue)> {
    let value = |bytes: &[u8]| HeaderValue::from_bytes(bytes).unwrap();
    vec![
        ("empty", value(b"")),
        ("white space only", value(b" \t ")),
        ("257 bytes", value(too_long().as_bytes())),
        ("64 KB", value("k".repeat(64 * 1024).as_bytes())),
        ("a tab inside", value(b"a\tb")),
        ("invalid UTF-8", value(&[0xff, 0xfe, 0x41])),
        ("UTF-8 past ASCII", value("cl\u{e9}".as_bytes())),
        ("an unterminated quoted string", value(b"\"open")),
        ("bytes after the closing quote", value(b"\"a\"b")),
        ("an escape of a letter", value(b"\"a\\nb\"")),
        ("a lone backslash", value(b"\"a\\")),
        ("a tab in a quoted string", value(b"\"a\tb\"")),
        ("an empty quoted string", value(b"\"\"")),
        ("a quoted string of 257 bytes", {
            value(format!("\"{}\"", too_long()).as_bytes())
        }),
    ]
}

/// Raw header values a client library refuses to send: the HTTP server refuses them
/// before any layer runs, with a 400 of its own.
const RAW_BAD_HEADER_VALUES: [(&str, &[u8]); 5] = [
    ("NUL", b"a\x00b"),
    ("a control byte", b"a\x01b"),
    ("ESC", b"\x1b[2J"),
    ("DEL", b"a\x7fb"),
    ("a bare CR", b"a\rb"),
];

/// Header-keyed routes: each refuses every bad value with 400 (problem+json).
#[tokio::test]
async fn header_keys_refuse_empty_huge_and_malformed_values_with_400() {
    let base = serve(app(Locks::from(MemoryLocks::new()))).await;
    let client = reqwest::Client::new();
    let routes = [
        ("/lock/header", "idempotency-key"),
        ("/rate/header", "x-client-id"),
        ("/rate/either", "x-client-id"),
        ("/concurrency/header", "x-client-id"),
        ("/idempotency", "idempotency-key"),
    ];
    for (path, header) in routes {
        for (what, value) in bad_header_values() {
            let resp = client
                .post(format!("{base}{path}"))
                .header(header, value)
                .send()
                .await;
            assert_problem_400(resp, &format!("{path} with {what}")).await;
        }
        // Without the header: 400, except where the peer IP stands in.
        let missing = client.post(format!("{base}{path}")).send().await.unwrap();
        let expected = if path == "/rate/either" { 200 } else { 400 };
        assert_eq!(missing.status(), expected, "{path} without {header}");
        // A good key still works: the refusals above left nothing behind.
        let good = client
            .post(format!("{base}{path}"))
            .header(header, "\"good-1\"")
            .send()
            .await
            .unwrap();
        assert_eq!(good.status(), 200, "{path} with a good key");
    }
}

/// Bytes no client library sends, and a 1 MB header: the HTTP server answers them itself
/// (400, 431) before any layer runs, and the connection is answered, not dropped.
#[tokio::test]
async fn raw_control_bytes_and_a_1_mb_header_are_answered_not_dropped() {
    let base = serve(app(Locks::from(MemoryLocks::new()))).await;
    for (path, header) in [
        ("/lock/header", "idempotency-key"),
        ("/lock/fn", "x-key"),
        ("/rate/either", "x-client-id"),
        ("/idempotency", "idempotency-key"),
        ("/locked/account", "x-account"),
    ] {
        for (what, value) in RAW_BAD_HEADER_VALUES {
            let status = raw_status(&base, raw_post(path, header, value)).await;
            assert_eq!(status, 400, "{path} with {what}");
        }
        let huge = "k".repeat(MB);
        let status = raw_status(&base, raw_post(path, header, huge.as_bytes())).await;
        assert_eq!(status, 431, "{path} with a 1 MB header");
    }
}

/// Path-parameter keys: percent-encoded control bytes, invalid UTF-8 once decoded, and
/// values too long are 400; a huge path is refused by the server itself.
#[tokio::test]
async fn path_parameter_keys_refuse_encoded_control_bytes_and_long_values_with_400() {
    let base = serve(app(Locks::from(MemoryLocks::new()))).await;
    let client = reqwest::Client::new();
    let long = too_long();
    let very_long = "k".repeat(32 * 1024);
    let bad = [
        ("%00", "an encoded NUL"),
        ("a%0Ab", "an encoded LF"),
        ("a%0D%0Ab", "an encoded CR LF"),
        ("%1B%5B2J", "an encoded ESC"),
        ("a%7Fb", "an encoded DEL"),
        ("%C2%85", "an encoded C1 control"),
        ("%FF", "invalid UTF-8 once decoded"),
        ("%C3%28", "a broken UTF-8 sequence once decoded"),
        ("a%E2%82", "a truncated UTF-8 sequence once decoded"),
        (long.as_str(), "257 bytes"),
        (very_long.as_str(), "32 KB"),
    ];
    for route in ["/lock/path", "/rate/path", "/concurrency/path"] {
        for (param, what) in bad {
            let resp = client.post(format!("{base}{route}/{param}")).send().await;
            assert_problem_400(resp, &format!("{route} with {what}")).await;
        }
        let good = client
            .post(format!("{base}{route}/item-1"))
            .send()
            .await
            .unwrap();
        assert_eq!(good.status(), 200, "{route} with a good key");
    }
    // Locked<Path<..>>: the extractor's own 400 for what it cannot parse, the crate's for
    // what it parsed but cannot lock.
    for route in ["/locked/string", "/locked/order"] {
        for (param, what) in bad {
            let resp = client.post(format!("{base}{route}/{param}")).send().await;
            assert_400(resp, &format!("{route} with {what}"));
        }
        for (param, what) in [("%00", "an encoded NUL"), (long.as_str(), "257 bytes")] {
            let resp = client.post(format!("{base}{route}/{param}")).send().await;
            assert_problem_400(resp, &format!("{route} with {what}")).await;
        }
    }
    for (param, what) in [
        ("abc", "not a number"),
        ("-1", "negative"),
        ("18446744073709551616", "one over u64::MAX"),
        ("%00", "an encoded NUL"),
        (long.as_str(), "257 digits"),
    ] {
        let resp = client
            .post(format!("{base}/locked/number/{param}"))
            .send()
            .await;
        assert_400(resp, &format!("/locked/number with {what}"));
    }
    // An empty parameter matches no route; a 1 MB path is refused by the server.
    let empty = client
        .post(format!("{base}/lock/path/"))
        .send()
        .await
        .unwrap();
    assert_eq!(empty.status(), 404);
    let huge = format!("/lock/path/{}", "k".repeat(MB));
    let request = format!("POST {huge} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    let status = raw_status(&base, request.into_bytes()).await;
    // Over hyper's bound on a request head (about 400 KB): 431 before routing.
    assert_eq!(status, 431, "a 1 MB path");
}

/// Function keys (one, and a set): empty, huge, control bytes and, for a set, none or too
/// many are 400.
#[tokio::test]
async fn function_keys_refuse_empty_huge_and_malformed_values_with_400() {
    let base = serve(app(Locks::from(MemoryLocks::new()))).await;
    let client = reqwest::Client::new();
    let bad = |value: &[u8]| HeaderValue::from_bytes(value).unwrap();
    let cases = [
        ("empty", bad(b"")),
        ("257 bytes", bad(too_long().as_bytes())),
        ("64 KB", bad("k".repeat(64 * 1024).as_bytes())),
        ("a tab", bad(b"a\tb")),
        (
            "invalid UTF-8 (U+FFFD, then a C1 control)",
            bad(b"\xff\xc2\x85"),
        ),
    ];
    for route in ["/lock/fn", "/rate/fn"] {
        for (what, value) in &cases {
            let resp = client
                .post(format!("{base}{route}"))
                .header("x-key", value)
                .send()
                .await;
            assert_problem_400(resp, &format!("{route} with {what}")).await;
        }
    }
    let many = (0..=MAX_KEYS_PER_LEASE)
        .map(|i| format!("k{i}"))
        .collect::<Vec<_>>()
        .join(",");
    let sets = [
        ("an empty list", bad(b"")),
        ("a list of empty items", bad(b",,,")),
        (
            "a key of 257 bytes",
            bad(format!("a,{}", too_long()).as_bytes()),
        ),
        ("a tab in a key", bad(b"a,b\tc")),
        ("one key too many", bad(many.as_bytes())),
    ];
    for (what, value) in sets {
        let resp = client
            .post(format!("{base}/lock/fn_all"))
            .header("x-keys", value)
            .send()
            .await;
        assert_problem_400(resp, &format!("/lock/fn_all with {what}")).await;
    }
    for (keys, what) in [("a,b", "two keys"), ("a,a", "one key twice")] {
        let resp = client
            .post(format!("{base}/lock/fn_all"))
            .header("x-keys", keys)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "/lock/fn_all with {what}");
    }
}

/// The peer-IP route's quota: one request per bad header value.
fn peer_ip_quota() -> Quota {
    Quota::new(bad_header_values().len() as u64, Duration::from_secs(60)).unwrap()
}

/// The peer IP is the server's to read: hostile forwarding headers neither fail the
/// request nor change its key, so every request counts against the one peer's quota.
#[tokio::test]
async fn peer_ip_keys_ignore_what_the_client_sends() {
    let base = serve(app(Locks::from(MemoryLocks::new()))).await;
    let client = reqwest::Client::new();
    let send = |value: HeaderValue| {
        client
            .post(format!("{base}/rate/ip"))
            .header("x-forwarded-for", value.clone())
            .header("forwarded", value)
            .send()
    };
    for (what, value) in bad_header_values() {
        let resp = send(value).await.unwrap();
        assert_eq!(resp.status(), 200, "forwarding headers with {what}");
    }
    let over = send(HeaderValue::from_static("198.51.100.1"))
        .await
        .unwrap();
    assert_eq!(over.status(), 429, "one key for every request of the peer");
}

/// The idempotency key with a tenant: a tenant that is missing, empty, too long or has
/// control bytes is 400, and so is a key that is fine alone but too long with its tenant.
#[tokio::test]
async fn idempotency_tenants_refuse_empty_huge_and_malformed_values_with_400() {
    let base = serve(app(Locks::from(MemoryLocks::new()))).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/idempotency/tenant");
    let send = |tenant: Option<HeaderValue>, key: HeaderValue| {
        let mut request = client.post(&url).header("idempotency-key", key);
        if let Some(tenant) = tenant {
            request = request.header("x-tenant", tenant);
        }
        request.send()
    };
    let value = |bytes: &[u8]| HeaderValue::from_bytes(bytes).unwrap();
    let good_key = value(b"\"k-1\"");
    for (what, tenant) in [
        ("no tenant", None),
        ("an empty tenant", Some(value(b""))),
        ("a tenant of 257 bytes", Some(value(too_long().as_bytes()))),
        (
            "a tenant of 64 KB",
            Some(value("t".repeat(64 * 1024).as_bytes())),
        ),
        ("a tab in the tenant", Some(value(b"a\tb"))),
        (
            "a C1 control in the tenant",
            Some(value("a\u{85}b".as_bytes())),
        ),
    ] {
        let resp = send(tenant, good_key.clone()).await;
        assert_problem_400(resp, what).await;
    }
    for (what, key) in bad_header_values() {
        let resp = send(Some(value(b"acme")), key).await;
        assert_problem_400(resp, &format!("tenant acme, key with {what}")).await;
    }
    // The bound applies to each alone: the longest tenant with the longest key is served.
    let longest = "k".repeat(MAX_KEY_LEN);
    let resp = send(Some(value(longest.as_bytes())), value(longest.as_bytes())).await;
    assert_eq!(resp.unwrap().status(), 200, "the longest tenant and key");
    let resp = send(Some(value(b"acme")), good_key).await.unwrap();
    assert_eq!(resp.status(), 200, "a good tenant and key");
}

fn json_of_ids(ids: &[String]) -> String {
    serde_json::json!({ "ids": ids }).to_string()
}

/// `Locked<Json<T>>` over a list of keys: an empty list, an empty key, control
/// characters, keys of 257 bytes and 1 MB, too many keys, and a body of 100 000 keys are
/// 400 (problem+json); a body that is not JSON is the extractor's own 400.
async fn body_keys_are_refused_with_400(locks: Locks) {
    let base = serve(app(locks)).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/locked/json");
    let post = |body: String| {
        client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let ids = |ids: &[&str]| json_of_ids(&ids.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
    let long = too_long();
    let mb = "k".repeat(MB);
    let too_many: Vec<String> = (0..=MAX_KEYS_PER_LEASE).map(|i| format!("k{i}")).collect();
    let crowd: Vec<String> = (0..100_000).map(|i| format!("k{i}")).collect();
    for (what, body) in [
        ("an empty list", ids(&[])),
        ("an empty key", ids(&[""])),
        ("an empty key among good ones", ids(&["a", "", "b"])),
        ("a NUL", ids(&["a\u{0}b"])),
        ("a newline", ids(&["a\nb"])),
        ("DEL", ids(&["a\u{7f}"])),
        ("a C1 control", ids(&["\u{85}"])),
        ("a key of 257 bytes", ids(&[&long])),
        ("a key of 1 MB", ids(&[&mb])),
        ("65 keys", json_of_ids(&too_many)),
        ("100 000 keys", json_of_ids(&crowd)),
    ] {
        assert_problem_400(post(body).await, what).await;
    }
    assert_400(post("{\"ids\": [".to_owned()).await, "truncated JSON");
    // Invalid UTF-8 inside a JSON string.
    let not_utf8 = client
        .post(&url)
        .header("content-type", "application/json")
        .body(b"{\"ids\": [\"\xff\xfe\"]}".to_vec())
        .send()
        .await;
    assert_400(not_utf8, "invalid UTF-8 in the body");
    // Duplicates are one key; a good set is held and released.
    let resp = post(ids(&["a", "a", "b"])).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "3");
}

#[tokio::test]
async fn body_keys_are_refused_with_400_in_process() {
    body_keys_are_refused_with_400(Locks::from(MemoryLocks::new())).await;
}

/// An extractor of the app's own: empty, long and malformed values are 400.
#[tokio::test]
async fn custom_lock_keys_refuse_empty_huge_and_malformed_values_with_400() {
    let base = serve(app(Locks::from(MemoryLocks::new()))).await;
    let client = reqwest::Client::new();
    let value = |bytes: &[u8]| HeaderValue::from_bytes(bytes).unwrap();
    for (what, account) in [
        ("empty", value(b"")),
        ("257 bytes", value(too_long().as_bytes())),
        ("64 KB", value("a".repeat(64 * 1024).as_bytes())),
        ("a tab", value(b"a\tb")),
        ("invalid UTF-8, then a C1 control", value(b"\xff\xc2\x85")),
    ] {
        let resp = client
            .post(format!("{base}/locked/account"))
            .header("x-account", account)
            .send()
            .await;
        assert_problem_400(resp, what).await;
    }
    let resp = client
        .post(format!("{base}/locked/account"))
        .header("x-account", "acme")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

/// An empty set of keys, on Redis: 400 through `Locked<Json<T>>` and through a layer, an
/// error from `Locks::acquire`, and nothing written to the node.
#[tokio::test]
async fn an_empty_key_set_is_400_on_redis() {
    let nodes = support::nodes(1);
    let locks = support::redlock(&nodes, Duration::from_secs(10)).await;
    empty_key_sets_are_refused(locks.clone()).await;
    body_keys_are_refused_with_400(locks).await;
    let mut conn = nodes[0].conn().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    // Only the good set's keys were ever taken (and are released, or expire).
    assert!(
        keys.iter()
            .all(|k| k.contains("item:a") || k.contains("item:b")),
        "{keys:?}"
    );
}

#[tokio::test]
async fn an_empty_key_set_is_400_in_process() {
    empty_key_sets_are_refused(Locks::from(MemoryLocks::new())).await;
}

/// `{"ids": []}` through `Locked<Json<T>>`, an empty list through `by_fn_all`, and an
/// empty `LockRequest::all` from the API.
async fn empty_key_sets_are_refused(locks: Locks) {
    let base = serve(app(locks.clone())).await;
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{base}/locked/json"))
        .header("content-type", "application/json")
        .body(r#"{"ids":[]}"#)
        .send()
        .await;
    assert_problem_400(resp, "{\"ids\":[]}").await;
    let resp = client
        .post(format!("{base}/lock/fn_all"))
        .header("x-keys", "")
        .send()
        .await;
    assert_problem_400(resp, "by_fn_all with no key").await;
    let none = locks
        .acquire(LockRequest::all(Vec::<String>::new()))
        .await
        .unwrap_err();
    assert!(
        matches!(
            none,
            LockError::InvalidKey(tower_redlock::key::KeyError::KeyCount { count: 0, .. })
        ),
        "{none:?}"
    );
    let too_many = (0..=MAX_KEYS_PER_LEASE).map(|i| format!("k{i}"));
    let err = locks.acquire(LockRequest::all(too_many)).await.unwrap_err();
    assert!(matches!(err, LockError::InvalidKey(_)), "{err:?}");
    // The server still answers a good set after all that.
    let resp = client
        .post(format!("{base}/locked/json"))
        .header("content-type", "application/json")
        .body(r#"{"ids":["a","b"]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}
