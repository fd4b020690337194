//! The key of [`IdempotencyLayer`](super::IdempotencyLayer): a header's value, scoped by
//! the route and, optionally, a tenant taken from the request.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::HeaderName;
use http::request::Parts;

use crate::key::{HeaderKey, KeyError, KeyExtractor, validate_value};

pub(crate) type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The `Idempotency-Key` header's value, after the tenant if the layer has a tenant function
/// (`tenant <length>:<tenant>:<value>`); the scope is the header's (name, method, route).
#[derive(Clone)]
pub struct IdempotencyKey {
    header: HeaderKey,
    tenant: Option<Arc<TenantFn>>,
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("header", &self.header)
            .field("tenant", &self.tenant.is_some())
            .finish()
    }
}

impl IdempotencyKey {
    pub(crate) fn new(name: HeaderName) -> Self {
        Self {
            header: HeaderKey::new(name),
            tenant: None,
        }
    }

    pub(crate) fn with_tenant(&self, tenant: Arc<TenantFn>) -> Self {
        Self {
            header: self.header.clone(),
            tenant: Some(tenant),
        }
    }
}

impl KeyExtractor for IdempotencyKey {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Option<Cow<'a, str>>, KeyError> {
        let Some(tenant) = &self.tenant else {
            return self.header.extract(parts);
        };
        let tenant = tenant(parts).ok_or(KeyError::MissingTenant)?;
        validate_value(&tenant)?;
        let Some(value) = self.header.extract(parts)? else {
            return Ok(None);
        };
        // Checked alone as well: behind the tenant, an empty key would pass as a key.
        validate_value(&value)?;
        // In the value, not the scope (hold times are per route); its length first, so that
        // no tenant and key pair reads as another's.
        Ok(Some(Cow::Owned(format!(
            "tenant {}:{tenant}:{value}",
            tenant.len()
        ))))
    }

    fn write_scope(&self, parts: &Parts, out: &mut String) {
        self.header.write_scope(parts, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(key: &str, tenant: &str) -> Parts {
        let request = http::Request::builder()
            .header("idempotency-key", key)
            .header("x-tenant", tenant)
            .body(())
            .unwrap();
        request.into_parts().0
    }

    #[test]
    fn a_tenant_does_not_make_an_empty_key_valid() {
        let tenant: Arc<TenantFn> =
            Arc::new(|p: &Parts| Some(p.headers.get("x-tenant")?.to_str().ok()?.to_owned()));
        let key =
            IdempotencyKey::new(HeaderName::from_static("idempotency-key")).with_tenant(tenant);
        let extract = |k: &str, t: &str| {
            key.extract(&mut parts(k, t))
                .map(|v| v.map(Cow::into_owned))
        };
        assert_eq!(extract("", "acme"), Err(KeyError::Empty));
        assert_eq!(extract("\"\"", "acme"), Err(KeyError::Empty));
        assert_eq!(extract("k", ""), Err(KeyError::Empty));
        assert_eq!(
            extract("k-1", "acme").unwrap().as_deref(),
            Some("tenant 4:acme:k-1")
        );
    }
}
