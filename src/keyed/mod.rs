//! The core every keyed middleware shares: [`LockLayer`](crate::LockLayer),
//! [`RateLimitLayer`](crate::RateLimitLayer), [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer)
//! and [`IdempotencyLayer`](crate::IdempotencyLayer) each wrap the core's layer with a
//! policy of their own, and their services the core's service. Their responses are the
//! [`ResponseFuture`] and [`ResponseBody`] of this module.
//!
//! One request through a keyed layer:
//!
//! 1. The service (`call`) takes the key value from the request
//!    with the layer's [`KeyExtractor`](crate::key::KeyExtractor) and checks it: **400**
//!    when required and missing, or invalid; **500** when the server is misconfigured
//!    (logged once per layer); through unguarded when the key is optional and absent.
//! 2. It writes the whole key, `{prefix}{scope}:{value}`, in a scratch buffer and asks the
//!    layer's policy for a decision: admit with a permit, answer (a problem), or run
//!    unguarded (the backend is down and the layer fails open). An in-process backend
//!    answers at once; a Redis one through a future that the [`ResponseFuture`] awaits.
//! 3. It calls the inner service it drove to readiness (clone and swap), with what the
//!    permit puts on the request (a lease status, a usage count).
//! 4. The [`ResponseFuture`] runs the inner future under the permit (never polled past a
//!    lease's validity), lets the permit add its headers, and either releases it or hands
//!    it to the [`ResponseBody`], which releases it as the body ends.

