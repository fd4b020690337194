use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::{HeaderName, StatusCode};
use tower_layer::Layer;

use super::service::Lock;
use crate::backend::handle::Locks;
use crate::backend::watchdog::{OnLockLoss, Renewal};
use crate::key::{FnKey, HeaderKey, KeyExtractor};

/// A [`Layer`] that locks each request on a key taken from it; see the
/// [module docs](crate::lock).
///
/// Cloning the layer shares its backend and key extractor.
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_redlock::LockLayer;
///
/// let app: Router = Router::new()
///     .route("/orders", post(|| async { "created" }))
///     .layer(LockLayer::by_header("Idempotency-Key"));
/// ```
pub struct LockLayer<K> {
    config: Config<K>,
}

pub(crate) struct Config<K> {
    pub(crate) extractor: Arc<K>,
    pub(crate) locks: Locks,
    pub(crate) scope: Option<Arc<str>>,
    pub(crate) required: bool,
    pub(crate) missing_detail: Cow<'static, str>,
    pub(crate) settings: Settings,
}

/// What the response future needs to know after the key is found.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) taken_status: StatusCode,
    pub(crate) fail_open: bool,
    pub(crate) renewal: Renewal,
    pub(crate) on_loss: OnLockLoss,
    pub(crate) fencing_header: Option<HeaderName>,
    pub(crate) max_wait: std::time::Duration,
}

impl<K> Clone for Config<K> {
    fn clone(&self) -> Self {
        Self {
            extractor: self.extractor.clone(),
            locks: self.locks.clone(),
            scope: self.scope.clone(),
            required: self.required,
            missing_detail: self.missing_detail.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<K> Clone for LockLayer<K> {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
        }
    }
}

impl<K: fmt::Debug> fmt::Debug for LockLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl<K: fmt::Debug> fmt::Debug for Config<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockLayer")
            .field("extractor", &self.extractor)
            .field("locks", &self.locks)
            .field("scope", &self.scope)
            .field("required", &self.required)
            .field("settings", &self.settings)
            .finish()
    }
}

impl LockLayer<HeaderKey> {
    /// Locks on a header's value, such as `Idempotency-Key` (IETF draft "The
    /// Idempotency-Key HTTP Header Field"): a second request with the same key while the
    /// first is in flight gets **409 Conflict**; a request without the header gets **400**
    /// (see [`optional`](Self::optional)). The value may be a bare token or an RFC 8941
    /// quoted string.
    ///
    /// This stops *concurrent* duplicates; a retry after the first request completed runs
    /// again unless the handler stores and replays the first result.
    ///
    /// The backend defaults to the in-process one: set [`backend`](Self::backend) to a
    /// [`Redlock`](crate::Redlock) when the service runs more than one replica, or each
    /// replica locks on its own.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name; names are usually literals, so this is a
    /// programming error.
    pub fn by_header(name: impl AsRef<str>) -> Self {
        let name = HeaderName::try_from(name.as_ref())
            .unwrap_or_else(|e| panic!("invalid header name {:?}: {e}", name.as_ref()));
        let detail = format!("This endpoint requires a non-empty {name} header.");
        let mut layer = Self::new(HeaderKey::new(name));
        layer.config.settings.taken_status = StatusCode::CONFLICT;
        layer.config.missing_detail = Cow::Owned(detail);
        layer
    }
}

#[cfg(feature = "axum")]
impl LockLayer<crate::key::PathParamKey> {
    /// Locks on an axum path parameter, such as `item_id` in `/items/{item_id}/buy`: a
    /// second request for the same resource while the first holds it gets **423 Locked**
    /// (RFC 4918, section 11.3). The scope is the route up to the parameter, so
    /// `/items/{item_id}` and `/users/{user_id}` never share a lock.
    ///
    /// Add it with `Router::route_layer` (or `Router::layer` after the routes), so that it
    /// runs once the router has found the parameter. A request whose route has no such
    /// parameter gets 400.
    ///
    /// The backend defaults to the in-process one: set [`backend`](Self::backend) to a
    /// [`Redlock`](crate::Redlock) when the service runs more than one replica, or each
    /// replica locks on its own.
    pub fn by_path_param(name: impl Into<Cow<'static, str>>) -> Self {
        let key = crate::key::PathParamKey::new(name);
        let detail = format!(
            "The route has no path parameter `{}` to lock on.",
            key.name()
        );
        let mut layer = Self::new(key);
        layer.config.missing_detail = Cow::Owned(detail);
        layer
    }
}

impl<F> LockLayer<FnKey<F>>
where
    F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
{
    /// Locks on what `f` returns for the request head; `None` means the request has no key
    /// (400 unless [`optional`](Self::optional)). Contention is **423 Locked**.
    ///
    /// ```
    /// use tower_redlock::LockLayer;
    ///
    /// // One report per tenant at a time.
    /// let layer = LockLayer::by_fn(|parts| {
    ///     parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned)
    /// })
    /// .scope("report");
    /// ```
    pub fn by_fn(f: F) -> Self {
        Self::new(FnKey::new(f))
    }
}

