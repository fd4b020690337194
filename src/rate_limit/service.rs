use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use crate::key::{KeyExtractor, build_key, validate_value};

/// The service of [`RateLimitLayer`](super::RateLimitLayer): counts each request before
/// calling the inner service `S`.
pub struct RateLimit<S, K> {
    inner: S,
    extractor: Arc<K>,
    config: Arc<Config>,
}

impl<S, K> RateLimit<S, K> {
    pub(crate) fn new(inner: S, extractor: Arc<K>, config: Arc<Config>) -> Self {
        Self {
            inner,
            extractor,
            config,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, K> Clone for RateLimit<S, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            extractor: self.extractor.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug> fmt::Debug for RateLimit<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("extractor", &self.extractor)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, K, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor,
    ResB: From<Bytes>,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let config = &self.config;
        let (mut parts, body) = req.into_parts();
        let value = match self.extractor.extract(&mut parts) {
            Ok(Some(value)) => match validate_value(&value) {
                Ok(()) => Some(value),
                Err(e) => return ResponseFuture::answered(Config::invalid(&e)),
            },
            Ok(None) if config.required => return ResponseFuture::answered(config.missing()),
            Ok(None) => None,
            Err(e) => return ResponseFuture::answered(Config::invalid(&e)),
        };
        let resource = value.map(|value| {
            build_key(
                "",
                config.scope.as_deref(),
                &*self.extractor,
                &parts,
                &value,
            )
        });
        let req = Request::from_parts(parts, body);
        // The service that was driven to readiness is the one we call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        match resource {
            None => ResponseFuture::unlimited(inner, req),
            Some(resource) => ResponseFuture::count(inner, req, resource, config),
        }
    }
}

#[cfg(all(test, feature = "axum"))]
mod tests {
    use std::convert::Infallible;
    use std::net::SocketAddr;

    use bytes::Bytes;
    use http::StatusCode;
    use http::header::{CONTENT_TYPE, RETRY_AFTER};
    use tower::{ServiceBuilder, ServiceExt, service_fn};

    use super::super::layer::{RATELIMIT, RATELIMIT_POLICY};
    use crate::rate_limit::{MemoryRateLimiter, Quota, RateLimitLayer, Usage};

    type Body = Bytes;

    fn svc<K: crate::key::KeyExtractor>(
        layer: RateLimitLayer<K>,
    ) -> impl tower::Service<http::Request<()>, Response = http::Response<Body>, Error = Infallible>
    + Clone {
        ServiceBuilder::new().layer(layer).service(service_fn(
            |req: http::Request<()>| async move {
                let seen = req
                    .extensions()
                    .get::<Usage>()
                    .map(|u| u.count().to_string());
                Ok::<_, Infallible>(http::Response::new(Bytes::from(
                    seen.unwrap_or_else(|| "uncounted".into()),
                )))
            },
        ))
    }

