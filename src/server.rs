//! Listeners: gRPC (plain, TLS, or mTLS, certificates reloaded when their files change) with
//! grpc.health.v1, and HTTP /metrics, /healthz, /readyz.
//!
//! Every CloudProvider call passes [`Limits`] first: at most `--max-concurrent-requests` at a time,
//! answered within `--request-timeout`, no request larger than `--max-message-size`, and none whose
//! few bytes would decode into far more memory (see [`crate::grpc::wire`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use anyhow::Context;
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::transport::Server;

use crate::config::ServeArgs;
use crate::grpc::Service;
use crate::grpc::wire::{self, Shape};
use crate::metrics::Metrics;
use crate::proto::METHODS;
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

/// The CloudProvider service's path prefix; health and reflection are not limited.
const CLOUD_PROVIDER: &str = "/clusterautoscaler.cloudprovider.v1.externalgrpc.CloudProvider/";

/// Memory a request that carries nodes (their labels and annotations) may decode into.
const NODE_REQUEST_BUDGET: u64 = 64 << 20;

/// The requests whose decoded form can be far larger than their bytes: they carry
/// `ExternalGrpcNode`s, whose maps and (for DeleteNodes) whose list cost hundreds of bytes per two
/// bytes on the wire. PricingPodPrice carries its pod as bytes, checked by the handler.
fn carries_nodes(method: &str) -> bool {
    matches!(
        method,
        "NodeGroupDeleteNodes" | "NodeGroupForNode" | "PricingNodePrice"
    )
}

/// Limits on every CloudProvider call, as a tower layer around the gRPC routes. One `Arc`: each
/// call takes one reference.
#[derive(Clone)]
pub struct Limits(Arc<Bounds>);

struct Bounds {
    max_message: usize,
    timeout: Duration,
    permits: Semaphore,
    concurrency: usize,
    metrics: Arc<Metrics>,
}

impl Limits {
    pub fn new(
        max_message: usize,
        concurrency: usize,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let concurrency = concurrency.clamp(1, Semaphore::MAX_PERMITS);
        Limits(Arc::new(Bounds {
            max_message,
            timeout,
            permits: Semaphore::new(concurrency),
            concurrency,
            metrics,
        }))
    }
}

impl Bounds {
    fn reject(
        &self,
        method: &'static str,
        reason: &'static str,
        status: tonic::Status,
    ) -> http::Response<Body> {
        self.metrics.rejected(method, reason);
        self.metrics.rpc(method, status.code(), Duration::ZERO);
        tracing::warn!(method, reason, "{}", status.message());
        status.into_http()
    }

    /// Reads the request (at most one message of `max_message` bytes) and, for requests that carry
    /// nodes, refuses it when its decoded form would pass [`NODE_REQUEST_BUDGET`]; else gives it back
    /// whole.
    async fn screen(
        &self,
        method: &'static str,
        request: http::Request<Body>,
    ) -> Result<http::Request<Body>, http::Response<Body>> {
        let (parts, body) = request.into_parts();
        // The gRPC frame: one byte "compressed", four bytes length, the message.
        let limit = self.max_message.saturating_add(5);
        let bytes = match http_body_util::Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(self.reject(
                    method,
                    "message-size",
                    tonic::Status::resource_exhausted(format!(
                        "{method}: the request is larger than --max-message-size ({} bytes)",
                        self.max_message
                    )),
                ));
            }
            Err(e) => {
                return Err(tonic::Status::cancelled(format!(
                    "{method}: reading the request: {e}"
                ))
                .into_http());
            }
        };
        // Unary: one frame. A compressed one is refused by the codec (no compression is enabled).
        if carries_nodes(method)
            && let Some((&0, rest)) = bytes.split_first()
            && let Some(message) = rest.get(4..)
            && let Err(e) = wire::cost(message, Shape::NodeRequest, NODE_REQUEST_BUDGET)
        {
            return Err(self.reject(
                method,
                "decoded-size",
                tonic::Status::resource_exhausted(format!(
                    "{method}: too many nodes, labels or annotations: {e}"
                )),
            ));
        }
        Ok(http::Request::from_parts(
            parts,
            Body::new(http_body_util::Full::new(bytes)),
        ))
    }
}

