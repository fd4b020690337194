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
        // In the value, not the scope (hold times are per route); its length first, so that
        // no tenant and key pair reads as another's.
        Ok(self
            .header
            .extract(parts)?
            .map(|value| Cow::Owned(format!("tenant {}:{tenant}:{value}", tenant.len()))))
    }

    fn write_scope(&self, parts: &Parts, out: &mut String) {
        self.header.write_scope(parts, out);
    }
}
