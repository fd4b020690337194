//! What [`RateLimitLayer`](super::RateLimitLayer) does with a key: count it, answer 429
//! over the limit, and tell the client where it stands in the `RateLimit` headers.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Response, response};

use crate::backend::fallback::User;
use crate::backend::rate_limit::quota::{Quota, Usage};
use crate::backend::rate_limit::{RateLimitError, RateLimiter};
use crate::future::Watch;
use crate::future::{BoxError, boxed};
use crate::keyed::policy::{Decision, End, Hold, Permit, Policy, Release, Sealed, Verdict};
use crate::observe::RateLimitResult;
use crate::problem::retry_after_secs;
use crate::rejection::{RejectedBy, Rejection, RejectionKind};

// The IETF draft "RateLimit header fields for HTTP", and the legacy headers.
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The policy of [`RateLimitLayer`](super::RateLimitLayer): its store, its quota and its
/// headers. Set through the layer's builder methods.
#[derive(Clone, Debug)]
pub struct RateLimitPolicy {
    pub(crate) limiter: RateLimiter,
    pub(crate) headers: Arc<Headers>,
    /// The in-process limit while the store is unavailable; `None` runs the request
    /// uncounted then.
    pub(crate) outage: Option<Arc<OutageLimit>>,
}

/// The limit a replica applies on its own while its store is unavailable: the layer's
/// quota divided among `replicas`, counted in this process.
#[derive(Debug)]
pub(crate) struct OutageLimit {
    pub(crate) quota: Quota,
    limiter: super::MemoryRateLimiter,
}

impl OutageLimit {
    pub(crate) fn new(quota: Quota, replicas: u32) -> Option<Arc<Self>> {
        (replicas > 0).then(|| {
            Arc::new(Self {
                quota: quota.divided(replicas),
                limiter: Default::default(),
            })
        })
    }
}

impl RateLimitPolicy {
    /// The defaults: the process-wide store, fail open, policy `"default"`, no legacy headers.
    pub(crate) fn new(quota: Quota) -> Self {
        Self {
            limiter: RateLimiter::default(),
            headers: Arc::new(Headers::new(quota, "default", false)),
            outage: OutageLimit::new(quota, 1),
        }
    }

    pub(crate) fn quota(&self) -> Quota {
        self.headers.quota
    }

    /// The verdict on a count; `outage` is the replica's own limit when the store cannot
    /// count (for a Redis store only: the in-process one fails only when full).
    fn verdict(
        &self,
        counted: Result<Usage, RateLimitError>,
        outage: Option<(&OutageLimit, &str)>,
    ) -> Verdict<RatePermit> {
        match &counted {
            Ok(usage) if usage.is_exceeded() => RateLimitResult::Limited,
            Ok(_) => RateLimitResult::Allowed,
            Err(RateLimitError::InvalidKey(_)) => RateLimitResult::Invalid,
            Err(
                RateLimitError::Unavailable(_)
                | RateLimitError::StoreFull { .. }
                | RateLimitError::NoBackendChosen,
            ) => RateLimitResult::Unavailable,
        }
        .count();
        let permit = |usage| RatePermit {
            headers: self.headers.clone(),
            usage,
        };
        match counted {
            Ok(usage) if usage.is_exceeded() => Verdict::answer(self.headers.too_many(&usage)),
            Ok(usage) => Verdict::Admit(permit(Some(usage))),
            Err(RateLimitError::InvalidKey(e)) => Verdict::answer(
                Rejection::invalid_key(RejectedBy::RateLimit, Self::REJECTED_BY.key_noun(), &e)
                    .into(),
            ),
            // The fallback that refuses has logged the fix once (`Policy::refuses`).
            Err(RateLimitError::NoBackendChosen) => {
                Verdict::answer(Rejection::misconfigured(RejectedBy::RateLimit).into())
            }
            // Failing open, the request runs counted by this replica's own limit (over it,
            // 429), or uncounted without one, with the policy header.
            Err(e) => {
                let usage = outage.and_then(|(o, key)| o.limiter.hit_key(key, o.quota).ok());
                if let Some(usage) = usage.filter(Usage::is_exceeded) {
                    return Verdict::answer(self.headers.too_many(&usage));
                }
                Verdict::unavailable(Box::new(e), self.headers.unavailable(), Some(permit(usage)))
            }
        }
    }
}

impl Sealed for RateLimitPolicy {}

