//! The `flash_sale` example's metrics: the Prometheus recorder behind `GET /metrics`, and
//! the count of every answer the example gives.

use std::time::Duration;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Counts every answer: `flash_sale_http_responses_total{route, status}`.
pub(crate) async fn count_responses(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    metrics::counter!(
        "flash_sale_http_responses_total",
        "route" => route,
        "status" => response.status().as_u16().to_string()
    )
    .increment(1);
    response
}

/// Installs the Prometheus recorder, with histogram buckets from 1 ms to 10 s for the
/// `_seconds` metrics, and drains it every 5 s.
pub(crate) fn prometheus() -> Result<PrometheusHandle, Box<dyn std::error::Error>> {
    let handle = PrometheusBuilder::new()
        .set_buckets(&[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ])?
        .install_recorder()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}