/// `get_ref`, `get_mut` and `into_inner` for a service whose inner service `S` is the
/// field `inner`, as tower-http's services have them.
macro_rules! inner_service_accessors {
    () => {
        /// Gets a reference to the inner service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// Gets a mutable reference to the inner service.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// Consumes `self`, returning the inner service.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}
pub(crate) use inner_service_accessors;

/// Builder methods that store their argument in one field of the layer's policy, each
/// with its own doc comment: `fn name(value: Type) => field;` becomes
/// `pub fn name(mut self, value: Type) -> Self`, which sets `self.policy_mut().field`
/// (through `.into()`, for an `impl Into<T>` argument) and returns the layer. The layer
/// type is `#[must_use]`, and so is every setter's result.
macro_rules! layer_setters {
    ($($(#[$attr:meta])* fn $name:ident($value:ident: $ty:ty) => $field:ident;)*) => {$(
        $(#[$attr])*
        pub fn $name(mut self, $value: $ty) -> Self {
            self.policy_mut().$field = $value.into();
            self
        }
    )*};
}
pub(crate) use layer_setters;

/// A middleware's public types over the keyed core: the layer `$layer<K>` (a
/// [`KeyedLayer`] with the policy `$policy`), with the settings every keyed layer has,
/// and the service `$service<S, K>` (the core's service `$inner`, reached through
/// `$($via)*` to the inner service `S`), which forwards every call to it. The middleware
/// writes its constructors, its own settings and its `Layer` impl.
macro_rules! keyed_middleware {
    (
        $(#[$layer_attr:meta])*
        pub struct $layer:ident<K> = $policy:ty;
        $(#[$service_attr:meta])*
        pub struct $service:ident<S, K> = $inner:ty, via [$($via:tt)*];
    ) => {
        $(#[$layer_attr])*
        #[must_use]
        pub struct $layer<K> {
            pub(crate) keyed: $crate::keyed::KeyedLayer<K, $policy>,
        }

        impl<K> Clone for $layer<K> {
            fn clone(&self) -> Self {
                Self { keyed: self.keyed.clone() }
            }
        }

        impl<K: std::fmt::Debug> std::fmt::Debug for $layer<K> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.keyed.fmt(f)
            }
        }

        impl<K> $layer<K> {
            pub(crate) fn from_keyed(keyed: $crate::keyed::KeyedLayer<K, $policy>) -> Self {
                Self { keyed }
            }

            /// The policy's settings, to change (a shared layer is copied first).
            pub(crate) fn policy_mut(&mut self) -> &mut $policy {
                self.keyed.policy_mut()
            }

            /// A fixed scope instead of the extractor's: the key becomes
            /// `{scope}:{value}`. Layers of one kind (and, for locks,
            /// [`Locked`](crate::Locked) extractors) with the same scope and value share a
            /// lock or a count. The scope is the server's: never build it from the
            /// request.
            pub fn scope(self, scope: impl Into<String>) -> Self {
                Self { keyed: self.keyed.scope(scope) }
            }

            /// Whether requests without a key pass through, unguarded, instead of getting
            /// **400**. Default `false`: the key is required. An invalid key is a 400
            /// either way, and a server misconfiguration a 500.
            pub fn optional(self, optional: bool) -> Self {
                Self { keyed: self.keyed.optional(optional) }
            }

            /// Whether the inner service runs when the backend cannot decide (Redis down,
            /// or slower than its timeout): `true` runs it unguarded, `false` answers
            /// **503 Service Unavailable** with `Retry-After: 1` and no internal details.
            /// Either way the counter `tower_redlock_store_unavailable_total` counts the
            /// request, and a warning is logged at most once per 10 s for each kind of
            /// layer. The default is one rule: limiters
            /// ([`RateLimitLayer`](crate::rate_limit#failing-open),
            /// [`ConcurrencyLimitLayer`](crate::concurrency#failing-open)) fail open, locks
            /// ([`LockLayer`](crate::lock#failing-open)) and idempotency fail closed.
            pub fn fail_open(self, fail_open: bool) -> Self {
                Self { keyed: self.keyed.fail_open(fail_open) }
            }

            /// Shadow (dry-run) mode: the layer decides as usual, counts and logs what it
            /// would have refused, and lets every request through to the inner service
            /// ([`Shadow`](crate::Shadow)). `true` or `false` sets it once; a
            /// [`Shadow`](crate::Shadow) switch kept by the application flips it at run
            /// time. Default off.
            pub fn shadow(self, shadow: impl Into<$crate::keyed::Shadow>) -> Self {
                Self { keyed: self.keyed.shadow(shadow.into()) }
            }

            /// Requests on these paths pass unguarded, whatever their key: for a layer in
            /// front of a whole server, its health checks and metrics. Each entry is an
            /// exact path (`/metrics`), or, ending with `/`, every path under it
            /// (`/grpc.health.v1.Health/`, the gRPC health service's methods). The path is
            /// the request URI's, as the layer sees it (inside an axum `nest`, without the
            /// nested prefix). Adds to earlier exemptions.
            ///
            /// ```
            /// # #[cfg(feature = "lock")] {
            /// use tower_redlock::LockLayer;
            ///
            /// // In front of a tonic server: the health service is never locked.
            /// let layer = LockLayer::by_header("x-order-id")
            ///     .exempt_paths(["/grpc.health.v1.Health/"]);
            /// # }
            /// ```
            pub fn exempt_paths<I>(mut self, paths: I) -> Self
            where
                I: IntoIterator,
                I::Item: AsRef<str>,
            {
                for path in paths {
                    let exemption = $crate::keyed::layer::Exemption::path(path.as_ref());
                    self.keyed = self.keyed.exempt(exemption);
                }
                self
            }

            /// Requests for which `exempt` returns `true` pass unguarded, whatever their
            /// key (a method, a header the server sets, a route). It runs on every request
            /// first, so keep it cheap. Adds to earlier exemptions.
            pub fn exempt_if<F>(self, exempt: F) -> Self
            where
                F: Fn(&http::request::Parts) -> bool + Send + Sync + 'static,
            {
                let exemption = $crate::keyed::layer::Exemption::If(std::sync::Arc::new(exempt));
                Self { keyed: self.keyed.exempt(exemption) }
            }

            /// Answers this layer's refusals in the application's own format: `render`
            /// gets the [`Rejection`](crate::Rejection) (which layer, why, the status, the
            /// detail, the retry delay) and returns the response an HTTP client gets
            /// instead of the default `application/problem+json` one. The response carries
            /// the rejection in its extensions either way. A gRPC request keeps its gRPC
            /// answer ([`rejection`](crate::rejection#grpc)), the only one a gRPC client
            /// can read.
            ///
            /// ```
            /// # #[cfg(feature = "lock")] {
            /// use bytes::Bytes;
            /// use http::{Response, header};
            /// use tower_redlock::LockLayer;
            ///
            /// let layer = LockLayer::by_header("Idempotency-Key").on_rejection(|rejection| {
            ///     let body = format!(r#"{{"error":"{:?}"}}"#, rejection.kind());
            ///     let mut response = Response::new(Bytes::from(body));
            ///     *response.status_mut() = rejection.status();
            ///     response.headers_mut().insert(
            ///         header::CONTENT_TYPE,
            ///         header::HeaderValue::from_static("application/json"),
            ///     );
            ///     response
            /// });
            /// # }
            /// ```
            pub fn on_rejection<F>(self, render: F) -> Self
            where
                F: Fn(&$crate::rejection::Rejection) -> http::Response<bytes::Bytes>
                    + Send
                    + Sync
                    + 'static,
            {
                Self { keyed: self.keyed.on_rejection(std::sync::Arc::new(render)) }
            }
        }

        $(#[$service_attr])*
        pub struct $service<S, K> {
            inner: $inner,
        }

        impl<S: Clone, K> Clone for $service<S, K> {
            fn clone(&self) -> Self {
                Self { inner: self.inner.clone() }
            }
        }

        impl<S, K> std::fmt::Debug for $service<S, K>
        where
            $inner: std::fmt::Debug,
        {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_tuple(stringify!($service)).field(&self.inner).finish()
            }
        }

        impl<S, K> $service<S, K> {
            /// Gets a reference to the inner service.
            pub fn get_ref(&self) -> &S {
                &self.inner$($via)*
            }

            /// Gets a mutable reference to the inner service.
            pub fn get_mut(&mut self) -> &mut S {
                &mut self.inner$($via)*
            }

            /// Consumes `self`, returning the inner service.
            pub fn into_inner(self) -> S {
                self.inner$($via)*
            }
        }

        impl<S, K, R> tower_service::Service<R> for $service<S, K>
        where
            $inner: tower_service::Service<R>,
        {
            type Response = <$inner as tower_service::Service<R>>::Response;
            type Error = <$inner as tower_service::Service<R>>::Error;
            type Future = <$inner as tower_service::Service<R>>::Future;

            #[inline]
            fn poll_ready(
                &mut self,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Result<(), Self::Error>> {
                self.inner.poll_ready(cx)
            }

            #[inline]
            fn call(&mut self, request: R) -> Self::Future {
                self.inner.call(request)
            }
        }
    };
}
pub(crate) use keyed_middleware;

pub(crate) mod answers;
mod body;
pub(crate) mod future;
pub(crate) mod layer;
pub(crate) mod outage;
pub(crate) mod policy;
mod service;
mod shadow;

pub use body::ResponseBody;
pub use future::ResponseFuture;
#[doc(hidden)]
pub use layer::KeyedLayer;
pub use policy::Policy;
#[doc(hidden)]
pub use service::Keyed;
pub use shadow::Shadow;
#[cfg(test)]
mod release_once;
#[cfg(test)]
pub(crate) mod tests;