impl<K: KeyExtractor> LockLayer<K> {
    /// Locks on the key that `extractor` finds. Defaults: in-process backend
    /// ([`Locks::default`]), 423 on contention, key required, fail closed.
    pub fn new(extractor: K) -> Self {
        Self {
            config: Config {
                extractor: Arc::new(extractor),
                locks: Locks::default(),
                scope: None,
                required: true,
                missing_detail: Cow::Borrowed("The request carries no lock key."),
                settings: Settings {
                    taken_status: StatusCode::LOCKED,
                    fail_open: false,
                    renewal: Renewal::default(),
                    on_loss: OnLockLoss::default(),
                    fencing_header: None,
                    max_wait: std::time::Duration::ZERO,
                },
            },
        }
    }
}

impl<K> LockLayer<K> {
    /// The lock backend: a [`Redlock`](crate::Redlock), [`MemoryLocks`](crate::MemoryLocks)
    /// or [`Locks`]. Default: the process-wide in-process backend ([`Locks::default`]).
    #[must_use]
    pub fn backend(mut self, locks: impl Into<Locks>) -> Self {
        self.config.locks = locks.into();
        self
    }

    /// A fixed scope instead of the extractor's: the key becomes `{scope}:{value}`. Layers
    /// and [`Locked`](crate::Locked) extractors with the same scope and value share a lock.
    /// Default: the header name, method and route for `by_header`; the route up to the
    /// parameter for `by_path_param`; empty for `by_fn` and `new`.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.config.scope = Some(Arc::from(scope.into()));
        self
    }

    /// The status sent when the lock is held by another request. Default 409 Conflict for
    /// `by_header` (a request with that key is in flight), 423 Locked otherwise.
    #[must_use]
    pub fn taken_status(mut self, status: StatusCode) -> Self {
        self.config.settings.taken_status = status;
        self
    }

    /// Lets requests without a key through, unlocked, instead of answering 400. An
    /// invalid key is still a 400.
    #[must_use]
    pub fn optional(mut self) -> Self {
        self.config.required = false;
        self
    }

    /// When the backend has no quorum (Redis down), run the inner service without a lock
    /// instead of answering 503. Default: fail closed (503), because a lock that is
    /// silently skipped protects nothing. The handler can tell: there is no
    /// [`Lease`](crate::Lease) in its request extensions.
    #[must_use]
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config.settings.fail_open = fail_open;
        self
    }

    /// Waits up to `max_wait` for a held lock before answering 409/423: the request is
    /// woken when the holder releases (Redis pub/sub; see
    /// [`Redlock::lock_within`](crate::Redlock::lock_within)), then tries again. Default
    /// zero: answer at once. The wait counts against the client's own timeout, so keep it
    /// short. An acquisition attempt in flight at the deadline runs to its end, so the
    /// answer can come up to one node timeout after `max_wait`.
    #[must_use]
    pub fn max_wait(mut self, max_wait: std::time::Duration) -> Self {
        self.config.settings.max_wait = max_wait;
        self
    }

    /// How the lease is renewed while the inner service runs. Default: every TTL/3, for
    /// at most 10 × TTL in all ([`Renewal::default`]); [`Renewal::disabled`] lets the
    /// lease run out after one TTL.
    #[must_use]
    pub fn renewal(mut self, renewal: Renewal) -> Self {
        self.config.settings.renewal = renewal;
        self
    }

    /// What happens when the lease is lost while the inner service runs. Default
    /// [`OnLockLoss::Abort`]: the inner future is dropped, never polled past the lease's
    /// validity, and the client gets 503.
    #[must_use]
    pub fn on_lock_loss(mut self, on_loss: OnLockLoss) -> Self {
        self.config.settings.on_loss = on_loss;
        self
    }

    /// Sends the lease's fencing token to the inner service in this request header (for
    /// example `Fencing-Token`), so that it can pass the token on to storage that rejects
    /// stale writers. Default: not sent (the token is always in the
    /// [`Lease`](crate::Lease) in the request extensions, when the backend issues one:
    /// see [`RedlockBuilder::fencing_tokens`](crate::RedlockBuilder::fencing_tokens)).
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    #[must_use]
    pub fn fencing_header(mut self, name: impl AsRef<str>) -> Self {
        let header = HeaderName::try_from(name.as_ref())
            .unwrap_or_else(|e| panic!("invalid header name {:?}: {e}", name.as_ref()));
        self.config.settings.fencing_header = Some(header);
        self
    }
}

impl<S, K> Layer<S> for LockLayer<K> {
    type Service = Lock<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        Lock::new(inner, Arc::new(self.config.clone()))
    }
}
