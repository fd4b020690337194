//! [`LockKeys`]: extracted values that name one lock key or several, and the acquisition
//! [`Locked<T>`] shares between its request-head and whole-request forms.

use std::borrow::Cow;

use axum::Json;
use axum::extract::{FromRef, FromRequest, Request};
use http::StatusCode;

use super::locked::{LockKey, Locked, LockedRejection, Owned};
use crate::error::LockError;
use crate::holder::Holder;
use crate::key::{KeyError, MAX_KEYS_PER_LEASE, validate_value};
use crate::lock::handle::Locks;
use crate::lock::status::LeaseStatus;
use crate::lock::watchdog::{Renewal, Watchdog};
use crate::rejection::Rejection;

/// Turns an extracted value into the lock keys [`Locked<T>`] holds: one, or several held
/// with one lease, all or none (see [`LockRequest::all`](crate::LockRequest::all)).
///
/// Every [`LockKey`] is a `LockKeys` with its one key. Implement it for a value that names
/// several resources at once, such as a transfer between two accounts; each key is
/// `{SCOPE}:{key}`, and the order does not matter (the keys are sorted, so two requests
/// that name the same keys in opposite orders never deadlock).
///
/// A value read from the body works as the handler's last argument,
/// `Locked<Json<Transfer>>` (`Json<T>` is `LockKeys` when `T` is):
///
/// ```
/// use std::borrow::Cow;
/// use axum::{Json, Router, routing::post};
/// use tower_redlock::{LockKeys, Locked, Locks};
///
/// #[derive(serde::Deserialize)]
/// struct Transfer {
///     from: String,
///     to: String,
///     amount: u64,
/// }
///
/// impl LockKeys for Transfer {
///     const SCOPE: &'static str = "account";
///     fn lock_keys(&self) -> Vec<Cow<'_, str>> {
///         vec![Cow::Borrowed(&self.from), Cow::Borrowed(&self.to)]
///     }
/// }
///
/// async fn transfer(transfer: Locked<Json<Transfer>>) -> String {
///     // Runs holding both "account:{from}" and "account:{to}".
///     format!("moved {} from {} to {}", transfer.amount, transfer.from, transfer.to)
/// }
///
/// let app: Router = Router::new()
///     .route("/transfers", post(transfer))
///     .with_state(Locks::default());
/// ```
pub trait LockKeys {
    /// The scope of every key of this type, such as `"account"`.
    const SCOPE: &'static str;

    /// This value's keys, at least one. Each must be non-empty, at most
    /// [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN) bytes and free of control characters,
    /// and there may be at most [`MAX_KEYS_PER_LEASE`](crate::key::MAX_KEYS_PER_LEASE)
    /// distinct ones, or the extractor answers 400 (`application/problem+json`). An empty
    /// list (a body that names no resource, such as `{"ids": []}`) is answered 400 as
    /// well, [`KeyError::KeyCount`](crate::key::KeyError::KeyCount), and takes no lock.
    fn lock_keys(&self) -> Vec<Cow<'_, str>>;
}

impl<T: LockKey> LockKeys for T {
    const SCOPE: &'static str = T::SCOPE;

    fn lock_keys(&self) -> Vec<Cow<'_, str>> {
        vec![self.lock_key()]
    }
}

impl<T: LockKeys> LockKeys for Json<T> {
    const SCOPE: &'static str = T::SCOPE;

    fn lock_keys(&self) -> Vec<Cow<'_, str>> {
        self.0.lock_keys()
    }
}

/// `Locked<T>` for an extractor that reads the request body (`Json<T>`, `Form<T>`, or
/// your own `FromRequest`): the last argument of a handler. The lock is taken once the
/// body is read, so a request whose body is refused takes no lock.
impl<T, S> FromRequest<S> for Locked<T>
where
    T: FromRequest<S> + LockKeys + Send,
    Locks: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = LockedRejection<T::Rejection>;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let existing = request.extensions().get::<LeaseStatus>().cloned();
        // Read before the request is handed on: the lease records it as its holder.
        let holder = Holder::of_request(&request);
        let value = T::from_request(request, state)
            .await
            .map_err(LockedRejection::Extract)?;
        lock(value, existing.as_ref(), Locks::from_ref(state), &holder)
            .await
            .map_err(LockedRejection::Lock)
    }
}

