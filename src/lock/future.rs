use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::{Config, Settings};
use crate::backend::handle::{LeaseGuard, Locks};
use crate::backend::watchdog::{OnLockLoss, Watchdog};
use crate::error::LockError;
use crate::lease::Lease;
use crate::problem::Problem;
use crate::protect::{Lost, poll_guarded};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

pin_project! {
    /// The response future of [`Lock`](super::Lock).
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
        Acquiring {
            acquire: BoxFuture<Result<Lease, LockError>>,
            service: Option<S>,
            request: Option<Request<ReqB>>,
            locks: Locks,
            settings: Settings,
        },
        Running {
            #[pin]
            future: S::Future,
            guard: LeaseGuard,
            watchdog: Option<Watchdog>,
            on_loss: OnLockLoss,
        },
        Releasing {
            release: BoxFuture<()>,
            guard: LeaseGuard,
            output: Option<Result<S::Response, S::Error>>,
        },
        Rejected {
            problem: Option<Problem>,
        },
    }
}

impl<S, ReqB> fmt::Debug for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Acquiring { .. } => "Acquiring",
            State::Running { .. } => "Running",
            State::Releasing { .. } => "Releasing",
            State::Rejected { .. } => "Rejected",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

fn lock_lost() -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "The lock was lost while the request ran, so its work was stopped; retry the request.",
    )
    .retry_after(Duration::from_secs(1))
}

/// Puts the lease, its live status and (if asked) the fencing token header on the request,
/// calls the service, and watches the lease.
fn run<S, ReqB>(
    mut service: S,
    mut request: Request<ReqB>,
    locks: Locks,
    lease: Lease,
    settings: &Settings,
) -> State<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    let watchdog = Watchdog::new(locks.clone(), lease.clone(), settings.renewal);
    if let (Some(name), Some(token)) = (&settings.fencing_header, lease.fencing_token()) {
        request
            .headers_mut()
            .insert(name.clone(), HeaderValue::from(token));
    }
    request.extensions_mut().insert(watchdog.status());
    request.extensions_mut().insert(lease.clone());
    State::Running {
        future: service.call(request),
        guard: LeaseGuard::new(locks, lease),
        watchdog: Some(watchdog),
        on_loss: settings.on_loss,
    }
}

impl<S, ReqB> ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn rejected(problem: Problem) -> Self {
        Self {
            state: State::Rejected {
                problem: Some(problem),
            },
        }
    }

    pub(crate) fn unlocked(mut service: S, request: Request<ReqB>) -> Self {
        Self {
            state: State::Running {
                future: service.call(request),
                guard: LeaseGuard::none(),
                watchdog: None,
                on_loss: OnLockLoss::Continue,
            },
        }
    }

    pub(crate) fn acquire<K>(
        service: S,
        request: Request<ReqB>,
        key: Arc<str>,
        config: &Config<K>,
    ) -> Self {
        let locks = config.locks.clone();
        let max_wait = config.settings.max_wait;
        if let Some(memory) = locks.as_memory().filter(|_| max_wait.is_zero()) {
            // The in-process backend answers at once: no task, no boxed future.
            return match memory.acquire(key) {
                Ok(lease) => Self {
                    state: run(service, request, locks, lease, &config.settings),
                },
                Err(e) => {
                    Self::rejected(Problem::from_lock_error(&e, config.settings.taken_status))
                }
            };
        }
        let acquire_with = locks.clone();
        Self {
            state: State::Acquiring {
                acquire: Box::pin(async move { acquire_with.lock_key_within(key, max_wait).await }),
                service: Some(service),
                request: Some(request),
                locks,
                settings: config.settings.clone(),
            },
        }
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
                StateProj::Acquiring {
                    acquire,
                    service,
                    request,
                    locks,
                    settings,
                } => {
                    let result = ready!(acquire.as_mut().poll(cx));
                    let (Some(mut service), Some(request)) = (service.take(), request.take())
                    else {
                        unreachable!("Acquiring is left once its service is taken");
                    };
                    let next = match result {
                        Ok(lease) => run(service, request, locks.clone(), lease, settings),
                        Err(e @ (LockError::NoQuorum { .. } | LockError::TooSlow { .. }))
                            if settings.fail_open =>
                        {
                            tracing::warn!(error = %e, "lock backend unavailable; running unlocked (fail open)");
                            State::Running {
                                future: service.call(request),
                                guard: LeaseGuard::none(),
                                watchdog: None,
                                on_loss: OnLockLoss::Continue,
                            }
                        }
                        Err(e) => {
                            if !matches!(e, LockError::Taken { .. } | LockError::InvalidKey(_)) {
                                tracing::warn!(error = %e, "lock backend unavailable; answering 503");
                            }
                            State::Rejected {
                                problem: Some(Problem::from_lock_error(&e, settings.taken_status)),
                            }
                        }
                    };
                    this.state.set(next);
                }
                StateProj::Running {
                    future,
                    guard,
                    watchdog,
                    on_loss,
                } => {
                    // Never polled past the lease's validity under Abort: see `protect`.
                    let polled = match watchdog.as_mut() {
                        Some(dog) => match poll_guarded(dog, cx, |cx| future.poll(cx)) {
                            Poll::Ready(Ok(output)) => Some(output),
                            Poll::Ready(Err(Lost)) => None,
                            Poll::Pending => return Poll::Pending,
                        },
                        None => Some(ready!(future.poll(cx))),
                    };
                    let Some(output) = polled else {
                        *watchdog = None;
                        match on_loss {
                            OnLockLoss::Abort => {
                                // Dropping the guard releases whatever is left.
                                this.state.set(State::Rejected {
                                    problem: Some(lock_lost()),
                                });
                            }
                            OnLockLoss::Continue => {
                                tracing::warn!(
                                    "lease lost; the request runs on unprotected (OnLockLoss::Continue)"
                                );
                            }
                        }
                        continue;
                    };
                    *watchdog = None;
                    let Some((locks, lease)) = guard.cloned() else {
                        return Poll::Ready(output);
                    };
                    if let Some(memory) = locks.as_memory() {
                        guard.disarm();
                        let _ = memory.unlock(lease);
                        return Poll::Ready(output);
                    }
                    // Released in place; should this future be dropped meanwhile, the
                    // guard (still armed) releases in the background.
                    let release = Box::pin(async move {
                        if let Err(e) = locks.unlock(lease).await {
                            tracing::debug!(error = %e, "lease release");
                        }
                    });
                    let pending = std::mem::replace(guard, LeaseGuard::none());
                    this.state.set(State::Releasing {
                        release,
                        guard: pending,
                        output: Some(output),
                    });
                }
                StateProj::Releasing {
                    release,
                    guard,
                    output,
                } => {
                    ready!(release.as_mut().poll(cx));
                    guard.disarm();
                    return Poll::Ready(output.take().expect("polled after completion"));
                }
                StateProj::Rejected { problem } => {
                    let problem = problem.take().expect("polled after completion");
                    return Poll::Ready(Ok(problem.into_response()));
                }
            }
        }
    }
}
