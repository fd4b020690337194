use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::request::Parts;
use http::{Request, Response};
use tower_service::Service;

use super::body::ResponseBody;
use super::future::ResponseFuture;
use super::layer::{Core, KeyedLayer};
use super::policy::{Decision, Permit, Policy, Verdict};
use crate::key::KeyExtractor;
use crate::keyed::answers::Rendering;

/// The service of a keyed middleware: reads the request's key, asks the policy, and calls
/// the inner service `S` (or answers itself). [`Lock`](crate::lock::Lock) and
/// [`RateLimitService`](crate::rate_limit::RateLimitService) wrap it with their policies.
pub struct Keyed<S, K, P> {
    pub(crate) inner: S,
    core: Arc<Core<K, P>>,
}

impl<S, K, P> Keyed<S, K, P> {
    /// Wraps `inner` in the middleware that `layer` describes; the same as
    /// `layer.layer(inner)`.
    pub fn new(inner: S, layer: KeyedLayer<K, P>) -> Self {
        Self {
            inner,
            core: layer.core,
        }
    }

    crate::keyed::inner_service_accessors!();
}

impl<S: Clone, K, P> Clone for Keyed<S, K, P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            core: self.core.clone(),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug, P: Policy + fmt::Debug> fmt::Debug for Keyed<S, K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyed")
            .field("inner", &self.inner)
            .field("layer", &self.core)
            .finish()
    }
}

impl<S, K, P, ReqB, ResB> Service<Request<ReqB>> for Keyed<S, K, P>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor,
    P: Policy,
    ResB: http_body::Body<Data = bytes::Bytes>,
    ResB::Error: Into<super::policy::BoxError>,
{
    type Response = Response<ResponseBody<ResB, P>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, P, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let core = &*self.core;
        let (mut parts, body) = req.into_parts();
        // How this request's refusals are answered: read from its head (a header lookup)
        // only where the layer may answer it itself.
        let answers =
            |parts: &Parts| Rendering::for_request(&parts.headers, core.on_rejection.as_ref());
        let rules = super::future::Rules {
            fail_open: core.fail_open,
            shadow: core.shadow.is_on(),
        };
        core.policy.prepare(&mut parts);
        // No key, and none needed: the request runs unguarded.
        let Some(decision) = core.step(&mut parts) else {
            let req = Request::from_parts(parts, body);
            return ResponseFuture::unguarded(&mut self.inner, req);
        };
        match decision {
            // Decided at once: the service that was driven to readiness is called now. An
            // admission whose permit never stops the work (a count, a concurrency
            // permit) leaves the layer nothing to answer.
            Decision::Ready(verdict) => {
                let answers = match &verdict {
                    Verdict::Admit(permit) if !permit.abort_on_loss() => Rendering::Problem,
                    _ => answers(&parts),
                };
                let req = Request::from_parts(parts, body);
                ResponseFuture::decided(verdict, rules, &mut self.inner, req, answers)
            }
            // The service that was driven to readiness is the one called, once decided.
            Decision::Pending(decision) => {
                let answers = answers(&parts);
                let req = Request::from_parts(parts, body);
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::deciding(decision, rules, inner, req, answers)
            }
        }
    }
}
