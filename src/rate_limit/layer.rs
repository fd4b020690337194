use std::borrow::Cow;
use std::fmt;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use tower_layer::Layer;

use super::key::{GlobalKey, HeaderOrPeerIp, PeerIpKey};
use super::service::RateLimit;
use crate::backend::rate_limit::RateLimiter;
use crate::backend::rate_limit::quota::{Quota, Usage};
use crate::key::{FnKey, HeaderKey, KeyError, KeyExtractor};
use crate::problem::{Problem, retry_after_secs};

/// `RateLimit-Policy` (IETF draft "RateLimit header fields for HTTP").
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF draft "RateLimit header fields for HTTP").
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// A [`Layer`] that counts each request against a fixed-window limit per key and answers
/// **429 Too Many Requests** over it; see the [module docs](crate::rate_limit).
///
/// Cloning the layer shares its backend, key extractor and settings.
///
/// ```
/// use std::time::Duration;
/// use axum::{Router, routing::post};
/// use tower_redlock::{Quota, RateLimitLayer};
///
/// # fn main() -> Result<(), tower_redlock::rate_limit::QuotaError> {
/// let app: Router = Router::new()
///     .route("/search", post(|| async { "results" }))
///     .layer(RateLimitLayer::by_peer_ip(Quota::new(100, Duration::from_secs(60))?).scope("search"));
/// # Ok(()) }
/// ```
pub struct RateLimitLayer<K> {
    extractor: Arc<K>,
    config: Arc<Config>,
}

/// Everything but the extractor, shared by the service and its futures.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) limiter: RateLimiter,
    pub(crate) quota: Quota,
    pub(crate) scope: Option<Arc<str>>,
    pub(crate) required: bool,
    pub(crate) fail_open: bool,
    legacy_headers: bool,
    pub(crate) missing_detail: Cow<'static, str>,
    /// The policy name as an RFC 8941 string, quotes included: `"default"`.
    name_item: Arc<str>,
    /// `"default";q=100;w=60`, built once per quota and name.
    policy_value: HeaderValue,
    /// The limit, for `X-RateLimit-Limit`.
    limit_value: HeaderValue,
    exceeded_detail: Cow<'static, str>,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("limiter", &self.limiter)
            .field("quota", &self.quota)
            .field("scope", &self.scope)
            .field("required", &self.required)
            .field("fail_open", &self.fail_open)
            .field("legacy_headers", &self.legacy_headers)
            .field("policy", &self.policy_value)
            .finish()
    }
}

impl Config {
    fn new(quota: Quota) -> Self {
        let mut config = Self {
            limiter: RateLimiter::default(),
            quota,
            scope: None,
            required: true,
            fail_open: true,
            legacy_headers: false,
            missing_detail: Cow::Borrowed("The request carries no rate limit key."),
            name_item: Arc::from(sf_string("default")),
            policy_value: HeaderValue::from_static(""),
            limit_value: HeaderValue::from(quota.limit()),
            exceeded_detail: Cow::Borrowed(""),
        };
        config.rebuild();
        config
    }

    /// Recomputes the values that depend on the quota and the policy name.
    fn rebuild(&mut self) {
        let quota = self.quota;
        let policy = format!(
            "{};q={};w={}",
            self.name_item,
            quota.limit(),
            quota.window_secs()
        );
        self.policy_value = HeaderValue::try_from(policy)
            .expect("the policy name is printable ASCII, checked by policy_name");
        self.limit_value = HeaderValue::from(quota.limit());
        self.exceeded_detail = Cow::Owned(format!(
            "Too many requests: at most {} per {}; retry after the Retry-After delay.",
            quota.limit(),
            describe_window(quota.window())
        ));
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
        let mut value = String::with_capacity(self.name_item.len() + 32);
        let _ = write!(value, "{};r={remaining};t={reset}", self.name_item);
        if let Ok(value) = HeaderValue::try_from(value) {
            headers.append(RATELIMIT.clone(), value);
        }
        if self.legacy_headers {
            headers.insert(X_RATELIMIT_LIMIT.clone(), self.limit_value.clone());
            headers.insert(X_RATELIMIT_REMAINING.clone(), HeaderValue::from(remaining));
            headers.insert(X_RATELIMIT_RESET.clone(), HeaderValue::from(reset));
        }
    }

