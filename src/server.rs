//! Listeners: gRPC (plain, TLS, or mTLS) with grpc.health.v1, and HTTP /metrics, /healthz, /readyz.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

use crate::config::{Config, KubeconfigSource, ServeArgs};
use crate::metrics::Metrics;
use crate::proto::cloud_provider_server::CloudProviderServer;
use crate::service::Service;
use crate::snapshot::Settings;
use crate::store::{CapiApis, Store};

/// A client for a kubeconfig file, or the inferred (in-cluster) configuration.
pub async fn client_for(source: &KubeconfigSource) -> anyhow::Result<Client> {
    let config = match source {
        KubeconfigSource::File(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        KubeconfigSource::Inferred => kube::Config::infer()
            .await
            .context("no in-cluster or default kubeconfig")?,
    };
    Client::try_from(config).context("building the Kubernetes client")
}

pub fn settings(config: &Config) -> Settings {
    Settings {
        keys: config.keys.clone(),
        discovery: config.discovery.clone(),
        default_arch: config.default_arch.clone(),
        cpu_hour_price: config.cpu_hour_price,
        gib_hour_price: config.gib_hour_price,
    }
}

/// Connects to the clusters, discovers the Cluster API version and starts the watches.
/// `events`: record problems as Events on the objects (the server does; read-only `check` does not).
pub async fn start_store(
    config: &Config,
    metrics: Arc<Metrics>,
    events: bool,
) -> anyhow::Result<Arc<Store>> {
    let management = client_for(&config.management)
        .await
        .context("management cluster")?;
    let workload = match &config.workload {
        Some(path) => Some(
            client_for(&KubeconfigSource::File(path.clone()))
                .await
                .context("workload cluster")?,
        ),
        None => None,
    };
    let apis = CapiApis::discover(
        &management,
        &config.keys.group,
        config.capi_version.as_deref(),
    )
    .await?;
    tracing::info!(group = %apis.group, version = %apis.version, kinds = ?apis.scalable.keys().collect::<Vec<_>>(), "using Cluster API");
    Ok(Store::start(
        management,
        workload,
        apis,
        settings(config),
        metrics,
        events,
    ))
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.connection.config()?;
    let metrics = Arc::new(Metrics::new());
    let store = start_store(&config, Arc::clone(&metrics), true).await?;

    let (health, health_service) = tonic_health::server::health_reporter();
    // Both the overall status and the service's are NOT_SERVING until every watch has listed.
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<CloudProviderServer<Service>>()
        .await;
    {
        let store = Arc::clone(&store);
        let health = health.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            while !store.wait_ready(Duration::from_secs(30)).await {
                tracing::warn!(after = ?started.elapsed(), "still waiting for the first list of every watched kind");
            }
            tracing::info!(after = ?started.elapsed(), groups = store.snapshot().groups.len(), "ready");
            health.set_serving::<CloudProviderServer<Service>>().await;
            health
                .set_service_status("", tonic_health::ServingStatus::Serving)
                .await;
        });
    }

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
        ));
    }

    let mut server = Server::builder();
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(read(cert)?, read(key)?));
        if let Some(ca) = &args.tls_client_ca {
            tls = tls.client_ca_root(Certificate::from_pem(read(ca)?));
        }
        server = server.tls_config(tls).context("TLS configuration")?;
    }
    let listener = tokio::net::TcpListener::bind(args.address)
        .await
        .with_context(|| format!("binding {}", args.address))?;
    tracing::info!(
        address = %args.address,
        tls = args.tls_cert.is_some(),
        mtls = args.tls_client_ca.is_some(),
        "serving externalgrpc CloudProvider"
    );
    server
        .add_service(health_service)
        .add_service(CloudProviderServer::new(Service::new(store, metrics)))
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown(),
        )
        .await
        .context("gRPC server")?;
    Ok(())
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

async fn serve_http(listener: tokio::net::TcpListener, store: Arc<Store>, metrics: Arc<Metrics>) {
    use axum::http::StatusCode;
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = Arc::clone(&metrics);
                async move {
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
        .route(
            "/readyz",
            get(move || {
                let store = Arc::clone(&store);
                async move {
                    if store.is_ready() {
                        (StatusCode::OK, "ready")
                    } else {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "listing Cluster API objects",
                        )
                    }
                }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("HTTP server: {e}");
    }
}
