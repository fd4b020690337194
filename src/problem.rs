//! Rejections as `application/problem+json` responses (RFC 9457).

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::error::LockError;

/// The media type of RFC 9457 problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An HTTP answer given instead of running the inner service: a status, an RFC 9457
/// problem details body (`type`, `title`, `status`, `detail`), and `Retry-After` where the
/// client may try again.
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
    status: StatusCode,
    detail: Cow<'static, str>,
    retry_after: Option<Duration>,
}

impl Problem {
    /// A problem with `status` and a human-readable `detail`.
    pub fn new(status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            detail: detail.into(),
            retry_after: None,
        }
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

    /// The `Retry-After` delay, if any.
    pub fn retry_after_delay(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The problem a lock error becomes: `taken_status` (409 or 423) with `Retry-After`
    /// when the lock is held, 400 for an invalid key, 500 for an unsupported request, 503
    /// with `Retry-After: 1` when the backend cannot answer (without internal details,
    /// which are logged instead).
    pub fn from_lock_error(error: &LockError, taken_status: StatusCode) -> Self {
        match error {
            LockError::Taken { retry_after } => {
                let detail = if taken_status == StatusCode::CONFLICT {
                    "A request with the same key is still in progress."
                } else {
                    "The resource is locked by another request; retry after the Retry-After delay."
                };
                Problem::new(taken_status, detail).retry_after(*retry_after)
            }
            LockError::InvalidKey(e) => {
                Problem::new(StatusCode::BAD_REQUEST, format!("Invalid lock key: {e}."))
            }
            LockError::Unsupported(_) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "The server is misconfigured; the details are in its log.",
            ),
            _ => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "The lock service is unavailable; retry later.",
            )
            .retry_after(Duration::from_secs(1)),
        }
    }

    /// The answer to a server mistake: 500 with nothing internal in it (the details go
    /// to the log).
    #[cfg(any(
        feature = "lock",
        feature = "rate-limit",
        feature = "concurrency-limit"
    ))]
    pub(crate) fn misconfigured() -> Self {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "The server is misconfigured; the details are in its log.",
        )
    }
}

impl<B: From<Bytes>> From<Problem> for Response<B> {
    /// The `application/problem+json` response: the status, the body, and `Retry-After`
    /// when set.
    fn from(problem: Problem) -> Self {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": problem.status.canonical_reason().unwrap_or("Error"),
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
        assert_eq!(v["status"], 423);
        assert_eq!(v["title"], "Locked");
        assert_eq!(v["detail"], "held");
    }
}