    /// 429 with `Retry-After` and the rate limit headers.
    pub(crate) fn too_many<B: From<Bytes>>(&self, usage: &Usage) -> Response<B> {
        let mut response =
            Problem::new(StatusCode::TOO_MANY_REQUESTS, self.exceeded_detail.clone())
                .retry_after(usage.reset_after())
                .into_response();
        self.decorate(response.headers_mut(), Some(usage));
        response
    }

    /// 503 with `Retry-After: 1` and the policy, without internal details.
    pub(crate) fn unavailable<B: From<Bytes>>(&self) -> Response<B> {
        let mut response = Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "The rate limit service is unavailable; retry later.",
        )
        .retry_after(Duration::from_secs(1))
        .into_response();
        self.decorate(response.headers_mut(), None);
        response
    }

    /// 400 for a missing key.
    pub(crate) fn missing<B: From<Bytes>>(&self) -> Response<B> {
        Problem::new(StatusCode::BAD_REQUEST, self.missing_detail.clone()).into_response()
    }

    /// 400 for an invalid key.
    pub(crate) fn invalid<B: From<Bytes>>(error: &KeyError) -> Response<B> {
        let detail = match error {
            KeyError::Empty => "The rate limit key is empty.".to_owned(),
            KeyError::TooLong { len, max } => {
                format!("The rate limit key is {len} bytes long; at most {max} are accepted.")
            }
            KeyError::ControlCharacter => {
                "The rate limit key contains a control character.".to_owned()
            }
            other => format!("Invalid rate limit key: {other}."),
        };
        Problem::new(StatusCode::BAD_REQUEST, detail).into_response()
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

impl<K> Clone for RateLimitLayer<K> {
    fn clone(&self) -> Self {
        Self {
            extractor: self.extractor.clone(),
            config: self.config.clone(),
        }
    }
}

impl<K: fmt::Debug> fmt::Debug for RateLimitLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("extractor", &self.extractor)
            .field("config", &self.config)
            .finish()
    }
}

impl RateLimitLayer<PeerIpKey> {
    /// Limits each peer IP address ([`PeerIpKey`]; axum's `ConnectInfo<SocketAddr>`, so
    /// serve with `into_make_service_with_connect_info::<SocketAddr>()`). The scope is
    /// `"ip"`. Behind a proxy every client has the proxy's address; see [`PeerIpKey`]
    /// for why `X-Forwarded-For` is not read.
    pub fn by_peer_ip(quota: Quota) -> Self {
        let mut layer = Self::new(PeerIpKey, quota);
        layer.config_mut().missing_detail = Cow::Borrowed("The client's address is unknown.");
        layer
    }
}

impl RateLimitLayer<GlobalKey> {
    /// One limit for all requests through the layer, whoever sends them ([`GlobalKey`]).
    /// Give each such layer its own [`scope`](Self::scope), or they share one count.
    pub fn global(quota: Quota) -> Self {
        Self::new(GlobalKey, quota)
    }
}

impl RateLimitLayer<HeaderKey> {
    /// Limits each value of a header, such as an API key. The scope is the header name,
    /// the method and the route (as [`HeaderKey`]), so each endpoint counts on its own
    /// unless you set a [`scope`](Self::scope). A request without the header gets 400
    /// (see [`optional`](Self::optional)). Anyone can send any value: use it for keys
    /// that an earlier layer has verified.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name; names are usually literals, so this is a
    /// programming error.
    pub fn by_header(name: impl AsRef<str>, quota: Quota) -> Self {
        let name = header_name(name.as_ref());
        let detail = format!("This endpoint requires a non-empty {name} header.");
        let mut layer = Self::new(HeaderKey::new(name), quota);
        layer.config_mut().missing_detail = Cow::Owned(detail);
        layer
    }
}

impl RateLimitLayer<HeaderOrPeerIp> {
    /// Limits each value of a header when the request has it (a client id), else each peer
    /// IP ([`HeaderOrPeerIp`]). The scope is `"client"`.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    pub fn by_header_or_peer_ip(name: impl AsRef<str>, quota: Quota) -> Self {
        let name = header_name(name.as_ref());
        let detail =
            format!("The request has no {name} header and the client's address is unknown.");
        let mut layer = Self::new(HeaderOrPeerIp::new(name), quota);
        layer.config_mut().missing_detail = Cow::Owned(detail);
        layer
    }
}

