use std::borrow::Cow;
use std::time::Duration;

#[cfg(doc)]
use http::HeaderName;

use super::policy::ConcurrencyPolicy;
use crate::backend::concurrency::ConcurrencyLimiter;
use crate::key::{FnKey, GlobalKey, HeaderKey, IntoHeaderName, KeyExtractor};
use crate::keyed::{Keyed, KeyedLayer};
use crate::renewal::Renewal;

crate::keyed::keyed_middleware! {
    /// A [`Layer`](tower_layer::Layer) that lets at most `limit` requests per key run at once,
    /// across every replica that shares its store, and answers **503 Service Unavailable**
    /// with `Retry-After` over it; see the [module docs](crate::concurrency).
    ///
    /// Cloning the layer shares its store, key extractor and settings.
    ///
    /// ```
    /// use axum::{Router, routing::post};
    /// use tower_redlock::ConcurrencyLimitLayer;
    ///
    /// // At most 8 exports in flight per tenant.
    /// let app: Router = Router::new()
    ///     .route("/export", post(|| async { "exported" }))
    ///     .layer(ConcurrencyLimitLayer::by_header("X-Tenant", 8));
    /// ```
    pub struct ConcurrencyLimitLayer<K> = ConcurrencyPolicy;

    /// The service of [`ConcurrencyLimitLayer`]: takes a permit before calling the inner
    /// service `S`. (Named apart from `tower::limit::ConcurrencyLimit`, a limit per
    /// service.)
    pub struct ConcurrencyLimitService<S, K> = Keyed<S, K, ConcurrencyPolicy>, via [.inner];
}

impl<S, K> tower_layer::Layer<S> for ConcurrencyLimitLayer<K> {
    type Service = ConcurrencyLimitService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimitService {
            inner: Keyed::new(inner, self.keyed.clone()),
        }
    }
}

impl<S, K: KeyExtractor> ConcurrencyLimitService<S, K> {
    /// A [`ConcurrencyLimitLayer`] over `extractor`; the same as
    /// [`ConcurrencyLimitLayer::new`].
    pub fn layer(extractor: K, limit: u32) -> ConcurrencyLimitLayer<K> {
        ConcurrencyLimitLayer::new(extractor, limit)
    }
}

impl ConcurrencyLimitLayer<GlobalKey> {
    /// One limit for all requests through the layer ([`GlobalKey`]): at most `limit` in
    /// flight on the route (or the service, or a downstream it calls), whoever sends them.
    /// Give each such layer its own [`scope`](Self::scope), or they share one limit.
    pub fn global(limit: u32) -> Self {
        Self::new(GlobalKey, limit)
    }
}

#[cfg(feature = "client-ip")]
#[cfg_attr(docsrs, doc(cfg(feature = "client-ip")))]
impl ConcurrencyLimitLayer<crate::key::ClientIpKey> {
    /// At most `limit` requests in flight per client IP address
    /// ([`ClientIpKey`](crate::key::ClientIpKey)): the peer's, or behind trusted proxies the
    /// one their header gives; IPv6 clients by /64. `key` is a `ClientIpKey` or a bare
    /// [`ClientIpSource`](crate::key::ClientIpSource), which trusts no proxy. The scope is
    /// `"client-ip"`; serve with `into_make_service_with_connect_info::<SocketAddr>()`.
    pub fn by_client_ip(key: impl Into<crate::key::ClientIpKey>, limit: u32) -> Self {
        let key = key.into();
        let missing = key.missing_detail();
        Self::from_keyed(KeyedLayer::from_parts(
            key,
            ConcurrencyPolicy::new(limit),
            missing,
        ))
    }
}

