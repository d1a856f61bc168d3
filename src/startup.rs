//! From configuration to running watches: the Kubernetes clients (with our User-Agent), Cluster API
//! discovery, the snapshot settings and the store. Shared by `serve` and `check`.

use std::sync::Arc;

use anyhow::Context;
use hyper_rustls::{FixedServerNameResolver, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::Client;
use kube::client::retry::RetryPolicy;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio_rustls::rustls::pki_types::ServerName;
use tower::retry::RetryLayer;
use tower::util::MapResponseLayer;
use tower::{BoxError, ServiceBuilder};

use crate::apis::CapiApis;
use crate::config::{ApiPing, Config, KubeconfigSource};
use crate::metrics::Metrics;
use crate::server_clock::ServerClock;
use crate::snapshot::Settings;
use crate::version;
use crate::watch::{ManagementApi, Store, Streaming, WatchSettings, streams_initial_lists};

/// The client configuration for a kubeconfig file, or the inferred (in-cluster) configuration, with
/// our User-Agent on every request.
pub async fn kube_config(source: &KubeconfigSource) -> anyhow::Result<kube::Config> {
    let mut config = match source {
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
    // kube sends no User-Agent of its own: without ours the apiserver's audit log shows none and
    // merge patches get no field manager named after us.
    config
        .headers
        .retain(|(name, _)| name != http::header::USER_AGENT);
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(version::USER_AGENT),
    ));
    Ok(config)
}

/// A client for a kubeconfig file, or the inferred (in-cluster) configuration; `clock` learns the
/// API server's time from every answer.
pub async fn client_for(
    source: &KubeconfigSource,
    ping: ApiPing,
    clock: &ServerClock,
) -> anyhow::Result<Client> {
    let config = kube_config(source).await?;
    client(config, ping, clock).context("building the Kubernetes client")
}

/// A client that speaks HTTP/2 where the API server offers it (ALPN), as client-go does: every
/// watch and every write share one connection, which the watches keep open. kube's own client
/// speaks HTTP/1.1 only: a connection per watch, and an idle one closes after 90 s, so a write (CA
/// scales now and then) usually waited for a new TCP and TLS connection first, the slowest part of
/// a write against a busy API server. Everything else is kube's: TLS identity and roots, server
/// name, authentication, headers, retries. Through a proxy, kube's client as it is. `ping`: a
/// connection that answers no HTTP/2 ping is closed, so the watches and writes on it move to a new
/// one instead of hanging on a dead one. `clock` sees the `Date` of every answer.
pub fn client(config: kube::Config, ping: ApiPing, clock: &ServerClock) -> anyhow::Result<Client> {
    use kube::client::ConfigExt;

    if config.proxy_url.is_some() {
        return Ok(kube::client::ClientBuilder::try_from(config)?
            .with_layer(&MapResponseLayer::new(dates_to(clock)))
            .build());
    }
    // ALPN (h2, http/1.1) is the connector's to set, from the versions enabled below.
    let tls = config.rustls_client_config()?;
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    tcp.set_connect_timeout(config.connect_timeout);
    let https = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    let https = match &config.tls_server_name {
        Some(name) => {
            let name = ServerName::try_from(name.clone())
                .with_context(|| format!("tls-server-name {name:?}"))?;
            https.with_server_name_resolver(FixedServerNameResolver::new(name))
        }
        None => https,
    };
    let https = https.enable_http1().enable_http2().wrap_connector(tcp);
    let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        // The pool would otherwise drop its entry for the shared connection after 90 s without a new
        // request (the watches' streams are not new requests), and the next write would connect again.
        // A closed connection still leaves the pool at once.
        .pool_idle_timeout(None)
        .timer(TokioTimer::new())
        .http2_keep_alive_interval(ping.interval)
        .http2_keep_alive_timeout(ping.timeout)
        .http2_keep_alive_while_idle(true)
        .build(https);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_response(dates_to(clock))
        .map_err(BoxError::from)
        .service(http);
    Ok(Client::new(service, config.default_namespace))
}

/// Hands the headers of each answer to `clock`.
fn dates_to<B>(
    clock: &ServerClock,
) -> impl Fn(http::Response<B>) -> http::Response<B> + Clone + use<B> {
    let clock = clock.clone();
    move |response| {
        clock.saw(response.headers());
        response
    }
}

