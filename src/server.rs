//! Listeners: gRPC (plain, TLS, or mTLS, certificates reloaded when their files change) with
//! grpc.health.v1, and HTTP /metrics, /healthz, /readyz.
//!
//! Every CloudProvider call passes [`Limits`] first: at most `--max-concurrent-requests` at a time,
//! answered within `--request-timeout`; none larger than `--max-message-size` (the gRPC library's
//! limit) and none whose few bytes would decode into far more memory (`crate::grpc::codec`) is
//! decoded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tonic::transport::Server;

mod deadlines;
mod limits;

pub use limits::Limits;

use crate::config::ServeArgs;
use crate::grpc::Service;
use crate::metrics::Metrics;
use crate::proto::cloud_provider_server::CloudProviderServer;
use crate::scale::Actuator;
use crate::startup::start_store;
use crate::tls::{ReloadingTls, TlsFiles};
use crate::version;
use crate::watch::{Store, WatchSettings};

/// The CloudProvider service as served: handlers over the actuator and its store.
type Provider = Service<Arc<Actuator>>;

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    tracing::info!(
        version = version::VERSION,
        commit = version::COMMIT,
        "capi-autoscaler-provider starting"
    );
    args.check_write_exposure().map_err(anyhow::Error::msg)?;
    let config = args.connection.config()?;
    let metrics = Arc::new(Metrics::new());
    metrics.watch_stale_after(args.watch_stale_after);
    // TLS files are read before anything else: a wrong path fails the start at once.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            ReloadingTls::new(
                TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: args.tls_client_ca.clone(),
                },
                Arc::clone(&metrics),
            )
            .map_err(|e| anyhow::anyhow!("TLS configuration: {e}"))?,
        ),
        _ => None,
    };
    let watch_settings = WatchSettings {
        timeout: args.watch_timeout,
        stale_after: args.watch_stale_after,
        ..Default::default()
    };
    let store = start_store(&config, Arc::clone(&metrics), true, watch_settings).await?;

    let (health, health_service) = tonic_health::server::health_reporter();
    // Both the overall status and the service's are NOT_SERVING until every watch has listed.
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<CloudProviderServer<Provider>>()
        .await;
    tokio::spawn(report_health(Arc::clone(&store), health));

    if let Some(address) = args.metrics_address.as_deref().filter(|a| !a.is_empty()) {
        let address: SocketAddr = address
            .parse()
            .with_context(|| format!("--metrics-address {address:?}"))?;
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .with_context(|| format!("binding {address}"))?;
        tracing::info!(%address, "serving /metrics, /healthz, /readyz");
        tokio::spawn(serve_http(
            listener,
            Arc::clone(&store),
            Arc::clone(&metrics),
            crate::check::fingerprint(&config),
        ));
    }

    let listener = tokio::net::TcpListener::bind(args.address)
        .await
        .with_context(|| format!("binding {}", args.address))?;
    tracing::info!(
        address = %args.address,
        tls = args.tls_cert.is_some(),
        mtls = args.tls_client_ca.is_some(),
        max_message_size = args.max_message_size,
        max_concurrent_requests = args.max_concurrent_requests,
        request_timeout = ?args.request_timeout,
        "serving externalgrpc CloudProvider"
    );
    let limits = Limits::new(
        args.max_message_size,
        args.max_concurrent_requests as usize,
        args.request_timeout,
        Arc::clone(&metrics),
    );
    let actuator =
        Arc::new(Actuator::new(store, Arc::clone(&metrics)).with_wait(args.request_timeout / 2));
    // An operation marks only within --request-timeout of its call, each write answered within
    // the API call timeout: a claim that stood longer than both is no removal's any more.
    let marking = args.request_timeout + crate::scale::CALL_TIMEOUT;
    if args.mark_grace_period < marking {
        tracing::warn!(
            mark_grace_period = ?args.mark_grace_period,
            "--mark-grace-period is shorter than --request-timeout plus the API call timeout ({marking:?}): with several providers, a repair could take back the claim of another's removal that may still mark its Machine"
        );
    }
    actuator.spawn_repair(args.repair_interval, args.mark_grace_period);
    let service = Service::new(actuator, metrics);
    let encoding = service.encode_on_publish();
    let router = Server::builder()
        .layer(limits)
        .add_service(health_service)
        .add_service(reflection_v1()?)
        .add_service(reflection_v1alpha()?)
        .add_service(
            CloudProviderServer::new(service).max_decoding_message_size(args.max_message_size),
        );
    // CA's calls are served on threads of their own: glibc gives each thread an arena, and the
    // threads that decode the watches and build the snapshots leave theirs holding the cache, in
    // pieces. A call's short-lived allocations searched those free lists (at 10,000 Machines malloc
    // and free were 7.7 % of this provider's CPU per call against 5 % for a server with no cache);
    // on threads that only answer calls they take 5 %, as in that server.
    let calls = tokio::runtime::Builder::new_multi_thread()
        .thread_name("grpc")
        .enable_all()
        .build()
        .context("starting the gRPC runtime")?;
    let listener = listener.into_std().context("gRPC listener")?;
    let served = calls.spawn(async move {
        tokio::spawn(encoding);
        let listener = tokio::net::TcpListener::from_std(listener)?;
        match tls {
            Some(tls) => {
                tls.spawn_poll();
                router
                    .serve_with_incoming_shutdown(tls.incoming(listener), shutdown())
                    .await
            }
            None => {
                router
                    .serve_with_incoming_shutdown(
                        tonic::transport::server::TcpIncoming::from(listener)
                            .with_nodelay(Some(true)),
                        shutdown(),
                    )
                    .await
            }
        }
        .context("gRPC server")
    });
    let result = served.await.context("gRPC server");
    // The server has stopped; whatever still runs there (a scale operation whose call timed out)
    // stops as it would when the process exits, which it does next.
    calls.shutdown_background();
    result?
}

