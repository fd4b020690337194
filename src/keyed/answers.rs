//! How one request's refusals are answered, chosen from its head before the inner service
//! gets it: problem+json, gRPC, or the layer's `on_rejection` (see
//! [`rejection`](crate::rejection)).

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, Response};

use crate::rejection::Rejection;

/// Whether a request is gRPC: its `content-type` starts with `application/grpc` (which
/// also covers `application/grpc+proto` and gRPC-Web).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// A layer's own rendering of its rejections for HTTP clients (`on_rejection`).
pub(crate) type RenderFn = dyn Fn(&Rejection) -> Response<Bytes> + Send + Sync;

/// How one request's refusals are answered: chosen from its head, where the layer may
/// answer it.
#[derive(Clone, Default)]
pub(crate) enum Rendering {
    /// `application/problem+json`, as rendered when the rejection was made.
    #[default]
    Problem,
    /// The gRPC answer.
    Grpc,
    /// The layer's `on_rejection` function.
    Custom(std::sync::Arc<RenderFn>),
}

impl Rendering {
    /// The answers for a request with `headers`, for a layer with `custom` rendering.
    #[inline]
    pub(crate) fn for_request(
        headers: &HeaderMap,
        custom: Option<&std::sync::Arc<RenderFn>>,
    ) -> Self {
        if is_grpc(headers) {
            Rendering::Grpc
        } else if let Some(render) = custom {
            Rendering::Custom(render.clone())
        } else {
            Rendering::Problem
        }
    }

    /// The response to hand on for a layer's own answer `response` (a problem, carrying
    /// its rejection).
    pub(crate) fn render(&self, response: Response<Bytes>) -> Response<Bytes> {
        if let Rendering::Problem = self {
            return response;
        }
        let Some(rejection) = response.extensions().get::<Rejection>() else {
            return response;
        };
        match self {
            Rendering::Problem => response,
            Rendering::Grpc => rejection.clone().into_grpc_response(),
            Rendering::Custom(render) => {
                let mut custom = render(rejection);
                if custom.extensions().get::<Rejection>().is_none() {
                    custom.extensions_mut().insert(rejection.clone());
                }
                custom
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn only_grpc_content_types_are_grpc() {
        let headers = |ct: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            h
        };
        assert!(is_grpc(&headers("application/grpc")));
        assert!(is_grpc(&headers("application/grpc+proto")));
        assert!(!is_grpc(&headers("application/json")));
        assert!(!is_grpc(&HeaderMap::new()));
    }
}
