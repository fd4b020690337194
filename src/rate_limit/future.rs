use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::Config;
use crate::backend::rate_limit::RateLimitError;
use crate::backend::rate_limit::quota::Usage;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

pin_project! {
    /// The response future of [`RateLimit`](super::RateLimit).
    pub struct ResponseFuture<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        // Waiting for Redis.
        Counting {
            count: BoxFuture<Result<Usage, RateLimitError>>,
            service: Option<S>,
            request: Option<Request<ReqB>>,
            config: Arc<Config>,
        },
        // The inner service runs; its response gets the headers of `config` (none when
        // the request was not subject to the limit).
        Running {
            #[pin]
            future: S::Future,
            config: Option<Arc<Config>>,
            usage: Option<Usage>,
        },
        // The layer answered itself (429, 400, 503).
        Answered {
            response: Option<S::Response>,
        },
    }
}

impl<S, ReqB> fmt::Debug for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Counting { .. } => "Counting",
            State::Running { .. } => "Running",
            State::Answered { .. } => "Answered",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

impl<S, ReqB, ResB> ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: From<Bytes>,
{
    pub(crate) fn answered(response: Response<ResB>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }

    /// Runs the inner service without counting (no key, optional).
    pub(crate) fn unlimited(mut service: S, request: Request<ReqB>) -> Self {
        Self {
            state: State::Running {
                future: service.call(request),
                config: None,
                usage: None,
            },
        }
    }

    /// Counts `resource`, then runs the inner service or answers.
    pub(crate) fn count(
        service: S,
        request: Request<ReqB>,
        resource: String,
        config: &Arc<Config>,
    ) -> Self {
        if let Some(memory) = config.limiter.as_memory() {
            // The in-process store answers at once: no task, no boxed future.
            let result = memory.hit(&resource, config.quota);
            return Self {
                state: decide(service, request, config.clone(), result),
            };
        }
        let limiter = config.limiter.clone();
        let quota = config.quota;
        Self {
            state: State::Counting {
                count: Box::pin(async move { limiter.hit(&resource, quota).await }),
                service: Some(service),
                request: Some(request),
                config: config.clone(),
            },
        }
    }
}

/// What to do with a counted (or uncountable) request.
fn decide<S, ReqB, ResB>(
    mut service: S,
    mut request: Request<ReqB>,
    config: Arc<Config>,
    result: Result<Usage, RateLimitError>,
) -> State<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: From<Bytes>,
{
    let usage = match result {
        Ok(usage) if usage.is_exceeded() => {
            return State::Answered {
                response: Some(config.too_many(&usage)),
            };
        }
        Ok(usage) => {
            request.extensions_mut().insert(usage);
            Some(usage)
        }
        Err(RateLimitError::InvalidKey(e)) => {
            return State::Answered {
                response: Some(Config::invalid(&e)),
            };
        }
        Err(e) if config.fail_open => {
            tracing::warn!(error = %e, "rate limit store unavailable; letting the request through (fail open)");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "rate limit store unavailable; answering 503 (fail closed)");
            return State::Answered {
                response: Some(config.unavailable()),
            };
        }
    };
    State::Running {
        future: service.call(request),
        config: Some(config),
        usage,
    }
}

impl<S, ReqB, ResB> Future for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: From<Bytes>,
{
    type Output = Result<Response<ResB>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Counting {
                    count,
                    service,
                    request,
                    config,
                } => {
                    let result = ready!(count.as_mut().poll(cx));
                    let (Some(service), Some(request)) = (service.take(), request.take()) else {
                        unreachable!("Counting is left once its service is taken");
                    };
                    let next = decide(service, request, config.clone(), result);
                    this.state.set(next);
                }
                StateProj::Running {
                    future,
                    config,
                    usage,
                } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(config) = config.take() {
                        config.decorate(response.headers_mut(), usage.as_ref());
                    }
                    return Poll::Ready(Ok(response));
                }
                StateProj::Answered { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response));
                }
            }
        }
    }
}
