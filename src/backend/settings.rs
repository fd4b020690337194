//! Settings shared by both backends: TTL, retries, key prefix.

#[cfg(feature = "lock")]
use std::sync::Arc;
#[cfg(feature = "lock")]
use std::time::Duration;

#[cfg(any(feature = "lock", feature = "redis"))]
use crate::error::ConfigError;
use crate::key::{KeyError, MAX_RESOURCE_LEN};

/// Default lease TTL: 10 s.
#[cfg(feature = "lock")]
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// Default retries of [`Locks::lock`](crate::Locks::lock) after the first attempt: 3.
#[cfg(feature = "lock")]
pub(crate) const DEFAULT_RETRY_COUNT: u32 = 3;
/// Default random delay between retries: 50 to 250 ms, as go-redsync.
#[cfg(feature = "lock")]
pub(crate) const DEFAULT_RETRY_DELAY: (Duration, Duration) =
    (Duration::from_millis(50), Duration::from_millis(250));
/// Default key prefix.
#[cfg(feature = "lock")]
pub(crate) const DEFAULT_PREFIX: &str = "tower-redlock:";
/// Longest TTL accepted: 2^32 - 1 ms (about 49.7 days).
#[cfg(feature = "lock")]
pub(crate) const MAX_TTL: Duration = Duration::from_millis(u32::MAX as u64);
#[cfg(any(feature = "lock", feature = "redis"))]
const MAX_PREFIX_LEN: usize = 128;

/// Checks a key prefix: at most 128 bytes, no control characters, no `{` or `}` (a lock's
/// own keys are `<prefix>{<lock key>}:<role>`, a Redis Cluster hash tag over the whole
/// lock key).
#[cfg(any(feature = "lock", feature = "redis"))]
pub(crate) fn check_prefix(prefix: &str) -> Result<(), ConfigError> {
    if prefix.contains(['{', '}']) {
        return Err(ConfigError::BraceInPrefix(prefix.to_owned()));
    }
    if prefix.len() > MAX_PREFIX_LEN {
        return Err(ConfigError::InvalidPrefix(KeyError::TooLong {
            len: prefix.len(),
            max: MAX_PREFIX_LEN,
        }));
    }
    if prefix.chars().any(char::is_control) {
        return Err(ConfigError::InvalidPrefix(KeyError::ControlCharacter));
    }
    Ok(())
}

/// Checks a resource name given to a backend directly: not empty, at most
/// [`MAX_RESOURCE_LEN`] bytes, no control characters.
pub(crate) fn check_resource(resource: &str) -> Result<(), KeyError> {
    if resource.is_empty() {
        return Err(KeyError::Empty);
    }
    if resource.len() > MAX_RESOURCE_LEN {
        return Err(KeyError::TooLong {
            len: resource.len(),
            max: MAX_RESOURCE_LEN,
        });
    }
    if crate::key::has_control(resource) {
        return Err(KeyError::ControlCharacter);
    }
    Ok(())
}

#[cfg(feature = "lock")]
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) ttl: Duration,
    pub(crate) retry_count: u32,
    pub(crate) retry_delay: (Duration, Duration),
    pub(crate) prefix: Arc<str>,
    /// Whether acquisitions issue fencing tokens.
    pub(crate) fencing: bool,
    /// The replica id every lease records as its holder's (sanitised, bounded).
    pub(crate) replica: Arc<str>,
}

#[cfg(feature = "lock")]
impl Default for Settings {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            retry_count: DEFAULT_RETRY_COUNT,
            retry_delay: DEFAULT_RETRY_DELAY,
            prefix: Arc::from(DEFAULT_PREFIX),
            fencing: false,
            replica: crate::holder::default_replica_id(),
        }
    }
}