fn header_name(name: &str) -> HeaderName {
    HeaderName::try_from(name).unwrap_or_else(|e| panic!("invalid header name {name:?}: {e}"))
}

#[cfg(feature = "axum")]
impl RateLimitLayer<crate::key::PathParamKey> {
    /// Limits each value of an axum path parameter, such as `item_id` in
    /// `/items/{item_id}/buy`: a limit per resource, across clients. The scope is the route
    /// up to the parameter. Add it with `Router::route_layer` (or `Router::layer` after the
    /// routes) so that the router has found the parameter; a route without it gets 400.
    pub fn by_path_param(name: impl Into<Cow<'static, str>>, quota: Quota) -> Self {
        let key = crate::key::PathParamKey::new(name);
        let detail = format!(
            "The route has no path parameter `{}` to rate limit on.",
            key.name()
        );
        let mut layer = Self::new(key, quota);
        layer.config_mut().missing_detail = Cow::Owned(detail);
        layer
    }
}

impl<F> RateLimitLayer<FnKey<F>>
where
    F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
{
    /// Limits each value that `f` returns for the request head; `None` means the request
    /// has no key (400 unless [`optional`](Self::optional)). The scope is empty unless
    /// you set one, so set one.
    ///
    /// ```
    /// use tower_redlock::{Quota, RateLimitLayer};
    ///
    /// // 1000 requests an hour per tenant.
    /// let layer = RateLimitLayer::by_fn(
    ///     |parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned),
    ///     "1000/1h".parse::<Quota>()?,
    /// )
    /// .scope("tenant");
    /// # Ok::<(), tower_redlock::rate_limit::QuotaError>(())
    /// ```
    pub fn by_fn(f: F, quota: Quota) -> Self {
        Self::new(FnKey::new(f), quota)
    }
}

impl<K: KeyExtractor> RateLimitLayer<K> {
    /// Limits each key that `extractor` finds to `quota`. Defaults: the process-wide
    /// in-process backend ([`RateLimiter::default`]), the extractor's scope, key required,
    /// fail open, policy name `"default"`, no legacy headers.
    pub fn new(extractor: K, quota: Quota) -> Self {
        Self {
            extractor: Arc::new(extractor),
            config: Arc::new(Config::new(quota)),
        }
    }
}

impl<K> RateLimitLayer<K> {
    fn config_mut(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// The store of the counts: a [`RedisRateLimiter`](crate::RedisRateLimiter) to share
    /// one limit across replicas, a [`MemoryRateLimiter`](crate::MemoryRateLimiter), or a
    /// [`RateLimiter`]. Default: the process-wide in-process store
    /// ([`RateLimiter::default`]), which counts per process.
    #[must_use]
    pub fn backend(mut self, limiter: impl Into<RateLimiter>) -> Self {
        self.config_mut().limiter = limiter.into();
        self
    }

    /// A fixed scope instead of the extractor's: the key becomes `{scope}:{value}`, stored
    /// as `{prefix}{scope}:{value}`. Layers with the same scope and value share one count,
    /// so give layers with different quotas different scopes. Default: `"ip"` for
    /// `by_peer_ip`, `"global"` for `global`, `"client"` for `by_header_or_peer_ip`, the
    /// header name, method and route for `by_header`, the route up to the parameter for
    /// `by_path_param`, empty for `by_fn`.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.config_mut().scope = Some(Arc::from(scope.into()));
        self
    }

    /// Lets requests without a key through, uncounted and without rate limit headers,
    /// instead of answering 400. An invalid key is still a 400.
    #[must_use]
    pub fn optional(mut self) -> Self {
        self.config_mut().required = false;
        self
    }

