//! Keys in log lines: by default a key's scope and a short hash, never its value, so that
//! Idempotency-Key values, account ids and tenant names stay out of the logs.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};

static FULL_KEYS: AtomicBool = AtomicBool::new(false);

/// Keyed at random once per process: stable within a process's logs, not computable
/// from outside for a guessable value.
static HASHER: LazyLock<std::collections::hash_map::RandomState> =
    LazyLock::new(std::collections::hash_map::RandomState::new);

/// The crate's default key prefixes, whose next segment (up to `:`) is the key's scope.
const PREFIXES: [&str; 3] = [
    "tower-redlock-concurrency:",
    "tower-redlock-rate:",
    "tower-redlock:",
];

/// Whether log lines carry whole keys (`true`) or, the default, each key's scope and a
/// short hash, keyed at random per process: `POST /orders:#5c1f09ab`. Applies to the
/// whole process.
///
/// ```
/// tower_redlock::log_full_keys(false); // the default
/// ```
pub fn log_full_keys(full: bool) {
    FULL_KEYS.store(full, Ordering::Relaxed);
}

/// A key as log lines show it (see [`log_full_keys`]).
pub(crate) struct LogKey<'a>(pub(crate) &'a str);

impl fmt::Display for LogKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = self.0;
        if FULL_KEYS.load(Ordering::Relaxed) {
            return f.write_str(key);
        }
        let mut hasher = HASHER.build_hasher();
        hasher.write(key.as_bytes());
        let hash = hasher.finish() >> 32;
        match scope_of(key) {
            Some(scope) => write!(f, "{scope}:#{hash:08x}"),
            None => write!(f, "#{hash:08x}"),
        }
    }
}

impl fmt::Debug for LogKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// The scope of a key under a default prefix: the segment after the prefix, up to `:`;
/// for a key with a hash tag (a lock's own key `<prefix>{<lock key>}:<role>`, a permit set
/// `<prefix>{<resource>}`), the scope of what the tag holds. `None` for another prefix.
fn scope_of(key: &str) -> Option<&str> {
    fn strip(key: &str) -> Option<&str> {
        PREFIXES.iter().find_map(|p| key.strip_prefix(p))
    }
    let rest = strip(key)?;
    let rest = match rest.strip_prefix('{') {
        Some(tagged) => strip(tagged).unwrap_or(tagged),
        None => rest,
    };
    // The lock key ends at a `}` (values have their braces escaped).
    let lock_key = rest.split('}').next().unwrap_or(rest);
    let (scope, _) = lock_key.split_once(':')?;
    Some(scope)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_shows_its_scope_and_a_hash_not_its_value() {
        let shown = |key: &str| LogKey(key).to_string();
        let lock = shown("tower-redlock:POST /orders:acct-42");
        assert!(lock.starts_with("POST /orders:#"), "{lock}");
        assert!(!lock.contains("acct-42"));
        assert_eq!(lock, shown("tower-redlock:POST /orders:acct-42"), "stable");
        assert_ne!(lock, shown("tower-redlock:POST /orders:acct-43"));
        let fence = shown("tower-redlock:{tower-redlock:POST /orders:acct-42}:fence");
        assert!(fence.starts_with("POST /orders:#") && !fence.contains("acct"));
        let permit = shown("tower-redlock-concurrency:{x-tenant:acme}");
        assert!(permit.starts_with("x-tenant:#") && !permit.contains("acme"));
        // A resource without a scope shows no part of itself.
        let bare = shown("tower-redlock:{tower-redlock:acct-42}:fence");
        assert!(bare.starts_with('#') && !bare.contains("acct"), "{bare}");
        let other = shown("myapp:orders:acct-42");
        assert!(other.starts_with('#') && !other.contains("acct"), "{other}");
    }
}
