use std::borrow::Cow;
use std::sync::Arc;

#[cfg(doc)]
use http::HeaderName;

use super::key::{HeaderOrPeerIp, PeerIpKey};
use super::policy::{Headers, RateLimitPolicy};
use crate::backend::rate_limit::RateLimiter;
use crate::backend::rate_limit::quota::Quota;
use crate::key::GlobalKey;
use crate::key::{FnKey, HeaderKey, IntoHeaderName, KeyExtractor};
use crate::keyed::{Keyed, KeyedLayer};

crate::keyed::keyed_middleware! {
    /// A [`Layer`](tower_layer::Layer) that counts each request against a fixed-window limit
    /// per key and answers **429 Too Many Requests** over it; see the
    /// [module docs](crate::rate_limit).
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
    pub struct RateLimitLayer<K> = RateLimitPolicy;

    /// The service of [`RateLimitLayer`]: counts each request before calling the inner
    /// service `S`. (Named apart from `tower::limit::RateLimit`, a limit per service.)
    pub struct RateLimitService<S, K> = Keyed<S, K, RateLimitPolicy>, via [.inner];
}

impl<S, K> tower_layer::Layer<S> for RateLimitLayer<K> {
    type Service = RateLimitService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService {
            inner: Keyed::new(inner, self.keyed.clone()),
        }
    }
}

impl<S, K: KeyExtractor> RateLimitService<S, K> {
    /// A [`RateLimitLayer`] over `extractor`; the same as [`RateLimitLayer::new`].
    pub fn layer(extractor: K, quota: Quota) -> RateLimitLayer<K> {
        RateLimitLayer::new(extractor, quota)
    }
}

impl RateLimitLayer<PeerIpKey> {
    /// Limits each peer IP address ([`PeerIpKey`]; axum's `ConnectInfo<SocketAddr>`, so
    /// serve with `into_make_service_with_connect_info::<SocketAddr>()`). The scope is
    /// `"ip"`. Behind a proxy every client has the proxy's address; see [`PeerIpKey`]
    /// for why `X-Forwarded-For` is not read. Served without the peer address, it answers
    /// **500** and logs the fix once.
    pub fn by_peer_ip(quota: Quota) -> Self {
        Self::new(PeerIpKey, quota)
    }
}

#[cfg(feature = "client-ip")]
#[cfg_attr(docsrs, doc(cfg(feature = "client-ip")))]
impl RateLimitLayer<crate::key::ClientIpKey> {
    /// Limits each client IP address ([`ClientIpKey`](crate::key::ClientIpKey)): the
    /// peer's, or behind trusted proxies the one their header gives, never the left-most
    /// `X-Forwarded-For` entry, which a client can forge; IPv6 clients by /64. `key` is a
    /// `ClientIpKey` or a bare [`ClientIpSource`](crate::key::ClientIpSource), which
    /// trusts no proxy. The scope is `"client-ip"`; serve with
    /// `into_make_service_with_connect_info::<SocketAddr>()`, or every request is a 500.
    ///
    /// ```
    /// use tower_redlock::RateLimitLayer;
    /// use tower_redlock::key::{ClientIpKey, ClientIpSource};
    ///
    /// let client = ClientIpKey::new(ClientIpSource::RightmostXForwardedFor)
    ///     .trusted_proxies(["10.0.0.0/8"])?;
    /// let layer = RateLimitLayer::by_client_ip(client, "100/60".parse()?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn by_client_ip(key: impl Into<crate::key::ClientIpKey>, quota: Quota) -> Self {
        let key = key.into();
        let missing = key.missing_detail();
        Self::from_keyed(KeyedLayer::from_parts(
            key,
            RateLimitPolicy::new(quota),
            missing,
        ))
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
    /// Limits each value of a header, such as an API key or a tenant id. The scope is the
    /// header name alone (the key `x-tenant:acme`), so the limit is the tenant's across
    /// every route the layer guards, and layers on other routers with the same header
    /// share it; set a [`scope`](Self::scope) per route for per-route limits. A request
    /// without the header gets 400 (see [`optional`](Self::optional)). Anyone can send
    /// any value: use it for keys that an earlier layer has verified.
    ///
    /// `name` is a [`HeaderName`] or a string ([`IntoHeaderName`]).
    ///
    /// # Panics
    ///
    /// When `name` is a string that is not a header name.
    pub fn by_header(name: impl IntoHeaderName, quota: Quota) -> Self {
        Self::from_keyed(KeyedLayer::from_header(name, RateLimitPolicy::new(quota)).tenant_wide())
    }
}