/// Keeps grpc.health.v1 telling the truth: NOT_SERVING until every watch has listed, then SERVING
/// while no required watch is stale (failing for longer than `--watch-stale-after`, or forbidden or
/// not found at all), NOT_SERVING with the reason logged while one is.
async fn report_health(store: Arc<Store>, health: tonic_health::server::HealthReporter) {
    let started = Instant::now();
    let mut last_warning = Instant::now();
    while !store.wait_ready(Duration::from_secs(1)).await {
        let reasons = store.not_ready_reasons();
        if last_warning.elapsed() >= Duration::from_secs(30) {
            tracing::warn!(after = ?started.elapsed(), "not ready yet: {}", reasons.join("; "));
            last_warning = Instant::now();
        }
    }
    tracing::info!(after = ?started.elapsed(), groups = store.snapshot().groups.len(), "ready");
    let mut serving = false;
    let mut first = true;
    loop {
        let reasons = store.not_ready_reasons();
        match (serving, reasons.is_empty()) {
            (false, true) => {
                health.set_serving::<CloudProviderServer<Provider>>().await;
                health
                    .set_service_status("", tonic_health::ServingStatus::Serving)
                    .await;
                if !first {
                    tracing::info!("serving again: every watch is in sync");
                }
                first = false;
                serving = true;
            }
            (true, false) => {
                health
                    .set_not_serving::<CloudProviderServer<Provider>>()
                    .await;
                health
                    .set_service_status("", tonic_health::ServingStatus::NotServing)
                    .await;
                tracing::error!("not serving: {}", reasons.join("; "));
                serving = false;
            }
            _ => {}
        }
        store.publish_watch_metrics();
        // A watch failing or recovering wakes this at once; the stale bound passing is seen on the
        // next tick.
        tokio::select! {
            () = store.health_changed() => {},
            () = tokio::time::sleep(Duration::from_millis(500)) => {},
        }
    }
}

/// gRPC server reflection (v1, and v1alpha for older clients) over the CloudProvider, health and
/// reflection services: grpcurl and similar tools list and call them without the .proto files.
fn reflection_v1() -> anyhow::Result<
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("gRPC reflection (v1)")
}

fn reflection_v1alpha() -> anyhow::Result<
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .context("gRPC reflection (v1alpha)")
}

async fn shutdown() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = terminate => {},
    }
    tracing::info!("shutting down");
}

