//! The key of [`IdempotencyLayer`](super::IdempotencyLayer): a header's value, scoped by
//! the route and bound to the caller that sent it (its principal).

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::hash::BuildHasher as _;
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderName, header};
use sha2::{Digest, Sha256};

use crate::backend::records::{Owner, RecordOwner};
use crate::key::{HeaderKey, KeyError, KeyExtractor, push_escaped, validate_value};

pub(crate) type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The request headers whose values name the caller by default: `Authorization` and
/// `Cookie`.
pub const DEFAULT_CREDENTIAL_HEADERS: [HeaderName; 2] = [header::AUTHORIZATION, header::COOKIE];

/// Who a key belongs to: a record is only ever replayed to requests of the same
/// principal.
#[derive(Clone)]
enum Principal {
    /// A digest of these headers' values (none present: the anonymous principal).
    Credentials(Arc<[HeaderName]>),
    /// The application's own principal.
    Tenant(Arc<TenantFn>),
}

/// One request's principal, as written before its key's value.
enum Bound {
    Tenant(String),
    Credentials([u8; 32]),
    Anonymous,
}

/// The `Idempotency-Key` header's value, bound to the request's principal.
///
/// The value of the lock (and record) key is one of, with the header's value
/// percent-encoded as every key value is:
/// - `credentials <digest>:<value>`, where `<digest>` is 32 hex digits, the first 128 bits
///   of the SHA-256 of the credential headers' values (by default `Authorization` and
///   `Cookie`, see [`DEFAULT_CREDENTIAL_HEADERS`]), each length-prefixed: the credentials
///   are never stored in clear;
/// - `anonymous:<value>` for a request without any of those headers: every such caller
///   shares one principal;
/// - `tenant <length>:<tenant>:<value>` with a tenant function
///   ([`IdempotencyLayer::tenant`](super::IdempotencyLayer::tenant)).
///
/// Each form starts with its own word and fixes the length of what comes before the
/// value, so that no principal and value pair reads as another's. The scope is the
/// header's (name, method, route).
#[derive(Clone)]
pub struct IdempotencyKey {
    header: HeaderKey,
    principal: Principal,
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("IdempotencyKey");
        debug.field("header", &self.header);
        match &self.principal {
            Principal::Credentials(names) => debug.field("credentials", names),
            Principal::Tenant(_) => debug.field("tenant", &true),
        };
        debug.finish()
    }
}

impl IdempotencyKey {
    pub(crate) fn new(name: HeaderName) -> Self {
        Self {
            header: HeaderKey::new(name),
            principal: Principal::Credentials(Arc::from(DEFAULT_CREDENTIAL_HEADERS.as_slice())),
        }
    }

    pub(crate) fn with_tenant(&self, tenant: Arc<TenantFn>) -> Self {
        Self {
            header: self.header.clone(),
            principal: Principal::Tenant(tenant),
        }
    }

    pub(crate) fn with_credentials(&self, names: Arc<[HeaderName]>) -> Self {
        Self {
            header: self.header.clone(),
            principal: Principal::Credentials(names),
        }
    }
}

/// The first 128 bits of the SHA-256 of the values of the headers `names` (each value
/// length-prefixed, after its header's index), in hex and as a number; `None` when the
/// request has none of them.
fn credentials_digest(parts: &Parts, names: &[HeaderName]) -> Option<([u8; 32], Owner)> {
    let mut hash: Option<Sha256> = None;
    for (index, name) in names.iter().enumerate() {
        for value in parts.headers.get_all(name) {
            let hash = hash.get_or_insert_with(Sha256::new);
            hash.update((index as u64).to_be_bytes());
            hash.update((value.len() as u64).to_be_bytes());
            hash.update(value.as_bytes());
        }
    }
    let digest = hash?.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(digest.get(..16)?);
    let mut hex = [0u8; 32];
    for (pair, byte) in hex.chunks_exact_mut(2).zip(digest.iter()) {
        if let [high, low] = pair {
            *high = hex_digit(byte >> 4);
            *low = hex_digit(byte & 0x0f);
        }
    }
    Some((hex, Owner::from_be_bytes(first)))
}

/// The lowercase hex digit of `nibble`, its low four bits.
fn hex_digit(nibble: u8) -> u8 {
    match nibble & 0x0f {
        low @ 0..=9 => b'0' + low,
        high => b'a' + (high - 10),
    }
}