impl RateLimitLayer<HeaderOrPeerIp> {
    /// Limits each value of a header when the request has it (a client id), else each peer
    /// IP ([`HeaderOrPeerIp`]). The scope is `"client"`. A client that sets the header
    /// itself can send a new value with each request, and a new quota with it: use it for
    /// ids that an earlier layer has verified.
    ///
    /// `name` is a [`HeaderName`] or a string ([`IntoHeaderName`]).
    ///
    /// # Panics
    ///
    /// When `name` is a string that is not a header name.
    pub fn by_header_or_peer_ip(name: impl IntoHeaderName, quota: Quota) -> Self {
        let name = name.into_header_name("RateLimitLayer::by_header_or_peer_ip");
        Self::new(HeaderOrPeerIp::new(name), quota)
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl RateLimitLayer<crate::key::PathParamKey> {
    /// Limits each value of an axum path parameter, such as `item_id` in
    /// `/items/{item_id}/buy`: a limit per resource, across clients. The scope is the route
    /// up to the parameter. Where to add it: [`PathParamKey`](crate::key::PathParamKey).
    ///
    /// # Panics
    ///
    /// When `name` is empty.
    pub fn by_path_param(name: impl Into<Cow<'static, str>>, quota: Quota) -> Self {
        Self::from_keyed(KeyedLayer::from_path_param(
            name,
            RateLimitPolicy::new(quota),
            "The request has no path parameter to rate limit on.",
        ))
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
    /// Limits each key that `extractor` finds to `quota`. Defaults: the app's default
    /// store ([`RateLimiter::default`]), the extractor's scope, key required, fail open,
    /// policy name `"default"`, no legacy headers.
    pub fn new(extractor: K, quota: Quota) -> Self {
        Self::from_keyed(KeyedLayer::from_parts(
            extractor,
            RateLimitPolicy::new(quota),
            Cow::Borrowed("The request carries no rate limit key."),
        ))
    }
}

impl<K> RateLimitLayer<K> {
    crate::keyed::layer_setters! {
        /// The store of the counts: a [`RedisRateLimiter`](crate::RedisRateLimiter) to
        /// share one limit across replicas, a
        /// [`MemoryRateLimiter`](crate::MemoryRateLimiter), or a [`RateLimiter`]. Default:
        /// the app's default store ([`RateLimiter::set_default`]'s, else the in-process
        /// fallback, which counts per process, and refuses every request with a 500 in a
        /// process that built a `RedisRateLimiter`: see [`RateLimiter::default`]).
        fn backend(limiter: impl Into<RateLimiter>) => limiter;
    }

    /// How the limit holds while its store is unavailable (Redis down, or its outage
    /// breaker open), when the layer fails open (the default): each replica counts on its
    /// own, in process, with the quota divided by `replicas` (rounded up), so that the
    /// replicas together let about the quota through; over it they answer 429 as usual.
    /// Default 1: each replica allows the whole quota. 0 runs every request uncounted
    /// while the store is down. A layer that fails closed answers 503 within the limit
    /// and 429 over it.
    pub fn outage_replicas(mut self, replicas: u32) -> Self {
        let quota = self.policy_mut().quota();
        self.policy_mut().outage = super::policy::OutageLimit::new(quota, replicas);
        self
    }

    /// Also sends the legacy headers `X-RateLimit-Limit` (the limit),
    /// `X-RateLimit-Remaining` and `X-RateLimit-Reset` (seconds until the window resets,
    /// a delay, not a timestamp) wherever `RateLimit` is sent. Default: `false`.
    pub fn legacy_headers(mut self, enabled: bool) -> Self {
        let headers = &self.keyed.core.policy.headers;
        let headers = Arc::new(Headers::new(headers.quota, &headers.name, enabled));
        self.policy_mut().headers = headers;
        self
    }

    /// The policy name in `RateLimit-Policy` and `RateLimit`. Default `"default"`. When
    /// several rate limit layers answer one request, each adds its own item to both
    /// headers: give them different names so clients can tell them apart.
    ///
    /// # Panics
    ///
    /// When `name` has characters other than printable ASCII (space to `~`), which an RFC
    /// 8941 string cannot carry: a mistake in the code, found as the app is built.
    pub fn policy_name(mut self, name: impl AsRef<str>) -> Self {
        let name = name.as_ref();
        assert!(
            name.chars().all(|c| matches!(c, ' '..='~')),
            "RateLimitLayer::policy_name({name:?}): not printable ASCII, which the RateLimit \
             headers need"
        );
        let headers = &self.keyed.core.policy.headers;
        let rebuilt = Headers::new(headers.quota, name, headers.legacy);
        self.policy_mut().headers = Arc::new(rebuilt);
        self
    }

    /// The quota.
    pub fn quota(&self) -> Quota {
        self.keyed.core.policy.quota()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_name_is_an_escaped_sf_string() {
        let layer =
            RateLimitLayer::global("1/1".parse().unwrap()).policy_name(r#"per "ip" \ hour"#);
        assert_eq!(
            layer.keyed.core.policy.headers.policy_value,
            r#""per \"ip\" \\ hour";q=1;w=1"#
        );
    }

    #[test]
    #[should_panic(expected = "not printable ASCII")]
    fn policy_name_with_control_characters_is_refused_when_built() {
        let _ = RateLimitLayer::global("1/1".parse().unwrap()).policy_name("a\nb");
    }

    #[test]
    fn legacy_headers_keep_the_policy_name() {
        let layer = RateLimitLayer::global("1/1".parse().unwrap())
            .policy_name("burst")
            .legacy_headers(true);
        let headers = &layer.keyed.core.policy.headers;
        assert!(headers.legacy);
        assert_eq!(headers.policy_value, "\"burst\";q=1;w=1");
    }
}