pub fn settings(config: &Config) -> Settings {
    Settings {
        keys: config.keys.clone(),
        discovery: config.discovery.clone(),
        cluster: config.cluster.clone(),
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
    watch_settings: WatchSettings,
) -> anyhow::Result<Arc<Store>> {
    // The management cluster's API server stamps and ages the removals' records.
    let clock = ServerClock::default();
    let management = client_for(&config.management, config.api_ping, &clock)
        .await
        .context("management cluster")?;
    let workload = match &config.workload {
        Some(path) => Some(
            client_for(
                &KubeconfigSource::File(path.clone()),
                config.api_ping,
                &ServerClock::default(),
            )
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
    let watch_settings = WatchSettings {
        streaming: Streaming {
            management: streams(&management, "management").await,
            workload: match &workload {
                Some(client) => streams(client, "workload").await,
                None => false,
            },
        },
        ..watch_settings
    };
    Ok(Store::start(
        ManagementApi {
            client: management,
            clock,
        },
        workload,
        apis,
        settings(config),
        metrics,
        events,
        watch_settings,
    ))
}

/// How long the read-only commands wait for every watch to list.
const READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The snapshot of watches of our own, read-only (no Events, no writes), once every watch has listed:
/// what `template` shows, and `check` and `explain` when no running provider answers for them.
pub async fn read_only_snapshot(
    connection: &crate::config::ConnectionArgs,
) -> anyhow::Result<Arc<crate::snapshot::Snapshot>> {
    let config = connection.config()?;
    let store = start_store(
        &config,
        Arc::new(Metrics::new()),
        false,
        WatchSettings::default(),
    )
    .await?;
    // A forbidden or missing resource is reported at once: waiting does not fix RBAC.
    if let Err(reasons) = store.wait_ready_or_fatal(READY_TIMEOUT, true).await {
        anyhow::bail!(
            "the objects cluster-autoscaler needs could not be listed{}:\n  {}",
            if store.watch_problems().iter().any(|p| p.fatal) {
                String::new()
            } else {
                format!(" within {READY_TIMEOUT:?}")
            },
            reasons.join("\n  ")
        );
    }
    Ok(store.snapshot())
}

/// Whether this cluster's watches start with a streamed initial list, from its server's version.
async fn streams(client: &Client, cluster: &str) -> bool {
    match client.apiserver_version().await {
        Ok(info) => {
            let streams = streams_initial_lists(&info.major, &info.minor);
            tracing::info!(cluster, version = %info.git_version, streamed_initial_lists = streams, "API server");
            streams
        }
        Err(e) => {
            tracing::warn!(
                cluster,
                "API server version unreadable ({e}): initial lists in pages"
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tls_server_name_that_is_no_name_is_an_error_naming_it() {
        let mut config = kube::Config::new("https://127.0.0.1:6443".parse().unwrap());
        config.tls_server_name = Some("not a name".to_string());
        let error = client(config, ApiPing::default(), &ServerClock::default())
            .err()
            .expect("an invalid server name is refused");
        assert!(
            format!("{error:#}").contains("tls-server-name \"not a name\""),
            "{error:#}"
        );
    }

    #[tokio::test]
    async fn every_api_request_carries_our_user_agent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"http://127.0.0.1:1\"}\n\
             users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n\
             current-context: x\n",
        )
        .unwrap();
        let config = kube_config(&KubeconfigSource::File(path)).await.unwrap();
        let agents: Vec<_> = config
            .headers
            .iter()
            .filter(|(name, _)| name == http::header::USER_AGENT)
            .map(|(_, value)| value.to_str().unwrap().to_string())
            .collect();
        assert_eq!(
            agents,
            [format!("capi-autoscaler-provider/{}", version::VERSION)]
        );
    }

    /// Answers every request on 127.0.0.1 with `{}` dated 2026-01-01T00:00:00Z, as an API server
    /// whose clock reads that would; stops after `answers` connections.
    async fn dated_server(answers: usize) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            for _ in 0..answers {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let mut request = [0u8; 4096];
                let _ = socket.read(&mut request).await;
                let _ = socket
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nDate: Thu, 01 Jan 2026 00:00:00 GMT\r\n\
                          Content-Type: application/json\r\nContent-Length: 2\r\n\
                          Connection: close\r\n\r\n{}",
                    )
                    .await;
            }
        });
        format!("http://{address}")
    }

    #[tokio::test]
    async fn the_servers_clock_is_learned_from_the_date_of_its_answers() {
        let server = dated_server(1).await;
        let config = kube::Config::new(server.parse().unwrap());
        let clock = ServerClock::default();
        let client = client(config, ApiPing::default(), &clock).unwrap();
        let answer = client
            .request_text(http::Request::get("/version").body(Vec::new()).unwrap())
            .await
            .unwrap();
        assert_eq!(answer, "{}");
        assert!(clock.is_set());
        assert_eq!(clock.now(), 1_767_225_600);
    }
}
