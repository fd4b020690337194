//! The key of [`IdempotencyLayer`](super::IdempotencyLayer): a header's value, scoped by
//! the route and, optionally, a tenant taken from the request.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::HeaderName;
use http::request::Parts;

use crate::key::{HeaderKey, KeyError, KeyExtractor, push_escaped, validate_value};

pub(crate) type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The `Idempotency-Key` header's value; the scope is the tenant (when the layer has a
/// tenant function), then the header's own scope (the header name, the method and the
/// route).
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
        if let Some(tenant) = &self.tenant {
            let tenant = tenant(parts).ok_or(KeyError::MissingTenant)?;
            validate_value(&tenant)?;
        }
        self.header.extract(parts)
    }

    fn write_scope(&self, parts: &Parts, out: &mut String) {
        if let Some(tenant) = self.tenant.as_ref().and_then(|t| t(parts)) {
            out.push_str("tenant ");
            push_escaped(out, &tenant);
            out.push(' ');
        }
        self.header.write_scope(parts, out);
    }
}
