use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use super::future::ResponseFuture;
use super::layer::Config;
use crate::key::{KeyExtractor, build_shared_key, validate_value};
use crate::problem::Problem;

/// The service of [`LockLayer`](super::LockLayer): locks each request before calling the
/// inner service `S`.
pub struct Lock<S, K> {
    inner: S,
    config: Arc<Config<K>>,
}

impl<S, K> Lock<S, K> {
    pub(crate) fn new(inner: S, config: Arc<Config<K>>) -> Self {
        Self { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, K> Clone for Lock<S, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug> fmt::Debug for Lock<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, K, ReqB, ResB> Service<Request<ReqB>> for Lock<S, K>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
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
        if let Some(name) = &config.settings.fencing_header {
            // Only the layer sets this header: a client's own value must never reach the
            // inner service, whatever happens next (no key, fail open, no token).
            parts.headers.remove(name);
        }
        let value = match config.extractor.extract(&mut parts) {
            Ok(Some(value)) => match validate_value(&value) {
                Ok(()) => Some(value),
                Err(e) => {
                    return ResponseFuture::rejected(Problem::from_lock_error(
                        &e.into(),
                        config.settings.taken_status,
                    ));
                }
            },
            Ok(None) if config.required => {
                return ResponseFuture::rejected(Problem::new(
                    http::StatusCode::BAD_REQUEST,
                    config.missing_detail.clone(),
                ));
            }
            Ok(None) => None,
            Err(e) => {
                return ResponseFuture::rejected(Problem::from_lock_error(
                    &e.into(),
                    config.settings.taken_status,
                ));
            }
        };
        // The whole key, `{prefix}{scope}:{value}`, in one allocation.
        let key = value.map(|value| {
            build_shared_key(
                config.locks.prefix(),
                config.scope.as_deref(),
                &*config.extractor,
                &parts,
                &value,
            )
        });
        let req = Request::from_parts(parts, body);
        // The service that was driven to readiness is the one we call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        match key {
            None => ResponseFuture::unlocked(inner, req),
            Some(key) => ResponseFuture::acquire(inner, req, key, config),
        }
    }
}