#[cfg(feature = "lock")]
impl Settings {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let ttl = self.ttl;
        if ttl.is_zero() || ttl > MAX_TTL {
            let reason = if ttl.is_zero() {
                "it must be above zero"
            } else {
                "it must be at most 4294967295 ms (about 49 days)"
            };
            return Err(ConfigError::InvalidTtl { ttl, reason });
        }
        let (min, max) = self.retry_delay;
        if min > max {
            return Err(ConfigError::InvalidRetryDelay { min, max });
        }
        check_prefix(&self.prefix)
    }

    /// `{prefix}{resource}`, after checking the resource, with `%`, `{` and `}` in the
    /// resource percent-encoded (see [`push_escaped`](crate::key::push_escaped)).
    pub(crate) fn full_key(&self, resource: &str) -> Result<Arc<str>, KeyError> {
        check_resource(resource)?;
        Ok(crate::key::shared_key(|key| {
            key.push_str(&self.prefix);
            crate::key::push_escaped(key, resource);
        }))
    }

    /// The keys of a lease on several resources: each as [`full_key`](Self::full_key),
    /// sorted by bytes and without duplicates, so that every holder takes them in one
    /// order and names them the same way whatever order the caller gave.
    ///
    /// # Errors
    ///
    /// The first invalid resource's [`KeyError`], or [`KeyError::KeyCount`] for none or
    /// more than [`MAX_KEYS_PER_LEASE`](crate::key::MAX_KEYS_PER_LEASE) distinct ones
    /// (the count then says how many were seen before giving up: one over the bound).
    pub(crate) fn key_set<I>(&self, resources: I) -> Result<Vec<Arc<str>>, KeyError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        use crate::key::MAX_KEYS_PER_LEASE;
        let mut keys = std::collections::BTreeSet::new();
        for resource in resources {
            keys.insert(self.full_key(resource.as_ref())?);
            // Refused as soon as there are too many: a huge input costs no more than this.
            if keys.len() > MAX_KEYS_PER_LEASE {
                break;
            }
        }
        if keys.is_empty() || keys.len() > MAX_KEYS_PER_LEASE {
            return Err(KeyError::KeyCount {
                count: keys.len(),
                max: MAX_KEYS_PER_LEASE,
            });
        }
        Ok(keys.into_iter().collect())
    }

    /// A random delay in `retry_delay`, uniformly, in whole milliseconds.
    pub(crate) fn retry_delay(&self) -> Duration {
        let (min, max) = self.retry_delay;
        let span = u64::try_from(max.saturating_sub(min).as_millis()).unwrap_or(u64::MAX);
        let jitter = match span.checked_add(1) {
            Some(n) => rand::random::<u64>() % n,
            None => rand::random::<u64>(),
        };
        min.saturating_add(Duration::from_millis(jitter))
    }

    #[cfg(feature = "redis")]
    pub(crate) fn ttl_ms(&self) -> u64 {
        // Bounded by MAX_TTL in validate().
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::from(u32::MAX))
    }
}

/// Setters shared by [`RedlockBuilder`](crate::RedlockBuilder) and
/// [`MemoryLocksBuilder`](crate::MemoryLocksBuilder).
#[cfg(feature = "lock")]
macro_rules! policy_setters {
    () => {
        /// The lease TTL: how long a lock lives if it is neither released nor extended.
        /// Default 10 s; at most 2^32 - 1 ms.
        pub fn ttl(mut self, ttl: std::time::Duration) -> Self {
            self.policy.ttl = ttl;
            self
        }

        /// How many times [`lock`](crate::Locks::lock) retries after a failed first
        /// attempt. Default 3; 0 makes it the same as `try_lock`.
        pub fn retry_count(mut self, retries: u32) -> Self {
            self.policy.retry_count = retries;
            self
        }

        /// The range of the random delay before each retry, so that contending clients
        /// spread out (the Redis docs' advice). Default 50 to 250 ms.
        pub fn retry_delay(mut self, min: std::time::Duration, max: std::time::Duration) -> Self {
            self.policy.retry_delay = (min, max);
            self
        }

        /// The prefix put before every key, so that several applications can share Redis.
        /// Default `"tower-redlock:"`; at most 128 bytes, no control characters, no `{`
        /// or `}` (a lock's own keys use the lock key as a Redis Cluster hash tag).
        pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
            self.policy.prefix = std::sync::Arc::from(prefix.into());
            self
        }

        /// Whether every exclusive lease carries a fencing token
        /// ([`Lease::fencing_token`](crate::Lease::fencing_token)), greater than every
        /// earlier lease's on the key, for storage that refuses writes from a holder whose
        /// lease ran out. Default off (on several Redis nodes it costs one more round trip
        /// per acquisition, on one node none); see the [lock module docs](crate::lock#fencing-tokens).
        pub fn fencing_tokens(mut self, enabled: bool) -> Self {
            self.policy.fencing = enabled;
            self
        }
    };
}
#[cfg(feature = "lock")]
pub(crate) use policy_setters;

#[cfg(all(test, any(feature = "lock", feature = "redis")))]
mod tests {
    use super::*;

    #[test]
    fn prefixes_with_braces_control_bytes_or_too_long_are_refused() {
        assert!(check_prefix("tower-redlock:").is_ok());
        assert!(check_prefix("").is_ok());
        for bad in ["{app}:", "app{", "app}"] {
            assert!(
                matches!(check_prefix(bad), Err(ConfigError::BraceInPrefix(p)) if p == bad),
                "{bad:?}"
            );
        }
        assert!(matches!(
            check_prefix("a\nb"),
            Err(ConfigError::InvalidPrefix(KeyError::ControlCharacter))
        ));
        assert!(matches!(
            check_prefix(&"p".repeat(MAX_PREFIX_LEN + 1)),
            Err(ConfigError::InvalidPrefix(KeyError::TooLong { .. }))
        ));
    }
}