/// Locks `value`'s keys, or reuses `existing` (a layer's lease on this request) when it
/// already holds every one of them; a new lease records `holder`.
pub(super) async fn lock<T: LockKeys>(
    value: T,
    existing: Option<&LeaseStatus>,
    locks: Locks,
    holder: &Holder,
) -> Result<Locked<T>, Rejection> {
    let reject = |e: LockError| Rejection::from_lock_error(&e, StatusCode::LOCKED);
    let keys = value.lock_keys();
    let mut resources = Vec::with_capacity(keys.len());
    for key in keys {
        validate_value(&key).map_err(|e| {
            crate::observe::LockResult::Invalid.count();
            reject(e.into())
        })?;
        resources.push(format!("{}:{}", T::SCOPE, key));
    }
    // A value that names nothing (an empty list in a body) is the client's mistake: 400.
    let Some(first) = resources.first() else {
        crate::observe::LockResult::Invalid.count();
        let none = KeyError::KeyCount {
            count: 0,
            max: MAX_KEYS_PER_LEASE,
        };
        return Err(reject(none.into()));
    };
    if let Some(status) = existing
        && resources.iter().all(|r| locks.names(status.lease(), r))
    {
        return Ok(Locked::new(value, status.clone(), None));
    }
    if locks.refuses(crate::backend::fallback::User::Locked) {
        // The fallback logged the fix once.
        return Err(reject(LockError::NoBackendChosen));
    }
    let started = std::time::Instant::now();
    let acquired = match &resources[..] {
        [resource] => locks.acquire_for(resource.as_str(), holder).await,
        _ => {
            let all = crate::lock::request::LockRequest::all(resources.iter().map(String::as_str));
            locks.acquire_for(all, holder).await
        }
    };
    crate::observe::lock_outcome(&acquired, started);
    match acquired {
        Ok(lease) => {
            let mut watchdog = Watchdog::new(locks.clone(), lease, Renewal::default());
            let status = watchdog.status();
            let renewer = tokio::spawn(async move {
                std::future::poll_fn(|cx| watchdog.poll_lost(cx)).await;
            });
            Ok(Locked::new(value, status, Some(Owned { locks, renewer })))
        }
        Err(e) => {
            if !matches!(
                e,
                LockError::Taken { .. } | LockError::InvalidKey(_) | LockError::NoBackendChosen
            ) {
                tracing::warn!(error = %e, "lock backend unavailable; answering 503");
            }
            // Retry-After from the hold times observed for the scope.
            let e = crate::key::with_scratch(|key| {
                key.push_str(locks.prefix());
                crate::key::push_escaped(key, first);
                locks.estimated(key, e)
            });
            Err(reject(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::body::Body;

    use super::*;
    use crate::MemoryLocks;

    #[derive(Debug, serde::Deserialize)]
    struct Transfer {
        from: String,
        to: String,
    }

    impl LockKeys for Transfer {
        const SCOPE: &'static str = "account";
        fn lock_keys(&self) -> Vec<Cow<'_, str>> {
            vec![Cow::Borrowed(&self.from), Cow::Borrowed(&self.to)]
        }
    }

    fn request(from: &str, to: &str) -> Request {
        http::Request::builder()
            .method("POST")
            .header("content-type", "application/json")
            .body(Body::from(format!(r#"{{"from": "{from}", "to": "{to}"}}"#)))
            .unwrap()
    }

    type Rejection = LockedRejection<axum::extract::rejection::JsonRejection>;

    async fn lock_body(
        locks: &Locks,
        from: &str,
        to: &str,
    ) -> Result<Locked<Json<Transfer>>, Rejection> {
        Locked::<Json<Transfer>>::from_request(request(from, to), locks).await
    }

    #[tokio::test]
    async fn a_body_value_locks_all_its_keys_with_one_lease() {
        let locks = Locks::from(
            MemoryLocks::builder()
                .ttl(Duration::from_secs(30))
                .build()
                .unwrap(),
        );
        let held = lock_body(&locks, "bob", "alice").await.unwrap();
        assert_eq!(
            held.lease().keys().collect::<Vec<_>>(),
            ["tower-redlock:account:alice", "tower-redlock:account:bob"]
        );
        assert_eq!(held.from, "bob");
        // Either account, in either order, is held.
        for (from, to) in [("alice", "carol"), ("carol", "bob")] {
            assert!(matches!(
                lock_body(&locks, from, to).await,
                Err(LockedRejection::Lock(p)) if p.status() == StatusCode::LOCKED
            ));
        }
        // Nothing of the refused sets was left held.
        locks.try_lock("account:carol").await.unwrap();
        let Json(transfer) = held.release().await.unwrap();
        assert_eq!(transfer.to, "alice");
        lock_body(&locks, "alice", "bob").await.unwrap();
    }

    #[tokio::test]
    async fn bad_keys_and_bad_bodies_are_refused() {
        let locks = Locks::from(MemoryLocks::new());
        assert!(matches!(
            lock_body(&locks, "alice", "").await,
            Err(LockedRejection::Lock(p)) if p.status() == StatusCode::BAD_REQUEST
        ));
        let not_json = http::Request::builder()
            .method("POST")
            .header("content-type", "application/json")
            .body(Body::from("{"))
            .unwrap();
        assert!(matches!(
            Locked::<Json<Transfer>>::from_request(not_json, &locks).await,
            Err(LockedRejection::Extract(_))
        ));
    }

    /// Names every id of its list.
    #[derive(Debug, serde::Deserialize)]
    struct Batch {
        ids: Vec<String>,
    }

    impl LockKeys for Batch {
        const SCOPE: &'static str = "item";
        fn lock_keys(&self) -> Vec<Cow<'_, str>> {
            self.ids
                .iter()
                .map(|id| Cow::Borrowed(id.as_str()))
                .collect()
        }
    }

    #[tokio::test]
    async fn an_empty_key_set_is_refused_with_400() {
        let locks = Locks::from(MemoryLocks::new());
        let empty = http::Request::builder()
            .method("POST")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"ids": []}"#))
            .unwrap();
        let Err(LockedRejection::Lock(rejection)) =
            Locked::<Json<Batch>>::from_request(empty, &locks).await
        else {
            panic!("an empty key set was locked");
        };
        assert_eq!(rejection.status(), StatusCode::BAD_REQUEST);
        assert_eq!(rejection.kind(), crate::RejectionKind::InvalidKey);
    }

    #[tokio::test]
    async fn a_layer_lease_on_every_key_is_reused() {
        let locks = Locks::from(MemoryLocks::new());
        let layer_lease = locks
            .acquire(crate::LockRequest::all(["account:alice", "account:bob"]))
            .await
            .unwrap();
        let watchdog = Watchdog::new(locks.clone(), layer_lease.clone(), Renewal::default());
        let mut with_set = request("alice", "bob");
        with_set.extensions_mut().insert(watchdog.status());
        let reused = Locked::<Json<Transfer>>::from_request(with_set, &locks)
            .await
            .unwrap();
        assert_eq!(reused.lease(), &layer_lease);
        // A lease on only one of them is not enough: the extractor locks for itself, and
        // finds the layer's key held.
        let one = locks.try_lock("account:carol").await.unwrap();
        let watchdog = Watchdog::new(locks.clone(), one, Renewal::default());
        let mut with_one = request("carol", "dave");
        with_one.extensions_mut().insert(watchdog.status());
        assert!(matches!(
            Locked::<Json<Transfer>>::from_request(with_one, &locks).await,
            Err(LockedRejection::Lock(p)) if p.status() == StatusCode::LOCKED
        ));
    }
}
