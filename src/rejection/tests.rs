//! The rejection's two renderings: problem+json (the type, status and title of each kind)
//! and the gRPC answer.

use super::*;
use http::header::RETRY_AFTER;

#[test]
fn body_is_problem_json_with_a_type_per_kind() {
    let r = Response::<Bytes>::from(
        Rejection::new(RejectedBy::Lock, RejectionKind::Taken, "held")
            .with_status(StatusCode::LOCKED)
            .retry_after(Duration::from_millis(1500)),
    );
    // The rest of the body and headers: `Problem`'s own test.
    assert_eq!(r.status(), 423);
    assert_eq!(r.headers()[RETRY_AFTER], "2");
    let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
    assert_eq!(v["type"], "urn:tower-redlock:problem:taken");
    assert_eq!(v["title"], "Locked");
    assert_eq!(
        r.extensions().get::<Rejection>().unwrap().kind(),
        RejectionKind::Taken
    );
}

#[test]
fn grpc_answers_are_trailers_only_with_status_message_and_pushback() {
    let r: Response<Bytes> = Rejection::new(
        RejectedBy::RateLimit,
        RejectionKind::Limited,
        "100% used, é",
    )
    .retry_after(Duration::from_millis(1500))
    .into_grpc_response();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()[CONTENT_TYPE], "application/grpc");
    assert_eq!(r.headers()["grpc-status"], "8");
    assert_eq!(r.headers()["grpc-message"], "100%25 used, %C3%A9");
    assert_eq!(r.headers()["grpc-retry-pushback-ms"], "1500");
    assert!(r.body().is_empty());
}

/// The type URIs are the crate's interface to clients: each is asserted as written,
/// so that a change to one is a deliberate (breaking) one. Each kind's default
/// status is named as RFC 9110 names it (`Problem::title`'s test has the rest).
#[test]
fn every_kind_has_its_type_status_and_title() {
    use RejectionKind::*;
    let kinds = [
        (Taken, "urn:tower-redlock:problem:taken", 409, "Conflict"),
        (
            InFlight,
            "urn:tower-redlock:problem:in-flight",
            409,
            "Conflict",
        ),
        (
            MissingKey,
            "urn:tower-redlock:problem:missing-key",
            400,
            "Bad Request",
        ),
        (
            InvalidKey,
            "urn:tower-redlock:problem:invalid-key",
            400,
            "Bad Request",
        ),
        (
            Mismatch,
            "urn:tower-redlock:problem:mismatch",
            422,
            "Unprocessable Content",
        ),
        (
            Unreplayable,
            "urn:tower-redlock:problem:unreplayable",
            409,
            "Conflict",
        ),
        (
            Limited,
            "urn:tower-redlock:problem:limited",
            429,
            "Too Many Requests",
        ),
        (
            TooLarge,
            "urn:tower-redlock:problem:too-large",
            413,
            "Content Too Large",
        ),
        (
            RequestTimeout,
            "urn:tower-redlock:problem:request-timeout",
            408,
            "Request Timeout",
        ),
        (
            Unavailable,
            "urn:tower-redlock:problem:unavailable",
            503,
            "Service Unavailable",
        ),
        (
            Lost,
            "urn:tower-redlock:problem:lost",
            503,
            "Service Unavailable",
        ),
        (
            Misconfigured,
            "urn:tower-redlock:problem:misconfigured",
            500,
            "Internal Server Error",
        ),
    ];
    for (kind, type_uri, status, title) in kinds {
        assert_eq!(kind.type_uri(), type_uri, "{kind:?}");
        let rejection = Rejection::new(RejectedBy::Lock, kind, "detail");
        assert_eq!(rejection.status(), status, "{kind:?}");
        let r = Response::<Bytes>::from(rejection);
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["type"], type_uri, "{kind:?}");
        assert_eq!(v["status"], status, "{kind:?}");
        assert_eq!(v["title"], title, "{kind:?}");
    }
}

#[test]
fn every_kind_has_its_grpc_code() {
    use RejectionKind::*;
    let codes = [
        (Taken, 10),
        (InFlight, 10),
        (MissingKey, 3),
        (InvalidKey, 3),
        (Mismatch, 3),
        (Unreplayable, 9),
        (Limited, 8),
        (TooLarge, 8),
        (RequestTimeout, 4),
        (Unavailable, 14),
        (Lost, 14),
        (Misconfigured, 13),
    ];
    for (kind, code) in codes {
        assert_eq!(kind.grpc_code(), code, "{kind:?}");
    }
}