impl Policy for RateLimitPolicy {
    type Permit = RatePermit;
    const REJECTED_BY: RejectedBy = RejectedBy::RateLimit;
    const FAIL_OPEN: bool = true;

    fn bad_key(&self, _missing: bool) {
        RateLimitResult::Invalid.count();
    }

    #[inline]
    fn refuses(&self) -> bool {
        self.limiter.refuses(User::RateLimitLayer)
    }

    fn decide(&self, key: &str, _parts: &Parts) -> Decision<RatePermit> {
        let quota = self.headers.quota;
        if let Some(memory) = self.limiter.as_memory() {
            return Decision::Ready(self.verdict(memory.hit_key(key, quota), None));
        }
        let key = key.to_owned();
        let policy = self.clone();
        Decision::Pending(boxed(|| async move {
            let counted = policy.limiter.hit(&key, quota).await;
            let outage = policy.outage.as_deref().map(|o| (o, key.as_str()));
            policy.verdict(counted, outage)
        }))
    }
}

/// A counted request (uncounted when failing open): its usage goes on the request, its
/// headers on the response.
#[doc(hidden)]
#[derive(Debug)]
pub struct RatePermit {
    headers: Arc<Headers>,
    usage: Option<Usage>,
}

/// A count cannot be lost.
impl Watch for RatePermit {}

impl Permit for RatePermit {
    fn admit<B>(&mut self, request: &mut Request<B>) {
        if let Some(usage) = self.usage {
            request.extensions_mut().insert(usage);
        }
    }

    fn abort_on_loss(&self) -> bool {
        false
    }

    fn lost_response(self) -> Response<Bytes> {
        unreachable!("a rate limit permit is never lost")
    }

    fn lost_error(self) -> BoxError {
        unreachable!("a rate limit permit is never lost")
    }

    fn on_response(&mut self, head: &mut response::Parts) -> Hold {
        self.headers
            .decorate(&mut head.headers, self.usage.as_ref());
        Hold::Head
    }

    fn release(self, _end: End) -> Release {
        Release::Done
    }
}

/// The quota and the headers that tell it, built once per layer.
#[derive(Debug)]
pub(crate) struct Headers {
    pub(crate) quota: Quota,
    pub(crate) legacy: bool,
    pub(crate) name: String,
    /// The name as an RFC 8941 string, quotes included: `"default"`.
    name_item: Arc<str>,
    /// `"default";q=100;w=60`.
    pub(crate) policy_value: HeaderValue,
    /// The limit, for `X-RateLimit-Limit`.
    limit_value: HeaderValue,
    exceeded_detail: String,
}

impl Headers {
    /// Panics when `name` is not printable ASCII (the layer's builder checks it first).
    // Called with the default name or one `policy_name` checked: a mistake in the code.
    #[allow(clippy::expect_used)]
    pub(crate) fn new(quota: Quota, name: &str, legacy: bool) -> Self {
        let name_item = sf_string(name);
        let (q, w) = quota.policy();
        let policy = format!("{name_item};q={q};w={w}");
        Self {
            quota,
            legacy,
            name: name.to_owned(),
            policy_value: HeaderValue::try_from(policy)
                .expect("the policy name is printable ASCII, checked by policy_name"),
            limit_value: HeaderValue::from(q),
            name_item: Arc::from(name_item),
            exceeded_detail: format!(
                "Too many requests: at most {} per {}{}; retry after the Retry-After delay.",
                quota.limit(),
                describe_window(quota.window()),
                match quota.burst() {
                    Some(burst) => format!(", in bursts of up to {burst}"),
                    None => String::new(),
                }
            ),
        }
    }