    fn request(client: Option<&str>) -> http::Request<()> {
        let mut builder = http::Request::builder().uri("/items/1/buy");
        if let Some(client) = client {
            builder = builder.header("x-client-id", client);
        }
        let mut req = builder.body(()).unwrap();
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(SocketAddr::from((
                [203, 0, 113, 7],
                5555,
            ))));
        req
    }

    fn quota(text: &str) -> Quota {
        text.parse().unwrap()
    }

    #[tokio::test]
    async fn passes_limit_then_answers_429_with_headers() {
        let layer = RateLimitLayer::by_header("x-client-id", quota("2/60"))
            .backend(MemoryRateLimiter::new());
        let svc = svc(layer);
        for (count, remaining) in [(1, 1), (2, 0)] {
            let r = svc.clone().oneshot(request(Some("a"))).await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            assert_eq!(
                r.body(),
                count.to_string().as_bytes(),
                "the handler sees the Usage"
            );
            assert_eq!(
                r.headers()[&RATELIMIT],
                format!("\"default\";r={remaining};t=60")
            );
            assert_eq!(r.headers()[&RATELIMIT_POLICY], "\"default\";q=2;w=60");
        }
        let r = svc.clone().oneshot(request(Some("a"))).await.unwrap();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(r.headers()[RETRY_AFTER], "60");
        assert_eq!(r.headers()[&RATELIMIT], "\"default\";r=0;t=60");
        // Another key has its own count.
        let r = svc.clone().oneshot(request(Some("b"))).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn missing_key_is_400_when_required_and_passes_when_optional() {
        let limiter = MemoryRateLimiter::new();
        let required =
            svc(RateLimitLayer::by_header("x-client-id", quota("1/60")).backend(limiter.clone()));
        let r = required.oneshot(request(None)).await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
        assert!(!r.headers().contains_key(&RATELIMIT_POLICY));

        let optional = svc(RateLimitLayer::by_header("x-client-id", quota("1/60"))
            .backend(limiter)
            .optional());
        for _ in 0..3 {
            let r = optional.clone().oneshot(request(None)).await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            assert_eq!(r.body(), "uncounted".as_bytes());
            assert!(!r.headers().contains_key(&RATELIMIT));
        }
    }

    #[tokio::test]
    async fn invalid_key_is_400_even_when_optional() {
        let layer = RateLimitLayer::by_header("x-client-id", quota("1/60"))
            .backend(MemoryRateLimiter::new())
            .optional();
        let svc = svc(layer);
        for bad in ["\"unterminated", &"k".repeat(crate::key::MAX_KEY_LEN + 1)] {
            let r = svc.clone().oneshot(request(Some(bad))).await.unwrap();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[tokio::test]
    async fn header_or_peer_ip_counts_ids_and_addresses_apart() {
        let layer = RateLimitLayer::by_header_or_peer_ip("x-client-id", quota("1/60"))
            .backend(MemoryRateLimiter::new());
        let svc = svc(layer);
        let ok = |r: http::Response<Body>| r.status() == StatusCode::OK;
        assert!(ok(svc.clone().oneshot(request(None)).await.unwrap()));
        assert!(
            !ok(svc.clone().oneshot(request(None)).await.unwrap()),
            "same IP, second hit"
        );
        assert!(
            ok(svc
                .clone()
                .oneshot(request(Some("203.0.113.7")))
                .await
                .unwrap()),
            "an id is not an address"
        );
        assert!(ok(svc.clone().oneshot(request(Some("c"))).await.unwrap()));
        assert!(!ok(svc.clone().oneshot(request(Some("c"))).await.unwrap()));
    }

    #[tokio::test]
    async fn scope_separates_layers_and_shared_scope_shares_counts() {
        let limiter = MemoryRateLimiter::new();
        let a = svc(RateLimitLayer::global(quota("1/60"))
            .backend(limiter.clone())
            .scope("a"));
        let b = svc(RateLimitLayer::global(quota("1/60"))
            .backend(limiter.clone())
            .scope("b"));
        let a2 = svc(RateLimitLayer::global(quota("1/60"))
            .backend(limiter)
            .scope("a"));
        assert_eq!(
            a.oneshot(request(None)).await.unwrap().status(),
            StatusCode::OK
        );
        assert_eq!(
            b.oneshot(request(None)).await.unwrap().status(),
            StatusCode::OK
        );
        assert_eq!(
            a2.oneshot(request(None)).await.unwrap().status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }

    #[tokio::test]
    async fn the_readied_service_is_the_one_called() {
        // A service that is ready only once: calling an unreadied clone would panic.
        struct Once(bool);
        impl Clone for Once {
            fn clone(&self) -> Self {
                Once(false) // a clone has not been driven to readiness
            }
        }
        impl tower::Service<http::Request<()>> for Once {
            type Response = http::Response<Body>;
            type Error = Infallible;
            type Future = std::future::Ready<Result<Self::Response, Infallible>>;
            fn poll_ready(
                &mut self,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Result<(), Infallible>> {
                self.0 = true;
                std::task::Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: http::Request<()>) -> Self::Future {
                assert!(self.0, "called without poll_ready");
                self.0 = false;
                std::future::ready(Ok(http::Response::new(Body::new())))
            }
        }
        let svc = ServiceBuilder::new()
            .layer(RateLimitLayer::global(quota("5/60")).backend(MemoryRateLimiter::new()))
            .service(Once(false));
        let r = svc.oneshot(request(None)).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}