impl ConcurrencyLimitLayer<HeaderKey> {
    /// Limits each value of a header, such as a tenant id. The scope is the header name
    /// alone (the key `x-tenant:acme`), so the limit is the tenant's across every route
    /// the layer guards; set a [`scope`](Self::scope) per route for per-route limits. A
    /// request without the header gets 400 (see [`optional`](Self::optional)).
    ///
    /// `name` is a [`HeaderName`] or a string ([`IntoHeaderName`]).
    ///
    /// # Panics
    ///
    /// When `name` is a string that is not a header name.
    pub fn by_header(name: impl IntoHeaderName, limit: u32) -> Self {
        Self::from_keyed(KeyedLayer::from_header(name, ConcurrencyPolicy::new(limit)).tenant_wide())
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl ConcurrencyLimitLayer<crate::key::PathParamKey> {
    /// Limits each value of an axum path parameter, such as `item_id` in
    /// `/items/{item_id}/buy`. The scope is the route up to the parameter. Where to add
    /// it: [`PathParamKey`](crate::key::PathParamKey).
    ///
    /// # Panics
    ///
    /// When `name` is empty.
    pub fn by_path_param(name: impl Into<Cow<'static, str>>, limit: u32) -> Self {
        Self::from_keyed(KeyedLayer::from_path_param(
            name,
            ConcurrencyPolicy::new(limit),
            "The request has no path parameter to limit on.",
        ))
    }
}

impl<F> ConcurrencyLimitLayer<FnKey<F>>
where
    F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
{
    /// Limits each value that `f` returns for the request head; `None` means the request
    /// has no key (400 unless [`optional`](Self::optional)). The scope is empty unless
    /// you set one, so set one.
    pub fn by_fn(f: F, limit: u32) -> Self {
        Self::new(FnKey::new(f), limit)
    }
}

impl<K: KeyExtractor> ConcurrencyLimitLayer<K> {
    /// At most `limit` requests in flight per key that `extractor` finds (a limit of 0
    /// answers every keyed request 503). Defaults: the app's default store
    /// ([`ConcurrencyLimiter::default`]), the extractor's scope, key required, fail
    /// open, no wait ([`max_wait`](Self::max_wait) zero), [`Renewal::default`],
    /// `Retry-After: 1` over the limit.
    pub fn new(extractor: K, limit: u32) -> Self {
        Self::from_keyed(KeyedLayer::from_parts(
            extractor,
            ConcurrencyPolicy::new(limit),
            Cow::Borrowed("The request carries no concurrency limit key."),
        ))
    }
}

impl<K> ConcurrencyLimitLayer<K> {
    crate::keyed::layer_setters! {
        /// The store of the permits: a
        /// [`RedisConcurrencyLimiter`](crate::RedisConcurrencyLimiter) to share one limit
        /// across replicas, a
        /// [`MemoryConcurrencyLimiter`](crate::MemoryConcurrencyLimiter), or a
        /// [`ConcurrencyLimiter`]. Default: the app's default store
        /// ([`ConcurrencyLimiter::set_default`]'s, else the in-process fallback, which
        /// limits per process, and refuses every request with a 500 in a process that
        /// built a `RedisConcurrencyLimiter`: see [`ConcurrencyLimiter::default`]).
        fn backend(limiter: impl Into<ConcurrencyLimiter>) => limiter;

        /// How long a request over the limit waits for a permit before it is answered 503.
        /// Default zero: answered at once. It is woken by any replica's release of a permit
        /// on its key (on Redis through pub/sub), with a timer from 5 ms doubling to 100 ms
        /// as fallback, and never waits past `max_wait`.
        fn max_wait(max_wait: Duration) => max_wait;

        /// How a Redis permit is renewed while its request runs. Default: every TTL/3, for
        /// at most 10 × TTL in all ([`Renewal::default`]); a request that runs longer keeps
        /// running, but its permit then expires and stops counting. In-process permits
        /// never expire and need no renewal.
        fn renewal(renewal: Renewal) => renewal;

        /// The `Retry-After` of the 503 over the limit, in whole seconds rounded up (at
        /// least 1). Default 1 s: a permit frees when any request in flight ends, which the
        /// layer cannot foresee.
        fn retry_after(after: Duration) => retry_after;
    }

    /// The limit: at most this many requests in flight per key.
    pub fn limit(&self) -> u32 {
        self.keyed.core.policy.limit
    }
}