impl<S> tower::Layer<S> for Limits {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            limits: self.clone(),
        }
    }
}

/// The gRPC routes behind [`Limits`].
#[derive(Clone)]
pub struct Limited<S> {
    inner: S,
    limits: Limits,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S> tower::Service<http::Request<Body>> for Limited<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let method = request
            .uri()
            .path()
            .strip_prefix(CLOUD_PROVIDER)
            .map(|name| {
                METHODS
                    .into_iter()
                    .find(|m| *m == name)
                    .unwrap_or("unknown")
            });
        // The ready service answers this call; a clone takes its place for the next one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(method) = method else {
            return Box::pin(inner.call(request));
        };
        let limits = Arc::clone(&self.limits.0);
        Box::pin(async move {
            let deadline = tokio::time::Instant::now() + limits.timeout;
            // A permit is free but under load: no timer then.
            let permit = match limits.permits.try_acquire() {
                Ok(permit) => permit,
                Err(_) => match tokio::time::timeout_at(deadline, limits.permits.acquire()).await {
                    Ok(Ok(permit)) => permit,
                    Ok(Err(_)) | Err(_) => {
                        return Ok(limits.reject(
                            method,
                            "concurrency",
                            tonic::Status::unavailable(format!(
                                "{method}: {} calls in progress (--max-concurrent-requests) for longer than {:?}; retry",
                                limits.concurrency, limits.timeout
                            )),
                        ));
                    }
                },
            };
            let request = match tokio::time::timeout_at(deadline, limits.screen(method, request))
                .await
            {
                Ok(Ok(request)) => request,
                Ok(Err(response)) => return Ok(response),
                Err(_) => {
                    return Ok(limits.reject(
                        method,
                        "timeout",
                        tonic::Status::deadline_exceeded(format!(
                            "{method}: the request was not received within {:?} (--request-timeout)",
                            limits.timeout
                        )),
                    ));
                }
            };
            let response = match tokio::time::timeout_at(deadline, inner.call(request)).await {
                Ok(response) => response,
                Err(_) => Ok(limits.reject(
                    method,
                    "timeout",
                    tonic::Status::deadline_exceeded(format!(
                        "{method}: no answer within {:?} (--request-timeout); a scale operation that was accepted goes on to completion, retry to see its outcome",
                        limits.timeout
                    )),
                )),
            };
            drop(permit);
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    mod limits {
        use super::*;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tower::{Layer, Service as _};

        /// Stands in for the gRPC routes: reads the request, waits `delay`, answers OK.
        #[derive(Clone)]
        struct Routes {
            delay: Duration,
            called: Arc<AtomicUsize>,
            body_len: Arc<AtomicUsize>,
        }

        impl tower::Service<http::Request<Body>> for Routes {
            type Response = http::Response<Body>;
            type Error = Infallible;
            type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

            fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<Result<(), Infallible>> {
                Poll::Ready(Ok(()))
            }

            fn call(&mut self, request: http::Request<Body>) -> Self::Future {
                let me = self.clone();
                Box::pin(async move {
                    me.called.fetch_add(1, Ordering::SeqCst);
                    let body = request.into_body().collect().await.unwrap().to_bytes();
                    me.body_len.store(body.len(), Ordering::SeqCst);
                    tokio::time::sleep(me.delay).await;
                    Ok(tonic::Status::ok("").into_http())
                })
            }
        }

        fn routes(delay: Duration) -> Routes {
            Routes {
                delay,
                called: Arc::new(AtomicUsize::new(0)),
                body_len: Arc::new(AtomicUsize::new(0)),
            }
        }

        fn limits(concurrency: usize, timeout: Duration) -> Limits {
            Limits::new(1 << 20, concurrency, timeout, Arc::new(Metrics::new()))
        }

        /// A unary gRPC request to `method` carrying `message`.
        fn call(method: &str, message: &[u8]) -> http::Request<Body> {
            let mut framed = vec![0u8];
            framed.extend((message.len() as u32).to_be_bytes());
            framed.extend_from_slice(message);
            http::Request::post(format!("{CLOUD_PROVIDER}{method}"))
                .body(Body::new(http_body_util::Full::new(
                    prost::bytes::Bytes::from(framed),
                )))
                .unwrap()
        }

        fn code(response: &http::Response<Body>) -> tonic::Code {
            tonic::Status::from_header_map(response.headers())
                .map(|s| s.code())
                .unwrap_or(tonic::Code::Ok)
        }

        #[tokio::test]
        async fn a_normal_call_passes_whole() {
            let inner = routes(Duration::ZERO);
            let mut svc = limits(4, Duration::from_secs(1)).layer(inner.clone());
            let response = svc
                .call(call("NodeGroupDeleteNodes", &[0x12, 0x01, b'x']))
                .await
                .unwrap();
            assert_eq!(code(&response), tonic::Code::Ok);
            assert_eq!(inner.body_len.load(Ordering::SeqCst), 8);
        }

        #[tokio::test]
        async fn millions_of_empty_nodes_are_refused_before_decoding() {
            let inner = routes(Duration::ZERO);
            let mut svc = limits(4, Duration::from_secs(5)).layer(inner.clone());
            let nodes: Vec<u8> = std::iter::repeat_n([0x0a, 0x00], 500_000)
                .flatten()
                .collect();
            let response = svc
                .call(call("NodeGroupDeleteNodes", &nodes))
                .await
                .unwrap();
            assert_eq!(code(&response), tonic::Code::ResourceExhausted);
            assert_eq!(inner.called.load(Ordering::SeqCst), 0);
            // Over the size limit: refused whatever the method.
            let big = vec![0u8; (1 << 20) + 1];
            let response = svc.call(call("NodeGroupTargetSize", &big)).await.unwrap();
            assert_eq!(code(&response), tonic::Code::ResourceExhausted);
            assert_eq!(inner.called.load(Ordering::SeqCst), 0);
        }

        #[tokio::test]
        async fn a_slow_call_is_answered_deadline_exceeded_in_time() {
            let inner = routes(Duration::from_secs(30));
            let mut svc = limits(4, Duration::from_millis(200)).layer(inner);
            let started = Instant::now();
            let response = svc.call(call("NodeGroupIncreaseSize", &[])).await.unwrap();
            assert_eq!(code(&response), tonic::Code::DeadlineExceeded);
            assert!(started.elapsed() < Duration::from_secs(5));
        }

        #[tokio::test]
        async fn calls_over_the_concurrency_limit_wait_then_are_unavailable() {
            let inner = routes(Duration::from_secs(30));
            let layer = limits(1, Duration::from_millis(300));
            let mut first = layer.layer(inner.clone());
            let mut second = layer.layer(inner.clone());
            let busy = tokio::spawn(first.call(call("NodeGroups", &[])));
            // The first call holds the only permit until its own timeout.
            tokio::time::timeout(Duration::from_secs(5), async {
                while inner.called.load(Ordering::SeqCst) == 0 {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("the first call reaches the routes");
            let response = second.call(call("NodeGroups", &[])).await.unwrap();
            assert_eq!(code(&response), tonic::Code::Unavailable);
            assert_eq!(
                code(&busy.await.unwrap().unwrap()),
                tonic::Code::DeadlineExceeded
            );
            assert_eq!(inner.called.load(Ordering::SeqCst), 1);
        }

        #[tokio::test]
        async fn health_and_reflection_are_not_limited() {
            let inner = routes(Duration::from_millis(400));
            let mut svc = limits(1, Duration::from_millis(100)).layer(inner);
            let request = http::Request::post("/grpc.health.v1.Health/Check")
                .body(Body::empty())
                .unwrap();
            let response = svc.call(request).await.unwrap();
            assert_eq!(code(&response), tonic::Code::Ok);
        }
    }
}
