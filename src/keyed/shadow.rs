//! Shadow (dry-run) mode: a layer that decides as usual, counts and logs what it would have
//! refused, and lets every request through.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::Response;

use super::policy::Policy;
use crate::rejection::{Rejection, RejectionKind};

/// A switch that puts a layer in shadow (dry-run) mode, at build time or at run time.
///
/// A layer in shadow mode decides as usual (a lock is taken, a request counted, a
/// permit held) but never answers for the inner service: what it would have refused (a
/// 409/423, a 429, a 503, a 400 for a missing key, a replay) goes on to the inner service
/// untouched, and is counted in `tower_redlock_shadow_refusals_total` (labels `layer`,
/// `kind`) and logged at `info` at most once per 10 s for each kind of layer. A lease
/// lost while the request runs lets it run on. Use it to roll out a new key rule or
/// limit on live traffic, then turn it off.
///
/// Cloning shares the switch: hand one clone to the layer and keep the other, for
/// example in your configuration reload, to flip it without a restart. A `bool` is a
/// switch set once.
///
/// ```
/// use tower_redlock::{LockLayer, Shadow};
///
/// let shadow = Shadow::new(true);
/// let layer = LockLayer::by_header("Idempotency-Key").shadow(shadow.clone());
/// // Later, once the counts look right:
/// shadow.set(false);
/// assert!(!shadow.is_on());
/// ```
///
/// The body limits of [`LockLayer`](crate::LockLayer) and
/// [`IdempotencyLayer`](crate::IdempotencyLayer) (413, 408) hold in shadow mode too: they
/// bound what the layer reads, not who may pass.
#[derive(Clone, Default)]
pub struct Shadow(Arc<AtomicBool>);

impl Shadow {
    /// A switch, on or off.
    pub fn new(on: bool) -> Self {
        Self(Arc::new(AtomicBool::new(on)))
    }

    /// Turns shadow mode on or off for every layer that holds this switch, from the next
    /// request on.
    pub fn set(&self, on: bool) {
        self.0.store(on, Ordering::Relaxed);
    }

    /// Whether shadow mode is on.
    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl From<bool> for Shadow {
    fn from(on: bool) -> Self {
        Self::new(on)
    }
}

impl fmt::Debug for Shadow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Shadow").field(&self.is_on()).finish()
    }
}

/// The label of what a layer in shadow mode would have answered: its rejection's kind,
/// or `replay` for a stored response.
fn kind(response: &Response<Bytes>) -> &'static str {
    let Some(rejection) = response.extensions().get::<Rejection>() else {
        return "replay";
    };
    match rejection.kind() {
        RejectionKind::Taken => "taken",
        RejectionKind::InFlight => "in_flight",
        RejectionKind::MissingKey => "missing_key",
        RejectionKind::InvalidKey => "invalid_key",
        RejectionKind::Mismatch => "mismatch",
        RejectionKind::Unreplayable => "unreplayable",
        RejectionKind::Limited => "limited",
        RejectionKind::TooLarge => "too_large",
        RejectionKind::RequestTimeout => "request_timeout",
        RejectionKind::Unavailable => "unavailable",
        RejectionKind::Lost => "lost",
        RejectionKind::Misconfigured => "misconfigured",
    }
}

/// Counts and logs (at most once per 10 s for each kind of layer) a refusal that a layer
/// in shadow mode let through: `answer`, or the store being unavailable.
pub(crate) fn let_through<P: Policy>(answer: Option<&Response<Bytes>>) {
    let kind = answer.map_or("unavailable", kind);
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tower_redlock_shadow_refusals_total",
        "layer" => P::REJECTED_BY.layer(),
        "kind" => kind
    )
    .increment(1);
    if let Some(unlogged) = super::outage::due::<P>(super::outage::Log::Shadow) {
        tracing::info!(
            layer = P::REJECTED_BY.layer(),
            kind,
            unlogged,
            "shadow mode: a refusal was let through; at most one such line per 10 s for this kind of layer ({unlogged} unlogged since the last one; tower_redlock_shadow_refusals_total counts each)"
        );
    }
}
