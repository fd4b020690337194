//! `application/problem+json` responses (RFC 9457): the HTTP rendering of a
//! [`Rejection`](crate::Rejection), and a builder for an application's own problems.

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

/// The media type of RFC 9457 problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An HTTP answer given instead of running the inner service: a status, an RFC 9457
/// problem details body (`type`, `title`, `status`, `detail`), and `Retry-After` where the
/// client may try again. The `title` is the status's name as its RFC gives it
/// ([`title`](Self::title)).
///
/// It becomes a response with `Response::from(problem)` (any body type that can be built
/// from [`Bytes`]), or, with the `axum` feature, through axum's `IntoResponse`.
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Response, StatusCode};
/// use tower_redlock::Problem;
///
/// let problem = Problem::new(StatusCode::LOCKED, "held").retry_after(Duration::from_secs(2));
/// let response = Response::<Bytes>::from(problem);
/// assert_eq!(response.status(), StatusCode::LOCKED);
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// assert_eq!(response.headers()["retry-after"], "2");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub(crate) status: StatusCode,
    detail: Cow<'static, str>,
    retry_after: Option<Duration>,
    type_uri: Option<Cow<'static, str>>,
}

impl Problem {
    /// A problem with `status` and a human-readable `detail`.
    pub fn new(status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            detail: detail.into(),
            retry_after: None,
            type_uri: None,
        }
    }

    /// The problem type (RFC 9457, section 3.1.1), a URI that identifies it; by default
    /// `about:blank`, a problem described by its status alone. The crate's own types are
    /// [`RejectionKind::type_uri`](crate::RejectionKind::type_uri).
    #[must_use]
    pub fn with_type(mut self, uri: impl Into<Cow<'static, str>>) -> Self {
        self.type_uri = Some(uri.into());
        self
    }

    /// Adds `Retry-After` (RFC 9110, section 10.2.3), sent in whole seconds rounded up,
    /// at least 1.
    #[must_use]
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The detail text.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The `title` the body carries: the status's name as RFC 9110 (section 15) gives it,
    /// or the RFC that defines the status (423 Locked, RFC 4918; 428 Precondition Required
    /// and 429 Too Many Requests, RFC 6585; 425 Too Early, RFC 8470), such as "Content Too
    /// Large" for 413 and "Unprocessable Content" for 422, where the `http` crate's
    /// [`canonical_reason`](StatusCode::canonical_reason) keeps RFC 7231's older names
    /// ("Payload Too Large", and "Unprocessable Entity" from RFC 4918). "Error" for a
    /// status without a name.
    pub fn title(&self) -> &'static str {
        title(self.status)
    }

    /// The problem type, `about:blank` unless [`with_type`](Self::with_type) set one.
    pub fn type_uri(&self) -> &str {
        self.type_uri.as_deref().unwrap_or("about:blank")
    }

    /// The `Retry-After` delay, if any.
    pub fn retry_after_delay(&self) -> Option<Duration> {
        self.retry_after
    }
}

impl<B: From<Bytes>> From<Problem> for Response<B> {
    /// The `application/problem+json` response: the status, the body, and `Retry-After`
    /// when set.
    fn from(problem: Problem) -> Self {
        problem.to_response()
    }
}

impl Problem {
    /// [`Response::from`] without giving the problem up.
    pub(crate) fn to_response<B: From<Bytes>>(&self) -> Response<B> {
        let problem = self;
        let body = serde_json::json!({
            "type": problem.type_uri(),
            "title": problem.title(),
            "status": problem.status.as_u16(),
            "detail": problem.detail,
        });
        let mut response = Response::new(B::from(Bytes::from(body.to_string())));
        *response.status_mut() = problem.status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = problem.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        response
    }
}

/// The name of `status`: [`Problem::title`].
fn title(status: StatusCode) -> &'static str {
    match status.as_u16() {
        // RFC 9110, section 15.3.4 (the `http` crate drops the hyphen).
        203 => "Non-Authoritative Information",
        // RFC 9110, section 15.5.14 (RFC 7231: "Payload Too Large").
        413 => "Content Too Large",
        // RFC 9110, section 15.5.21 (RFC 4918: "Unprocessable Entity").
        422 => "Unprocessable Content",
        // Every other name of the `http` crate is the one of RFC 9110 or of the RFC that
        // defines the status (RFC 4918, 6585, 8470, ...).
        _ => status.canonical_reason().unwrap_or("Error"),
    }
}

/// Whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    let secs = after
        .as_secs()
        .saturating_add(u64::from(after.subsec_nanos() > 0));
    secs.max(1)
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl axum::response::IntoResponse for Problem {
    fn into_response(self) -> axum::response::Response {
        Response::from(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_at_least_one_second() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
        assert_eq!(retry_after_secs(Duration::MAX), u64::MAX);
    }

    #[test]
    fn body_is_problem_json() {
        let r = Response::<Bytes>::from(
            Problem::new(StatusCode::LOCKED, "held").retry_after(Duration::from_millis(1500)),
        );
        assert_eq!(r.status(), 423);
        assert_eq!(r.headers()[CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(r.headers()[RETRY_AFTER], "2");
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["type"], "about:blank");
        assert_eq!(v["status"], 423);
        assert_eq!(v["title"], "Locked");
        assert_eq!(v["detail"], "held");
    }

    /// Every status the crate answers with, and the ones an application is likely to put
    /// in a `Problem`, named as RFC 9110 (section 15), RFC 4918 (423), RFC 6585 (428, 429)
    /// and RFC 8470 (425) name them.
    #[test]
    fn titles_are_the_rfc_names_of_the_statuses() {
        let titles = [
            (203, "Non-Authoritative Information"),
            (400, "Bad Request"),
            (408, "Request Timeout"),
            (409, "Conflict"),
            (413, "Content Too Large"),
            (415, "Unsupported Media Type"),
            (422, "Unprocessable Content"),
            (423, "Locked"),
            (425, "Too Early"),
            (428, "Precondition Required"),
            (429, "Too Many Requests"),
            (500, "Internal Server Error"),
            (503, "Service Unavailable"),
            (599, "Error"),
        ];
        for (code, title) in titles {
            let status = StatusCode::from_u16(code).unwrap();
            let problem = Problem::new(status, "detail");
            assert_eq!(problem.title(), title, "{code}");
            let r = Response::<Bytes>::from(problem);
            let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
            assert_eq!(v["title"], title, "{code}");
        }
    }
}