async fn serve_http(
    listener: tokio::net::TcpListener,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    fingerprint: String,
) {
    use axum::http::StatusCode;
    use axum::routing::get;
    let store_for_metrics = Arc::clone(&store);
    let store_for_check = Arc::clone(&store);
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = Arc::clone(&metrics);
                let store = Arc::clone(&store_for_metrics);
                async move {
                    store.publish_watch_metrics();
                    metrics.observe_groups(&store.snapshot());
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.encode(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        // What `check` and `explain` show, from this process's snapshot: run in the pod, they ask
        // here instead of building a second cache. Not before the snapshot is complete, and only to
        // the pod itself (see `loopback_only`).
        .route(
            "/check",
            get(move || {
                let store = Arc::clone(&store_for_check);
                let fingerprint = fingerprint.clone();
                async move {
                    if !store.is_complete() {
                        return (
                            StatusCode::SERVICE_UNAVAILABLE,
                            [("content-type", "text/plain; charset=utf-8")],
                            "not ready: the first complete view is not built yet\n".to_string(),
                        );
                    }
                    let served = crate::check::served_check(&store.snapshot(), &fingerprint);
                    (
                        StatusCode::OK,
                        [("content-type", "application/json")],
                        serde_json::to_string(&served).unwrap_or_default(),
                    )
                }
            })
            .route_layer(axum::middleware::from_fn(loopback_only)),
        )
        .route(
            "/readyz",
            get(move || {
                let store = Arc::clone(&store);
                async move {
                    // Empty exactly when every watch has listed, none is stale and the
                    // infrastructure templates referenced so far have listed or failed.
                    let reasons = store.not_ready_reasons();
                    if reasons.is_empty() {
                        (StatusCode::OK, "ready\n".to_string())
                    } else {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready:\n{}\n", reasons.join("\n")),
                        )
                    }
                }
            }),
        );
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("HTTP server: {e}");
    }
}

/// `/check` names every group, its Machines and its problems: it answers connections from the
/// loopback interface alone, that is `check` and `explain` run in a container of the provider's pod
/// (the pod's containers share its network), whatever `--metrics-address` the kubelet and Prometheus
/// reach `/metrics` and the probes on. Anything else gets 403.
async fn loopback_only(
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<SocketAddr>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if peer.ip().to_canonical().is_loopback() {
        return next.run(request).await;
    }
    (
        axum::http::StatusCode::FORBIDDEN,
        [("content-type", "text/plain; charset=utf-8")],
        format!(
            "/check answers only on loopback (`check` and `explain` run in the provider's container), not {peer}\n"
        ),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tonic::body::Body;

    /// `/check` behind [`loopback_only`], asked from `peer`: the status and body.
    async fn ask_check(peer: SocketAddr) -> (u16, String) {
        use tower::ServiceExt;
        let app = axum::Router::new()
            .route(
                "/check",
                axum::routing::get(|| async { "the report" })
                    .route_layer(axum::middleware::from_fn(loopback_only)),
            )
            .route("/metrics", axum::routing::get(|| async { "metrics" }))
            .layer(axum::extract::connect_info::MockConnectInfo(peer));
        let response = app
            .oneshot(http::Request::get("/check").body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn check_answers_the_pod_itself_and_refuses_the_network() {
        for peer in ["127.0.0.1:40000", "[::1]:40000", "[::ffff:127.0.0.1]:40000"] {
            let (status, body) = ask_check(peer.parse().unwrap()).await;
            assert_eq!((status, body.as_str()), (200, "the report"), "{peer}");
        }
        for peer in ["10.244.1.7:40000", "192.168.0.3:40000", "[fd00::7]:40000"] {
            let (status, body) = ask_check(peer.parse().unwrap()).await;
            assert_eq!(status, 403, "{peer}: {body}");
            assert!(body.contains("only on loopback"), "{body}");
        }
    }

    #[test]
    fn reflection_services_build_from_the_descriptor_sets() {
        // A descriptor set that does not decode, or a missing import, fails here and not at start-up.
        reflection_v1().unwrap();
        reflection_v1alpha().unwrap();
    }
}