impl KeyExtractor for IdempotencyKey {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        let mut out = String::new();
        Ok(self
            .write_value(parts, &mut out)?
            .then_some(Cow::Owned(out)))
    }

    // The header's value is checked on its own (the principal does not count against its
    // length bound), then written after its principal.
    fn write_value(&self, parts: &mut Parts, out: &mut String) -> Result<bool, KeyError> {
        // The principal first: the header's value borrows the request.
        let principal = match &self.principal {
            Principal::Tenant(tenant) => {
                let tenant = tenant(parts).ok_or(KeyError::MissingTenant)?;
                validate_value(&tenant)?;
                let owner = foldhash::fast::FixedState::with_seed(0).hash_one(&tenant);
                parts.extensions.insert(RecordOwner(Owner::from(owner)));
                Bound::Tenant(tenant)
            }
            Principal::Credentials(names) => match credentials_digest(parts, names) {
                Some((hex, owner)) => {
                    parts.extensions.insert(RecordOwner(owner));
                    Bound::Credentials(hex)
                }
                None => {
                    parts.extensions.insert(RecordOwner(0));
                    Bound::Anonymous
                }
            },
        };
        let Some(value) = self.header.extract(parts)? else {
            return Ok(false);
        };
        validate_value(&value)?;
        match principal {
            Bound::Tenant(tenant) => {
                let _ = write!(out, "tenant {}:", tenant.len());
                push_escaped(out, &tenant);
            }
            Bound::Credentials(hex) => {
                out.push_str("credentials ");
                // Hex digits only: ASCII.
                out.extend(hex.iter().map(|&b| char::from(b)));
            }
            Bound::Anonymous => out.push_str("anonymous"),
        }
        out.push(':');
        push_escaped(out, &value);
        Ok(true)
    }

    fn write_scope(&self, parts: &Parts, out: &mut String) {
        self.header.write_scope(parts, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut request = http::Request::builder().method("POST").uri("/orders");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    fn key_of(extractor: &IdempotencyKey, headers: &[(&str, &str)]) -> Option<String> {
        let mut out = String::new();
        let written = extractor.write_value(&mut parts(headers), &mut out);
        written.unwrap().then_some(out)
    }

    #[test]
    fn keys_are_bound_to_the_credentials_they_came_with() {
        let key = IdempotencyKey::new(HeaderName::from_static("idempotency-key"));
        let a = key_of(
            &key,
            &[("idempotency-key", "k"), ("authorization", "Bearer a")],
        );
        let b = key_of(
            &key,
            &[("idempotency-key", "k"), ("authorization", "Bearer b")],
        );
        let cookie = key_of(&key, &[("idempotency-key", "k"), ("cookie", "session=a")]);
        let none = key_of(&key, &[("idempotency-key", "k")]);
        let a = a.unwrap();
        assert!(a.starts_with("credentials ") && a.ends_with(":k"), "{a}");
        assert!(!a.contains("Bearer"), "credentials are hashed: {a}");
        assert_eq!(a.len(), "credentials ".len() + 32 + ":k".len());
        assert_ne!(Some(&a), b.as_ref());
        assert_ne!(Some(&a), cookie.as_ref());
        assert_eq!(none.as_deref(), Some("anonymous:k"));
        // The same credentials give the same key.
        let again = key_of(
            &key,
            &[("idempotency-key", "k"), ("authorization", "Bearer a")],
        );
        assert_eq!(Some(a), again);
        // A header's value cannot pass for another header's.
        let moved = key_of(&key, &[("idempotency-key", "k"), ("cookie", "Bearer a")]);
        let first = key_of(
            &key,
            &[("idempotency-key", "k"), ("authorization", "Bearer a")],
        );
        assert_ne!(moved, first);
    }

    #[test]
    fn no_value_can_pass_for_another_principal() {
        let key = IdempotencyKey::new(HeaderName::from_static("idempotency-key"));
        let bound = key_of(&key, &[("idempotency-key", "k"), ("authorization", "x")]).unwrap();
        // An anonymous caller who sends the bound key's value as its own key gets
        // another key.
        let forged = key_of(&key, &[("idempotency-key", &bound)]).unwrap();
        assert_ne!(forged, bound);
        assert!(forged.starts_with("anonymous:"));
    }

    #[test]
    fn the_value_alone_counts_against_the_length_bound() {
        let key = IdempotencyKey::new(HeaderName::from_static("idempotency-key"));
        let longest = "k".repeat(crate::key::MAX_KEY_LEN);
        let headers = [
            ("idempotency-key", longest.as_str()),
            ("authorization", "a"),
        ];
        assert!(key_of(&key, &headers).is_some());
        let over = "k".repeat(crate::key::MAX_KEY_LEN + 1);
        let mut out = String::new();
        let headers = [("idempotency-key", over.as_str()), ("authorization", "a")];
        assert!(matches!(
            key.write_value(&mut parts(&headers), &mut out),
            Err(KeyError::TooLong { .. })
        ));
    }

    #[test]
    fn a_tenant_replaces_the_credentials() {
        let key =
            IdempotencyKey::new(HeaderName::from_static("idempotency-key")).with_tenant(Arc::new(
                |parts: &Parts| Some(parts.headers.get("x-tenant")?.to_str().ok()?.to_owned()),
            ));
        let value = key_of(&key, &[("idempotency-key", "k"), ("x-tenant", "acme")]);
        assert_eq!(value.as_deref(), Some("tenant 4:acme:k"));
        let mut out = String::new();
        let missing = key.write_value(&mut parts(&[("idempotency-key", "k")]), &mut out);
        assert!(matches!(missing, Err(KeyError::MissingTenant)));
    }

    #[test]
    fn a_tenant_does_not_make_an_empty_key_valid() {
        let key =
            IdempotencyKey::new(HeaderName::from_static("idempotency-key")).with_tenant(Arc::new(
                |parts: &Parts| Some(parts.headers.get("x-tenant")?.to_str().ok()?.to_owned()),
            ));
        let extract = |k: &str, t: &str| {
            let mut out = String::new();
            let mut parts = parts(&[("idempotency-key", k), ("x-tenant", t)]);
            key.write_value(&mut parts, &mut out).map(|_| out)
        };
        assert_eq!(extract("", "acme"), Err(KeyError::Empty));
        assert_eq!(extract("\"\"", "acme"), Err(KeyError::Empty));
        assert_eq!(extract("k", ""), Err(KeyError::Empty));
        assert_eq!(extract("k-1", "acme").as_deref(), Ok("tenant 4:acme:k-1"));
    }
}
