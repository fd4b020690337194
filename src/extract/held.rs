//! Extractors for what a layer put on the request.

use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;

use crate::rejection::{RejectedBy, Rejection};

/// The rejection of the [`Lease`](crate::Lease), [`LeaseStatus`](crate::LeaseStatus) and
/// [`Usage`](crate::Usage) extractors when the request did not pass a layer that admitted
/// it: the route has no such layer, or the layer let the request through unguarded (it
/// failed open, or the key was optional and absent). Take an `Option<...>` where that can
/// happen.
///
/// It answers **500** (`application/problem+json`, nothing internal): a handler that needs
/// a lease without one is the server's mistake. The first one of each kind is logged at
/// `error` level with the fix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotGuarded {
    what: &'static str,
    layer: &'static str,
}

impl fmt::Display for NotGuarded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no {} on the request: the handler is not behind a {} that admitted it \
             (take Option<{}> where the layer may let requests through unguarded)",
            self.what, self.layer, self.what
        )
    }
}

impl std::error::Error for NotGuarded {}

impl IntoResponse for NotGuarded {
    fn into_response(self) -> Response {
        Rejection::misconfigured(RejectedBy::Lock).into_response()
    }
}

/// Logs `rejection` the first time `logged` is seen unset.
fn report(logged: &AtomicBool, rejection: NotGuarded) -> NotGuarded {
    if !logged.swap(true, Ordering::Relaxed) {
        tracing::error!("{rejection}");
    }
    rejection
}

/// Implements the extractor and its `Option` for a type read from the request extensions.
macro_rules! held_extractor {
    ($(#[$cfg:meta])* $ty:ty, $name:literal, $layer:literal, |$parts:ident| $read:expr) => {
        $(#[$cfg])*
        impl<S: Send + Sync> FromRequestParts<S> for $ty {
            type Rejection = NotGuarded;

            async fn from_request_parts($parts: &mut Parts, _: &S) -> Result<Self, NotGuarded> {
                static LOGGED: AtomicBool = AtomicBool::new(false);
                let rejection = NotGuarded {
                    what: $name,
                    layer: $layer,
                };
                $read.ok_or_else(|| report(&LOGGED, rejection))
            }
        }

        $(#[$cfg])*
        impl<S: Send + Sync> OptionalFromRequestParts<S> for $ty {
            type Rejection = Infallible;

            async fn from_request_parts(
                $parts: &mut Parts,
                _: &S,
            ) -> Result<Option<Self>, Infallible> {
                Ok($read)
            }
        }
    };
}

held_extractor!(
    #[cfg(feature = "lock")]
    crate::LeaseStatus,
    "LeaseStatus",
    "LockLayer",
    |parts| parts.extensions.get::<crate::LeaseStatus>().cloned()
);

held_extractor!(
    #[cfg(feature = "lock")]
    crate::Lease,
    "Lease",
    "LockLayer",
    |parts| parts
        .extensions
        .get::<crate::LeaseStatus>()
        .map(|status| status.lease().clone())
);

held_extractor!(
    #[cfg(feature = "rate-limit")]
    crate::Usage,
    "Usage",
    "RateLimitLayer",
    |parts| parts.extensions.get::<crate::Usage>().copied()
);