    /// Adds `RateLimit-Policy`, and with a count `RateLimit` (and the legacy headers when
    /// enabled), to `headers`.
    pub(crate) fn decorate(&self, headers: &mut HeaderMap, usage: Option<&Usage>) {
        headers.append(RATELIMIT_POLICY.clone(), self.policy_value.clone());
        let Some(usage) = usage else {
            return;
        };
        let remaining = usage.remaining();
        let reset = retry_after_secs(usage.reset_after());
        // `"name";r=42;t=17`, without the formatting machinery (per request), in a buffer
        // exactly as long as the value, which becomes the header's bytes.
        let (mut r, mut t) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (r, t) = (r.format(remaining), t.format(reset));
        let mut value = Vec::with_capacity(self.name_item.len() + 6 + r.len() + t.len());
        for part in [&*self.name_item, ";r=", r, ";t=", t] {
            value.extend_from_slice(part.as_bytes());
        }
        if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from(value)) {
            headers.append(RATELIMIT.clone(), value);
        }
        if self.legacy {
            headers.insert(X_RATELIMIT_LIMIT.clone(), self.limit_value.clone());
            headers.insert(X_RATELIMIT_REMAINING.clone(), HeaderValue::from(remaining));
            headers.insert(X_RATELIMIT_RESET.clone(), HeaderValue::from(reset));
        }
    }

    /// 429 with `Retry-After` and the rate limit headers (RFC 6585, section 4).
    pub(crate) fn too_many(&self, usage: &Usage) -> Response<Bytes> {
        let mut response: Response<Bytes> = Rejection::new(
            RejectedBy::RateLimit,
            RejectionKind::Limited,
            self.exceeded_detail.clone(),
        )
        .retry_after(usage.retry_after())
        .into();
        self.decorate(response.headers_mut(), Some(usage));
        response
    }

    /// 503 with `Retry-After: 1` and the policy, without internal details.
    pub(crate) fn unavailable(&self) -> Response<Bytes> {
        let mut response: Response<Bytes> = Rejection::unavailable(RejectedBy::RateLimit).into();
        self.decorate(response.headers_mut(), None);
        response
    }
}

/// `60 s`, `1500 ms`.
fn describe_window(window: Duration) -> String {
    if window.subsec_millis() == 0 {
        format!("{} s", window.as_secs())
    } else {
        format!("{} ms", window.as_millis())
    }
}

/// `name` as an RFC 8941 sf-string (section 3.3.3): quoted, `"` and `\` escaped.
fn sf_string(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for c in name.chars() {
        if matches!(c, '"' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(count: u64, limit: u64, reset_ms: u64) -> Usage {
        Usage::fixed(count, limit, Duration::from_millis(reset_ms))
    }

    fn headers(quota: &str) -> Headers {
        Headers::new(quota.parse().unwrap(), "default", false)
    }

    fn decorated(headers: &Headers, usage: Option<Usage>) -> HeaderMap {
        let mut map = HeaderMap::new();
        headers.decorate(&mut map, usage.as_ref());
        map
    }

    #[test]
    fn policy_header_is_precomputed_with_window_in_seconds_rounded_up() {
        assert_eq!(headers("100/60").policy_value, "\"default\";q=100;w=60");
        assert_eq!(headers("5/1500ms").policy_value, "\"default\";q=5;w=2");
    }

    #[test]
    fn ratelimit_header_counts_down_and_rounds_reset_up() {
        let c = headers("3/2");
        let map = decorated(&c, Some(usage(1, 3, 1200)));
        assert_eq!(map[&RATELIMIT], "\"default\";r=2;t=2");
        assert_eq!(map[&RATELIMIT_POLICY], "\"default\";q=3;w=2");
        assert!(!map.contains_key(&X_RATELIMIT_LIMIT));
        let map = decorated(&c, Some(usage(7, 3, 1)));
        assert_eq!(map[&RATELIMIT], "\"default\";r=0;t=1");
    }

    #[test]
    fn legacy_headers_when_enabled() {
        let c = Headers::new("10/60".parse().unwrap(), "default", true);
        let map = decorated(&c, Some(usage(4, 10, 30_001)));
        assert_eq!(map[&X_RATELIMIT_LIMIT], "10");
        assert_eq!(map[&X_RATELIMIT_REMAINING], "6");
        assert_eq!(map[&X_RATELIMIT_RESET], "31");
    }

    #[test]
    fn no_count_means_policy_only() {
        let map = decorated(&headers("3/2"), None);
        assert!(map.contains_key(&RATELIMIT_POLICY));
        assert!(!map.contains_key(&RATELIMIT));
    }

    #[test]
    fn too_many_has_retry_after_at_or_after_the_reset() {
        let c = headers("3/60");
        let r = c.too_many(&usage(4, 3, 2_001));
        assert_eq!(r.status(), http::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[http::header::RETRY_AFTER], "3");
        assert_eq!(r.headers()[&RATELIMIT], "\"default\";r=0;t=3");
        let content_type = &r.headers()[http::header::CONTENT_TYPE];
        assert_eq!(content_type, crate::problem::PROBLEM_JSON);
    }
}
