use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::Config;
use crate::error::LockError;
use crate::lease::Lease;
use crate::locks::Locks;
use crate::problem::Problem;

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
            taken_status: StatusCode,
            fail_open: bool,
        },
        Running {
            #[pin]
            future: S::Future,
            guard: LeaseGuard,
        },
        Releasing {
            release: tokio::task::JoinHandle<()>,
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

/// Holds the lease while the inner future runs; releases it in the background if dropped
/// still holding it.
pub(crate) struct LeaseGuard {
    held: Option<(Locks, Lease)>,
}

impl LeaseGuard {
    pub(crate) fn new(locks: Locks, lease: Lease) -> Self {
        Self {
            held: Some((locks, lease)),
        }
    }

    pub(crate) fn none() -> Self {
        Self { held: None }
    }

    pub(crate) fn take(&mut self) -> Option<(Locks, Lease)> {
        self.held.take()
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some((locks, lease)) = self.held.take() {
            locks.release_detached(lease);
        }
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
            },
        }
    }

    pub(crate) fn acquire<K>(
        mut service: S,
        mut request: Request<ReqB>,
        resource: String,
        config: &Config<K>,
    ) -> Self {
        let locks = config.locks.clone();
        if let Some(memory) = locks.as_memory() {
            // The in-process backend answers at once: no task, no allocation for a future.
            return match memory.try_lock(&resource) {
                Ok(lease) => {
                    request.extensions_mut().insert(lease.clone());
                    Self {
                        state: State::Running {
                            future: service.call(request),
                            guard: LeaseGuard::new(locks, lease),
                        },
                    }
                }
                Err(e) => Self::rejected(Problem::from_lock_error(&e, config.taken_status)),
            };
        }
        let acquire_with = locks.clone();
        Self {
            state: State::Acquiring {
                acquire: Box::pin(async move { acquire_with.try_lock(&resource).await }),
                service: Some(service),
                request: Some(request),
                locks,
                taken_status: config.taken_status,
                fail_open: config.fail_open,
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
                    taken_status,
                    fail_open,
                } => {
                    let result = ready!(acquire.as_mut().poll(cx));
                    let (Some(mut service), Some(mut request)) = (service.take(), request.take())
                    else {
                        unreachable!("Acquiring is left once its service is taken");
                    };
                    let guard = match result {
                        Ok(lease) => {
                            request.extensions_mut().insert(lease.clone());
                            LeaseGuard::new(locks.clone(), lease)
                        }
                        Err(e @ (LockError::NoQuorum { .. } | LockError::TooSlow { .. }))
                            if *fail_open =>
                        {
                            tracing::warn!(error = %e, "lock backend unavailable; running unlocked (fail open)");
                            LeaseGuard::none()
                        }
                        Err(e) => {
                            if !matches!(e, LockError::Taken { .. } | LockError::InvalidKey(_)) {
                                tracing::warn!(error = %e, "lock backend unavailable; answering 503");
                            }
                            let problem = Problem::from_lock_error(&e, *taken_status);
                            this.state.set(State::Rejected {
                                problem: Some(problem),
                            });
                            continue;
                        }
                    };
                    let future = service.call(request);
                    this.state.set(State::Running { future, guard });
                }
                StateProj::Running { future, guard } => {
                    let output = ready!(future.poll(cx));
                    let Some((locks, lease)) = guard.take() else {
                        return Poll::Ready(output);
                    };
                    if let Some(memory) = locks.as_memory() {
                        let _ = memory.unlock(lease);
                        return Poll::Ready(output);
                    }
                    match tokio::runtime::Handle::try_current() {
                        Ok(handle) => {
                            // Spawned, so that the release completes even if this future is
                            // dropped while waiting for it.
                            let release = handle.spawn(async move {
                                if let Err(e) = locks.unlock(lease).await {
                                    tracing::debug!(error = %e, "lease release");
                                }
                            });
                            this.state.set(State::Releasing {
                                release,
                                output: Some(output),
                            });
                        }
                        Err(_) => {
                            tracing::warn!(
                                key = lease.key(),
                                "no Tokio runtime to release the lock on; it expires by its TTL"
                            );
                            return Poll::Ready(output);
                        }
                    }
                }
                StateProj::Releasing { release, output } => {
                    let _ = ready!(Pin::new(release).poll(cx));
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