    /// What to do when the store cannot count (Redis down or slower than its timeout):
    /// `true` runs the inner service uncounted (with `RateLimit-Policy` but no
    /// `RateLimit` header, and no [`Usage`] in the request extensions), `false` answers
    /// **503 Service Unavailable** with `Retry-After: 1` and no internal details. Either
    /// way a warning is logged.
    ///
    /// Default: `true`, fail open. A rate limit protects capacity; it does not make a
    /// request correct, as a lock does. Failing closed would turn an outage of the limit's
    /// Redis into an outage of every limited route. Choose `false` where the limit is a
    /// security control, such as login attempts or a paid quota.
    #[must_use]
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config_mut().fail_open = fail_open;
        self
    }

    /// Also sends the legacy headers `X-RateLimit-Limit` (the limit),
    /// `X-RateLimit-Remaining` and `X-RateLimit-Reset` (seconds until the window resets,
    /// a delay, not a timestamp) wherever `RateLimit` is sent. Default: `false`.
    #[must_use]
    pub fn legacy_headers(mut self, enabled: bool) -> Self {
        self.config_mut().legacy_headers = enabled;
        self
    }

    /// The policy name in `RateLimit-Policy` and `RateLimit`. Default `"default"`. When
    /// several rate limit layers answer one request, each adds its own item to both
    /// headers: give them different names so clients can tell them apart.
    ///
    /// # Panics
    ///
    /// When `name` has characters other than printable ASCII (space to `~`), which an
    /// RFC 8941 string cannot carry.
    #[must_use]
    pub fn policy_name(mut self, name: impl AsRef<str>) -> Self {
        let name = name.as_ref();
        assert!(
            name.chars().all(|c| matches!(c, ' '..='~')),
            "invalid rate limit policy name {name:?}: use printable ASCII"
        );
        let config = self.config_mut();
        config.name_item = Arc::from(sf_string(name));
        config.rebuild();
        self
    }

    /// The quota.
    pub fn quota(&self) -> Quota {
        self.config.quota
    }
}

impl<S, K> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, self.extractor.clone(), self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(count: u64, limit: u64, reset_ms: u64) -> Usage {
        Usage {
            count,
            limit,
            reset_after: Duration::from_millis(reset_ms),
        }
    }

    fn config(quota: &str) -> Config {
        Config::new(quota.parse().unwrap())
    }

    #[test]
    fn policy_header_is_precomputed_with_window_in_seconds_rounded_up() {
        assert_eq!(config("100/60").policy_value, "\"default\";q=100;w=60");
        assert_eq!(config("5/1500ms").policy_value, "\"default\";q=5;w=2");
    }

    #[test]
    fn ratelimit_header_counts_down_and_rounds_reset_up() {
        let c = config("3/2");
        let mut headers = HeaderMap::new();
        c.decorate(&mut headers, Some(&usage(1, 3, 1200)));
        assert_eq!(headers[&RATELIMIT], "\"default\";r=2;t=2");
        assert_eq!(headers[&RATELIMIT_POLICY], "\"default\";q=3;w=2");
        assert!(!headers.contains_key(&X_RATELIMIT_LIMIT));
        let mut headers = HeaderMap::new();
        c.decorate(&mut headers, Some(&usage(7, 3, 1)));
        assert_eq!(headers[&RATELIMIT], "\"default\";r=0;t=1");
    }

    #[test]
    fn legacy_headers_when_enabled() {
        let mut c = config("10/60");
        c.legacy_headers = true;
        let mut headers = HeaderMap::new();
        c.decorate(&mut headers, Some(&usage(4, 10, 30_001)));
        assert_eq!(headers[&X_RATELIMIT_LIMIT], "10");
        assert_eq!(headers[&X_RATELIMIT_REMAINING], "6");
        assert_eq!(headers[&X_RATELIMIT_RESET], "31");
    }

    #[test]
    fn policy_name_is_an_escaped_sf_string() {
        let layer =
            RateLimitLayer::global("1/1".parse().unwrap()).policy_name(r#"per "ip" \ hour"#);
        assert_eq!(layer.config.policy_value, r#""per \"ip\" \\ hour";q=1;w=1"#);
    }

    #[test]
    #[should_panic(expected = "printable ASCII")]
    fn policy_name_refuses_control_characters() {
        let _ = RateLimitLayer::global("1/1".parse().unwrap()).policy_name("a\nb");
    }

    #[test]
    fn no_count_means_policy_only() {
        let c = config("3/2");
        let mut headers = HeaderMap::new();
        c.decorate(&mut headers, None);
        assert!(headers.contains_key(&RATELIMIT_POLICY));
        assert!(!headers.contains_key(&RATELIMIT));
    }

    #[test]
    fn too_many_has_retry_after_at_or_after_the_reset() {
        let c = config("3/60");
        let r: Response<Bytes> = c.too_many(&usage(4, 3, 2_001));
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[http::header::RETRY_AFTER], "3");
        assert_eq!(r.headers()[&RATELIMIT], "\"default\";r=0;t=3");
        assert_eq!(
            r.headers()[http::header::CONTENT_TYPE],
            crate::problem::PROBLEM_JSON
        );
    }
}
