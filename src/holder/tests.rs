//! The holder record: what a request records, bounded and sanitised.

use super::*;

fn parts(request: http::Request<()>) -> Parts {
    request.into_parts().0
}

#[cfg(feature = "redis")]
#[test]
fn a_request_is_recorded_with_its_method_path_and_request_id() {
    let head = parts(
        http::Request::post("/items/tv/buy?coupon=1")
            .header("x-request-id", "req-7")
            .body(())
            .unwrap(),
    );
    let expected = "replica=web-1 method=POST route=/items/tv/buy request_id=req-7";
    assert_eq!(&*HolderRef::Request(&head).encode("web-1"), expected);
    assert_eq!(Holder::of(&head).encode("web-1"), expected);
    let read = LockHolder::parse(expected);
    assert_eq!(read.replica, "web-1");
    assert_eq!(read.method.as_deref(), Some("POST"));
    assert_eq!(read.route.as_deref(), Some("/items/tv/buy"));
    assert_eq!(read.request_id.as_deref(), Some("req-7"));
    assert_eq!(read.to_string(), expected);
    assert_eq!(&*HolderRef::Direct.encode("web-1"), "replica=web-1");
}

#[cfg(feature = "axum")]
#[tokio::test]
async fn the_matched_route_is_preferred_to_the_path() {
    // The router puts the route it matched in the extensions; a handler sees it.
    let router = axum::Router::new().route(
        "/items/{id}",
        axum::routing::get(|parts: Parts| async move { Holder::of(&parts).encode("r") }),
    );
    let request = http::Request::get("/items/tv").body(axum::body::Body::empty());
    let response = tower::ServiceExt::oneshot(router, request.unwrap())
        .await
        .unwrap();
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(&body[..], b"replica=r method=GET route=/items/{id}");
}

#[test]
fn the_trace_id_of_a_traceparent_is_the_request_id_without_x_request_id() {
    let traced = |value: &str| {
        let head = parts(
            http::Request::get("/")
                .header("traceparent", value)
                .body(())
                .unwrap(),
        );
        Holder::of(&head).encode("r")
    };
    assert_eq!(
        traced("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        "replica=r method=GET route=/ request_id=4bf92f3577b34da6a3ce929d0e0e4736"
    );
    for invalid in [
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f35-00f067aa0ba902b7-01",
        "garbage",
    ] {
        assert_eq!(traced(invalid), "replica=r method=GET route=/", "{invalid}");
    }
}

#[cfg(feature = "redis")]
#[test]
fn client_text_is_bounded_and_sanitised() {
    let id = format!("a b\tc=d{}", "x".repeat(200));
    let head = parts(
        http::Request::post(format!("/{}", "p".repeat(300)))
            .header(
                "x-request-id",
                HeaderValue::from_bytes(id.as_bytes()).unwrap(),
            )
            .body(())
            .unwrap(),
    );
    let stored = HolderRef::Request(&head).encode("web 1\u{e9}");
    assert!(stored.bytes().all(|b| b.is_ascii_graphic() || b == b' '));
    let read = LockHolder::parse(&stored);
    assert_eq!(read.replica, "web_1__");
    assert_eq!(read.route.as_ref().map(String::len), Some(MAX_ROUTE_LEN));
    let request_id = read.request_id.unwrap();
    assert_eq!(request_id.len(), MAX_REQUEST_ID_LEN);
    assert!(request_id.starts_with("a_b_c=dxx"), "{request_id}");
    // Four fields, whatever the client sent: a space never comes through.
    assert_eq!(stored.split(' ').count(), 4, "{stored}");
}

#[test]
fn replica_ids_are_sanitised_and_the_default_keeps_the_pid() {
    assert_eq!(&*replica_id("pod 7\n"), "pod_7_");
    assert_eq!(replica_id(&"r".repeat(100)).len(), MAX_REPLICA_LEN);
    let default = default_replica_id();
    assert!(default.len() <= MAX_REPLICA_LEN);
    assert!(
        default.ends_with(&format!("-{}", std::process::id())),
        "{default}"
    );
    assert!(default.bytes().all(|b| b.is_ascii_graphic()), "{default}");
}
