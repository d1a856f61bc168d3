//! From configuration to running watches: the Kubernetes clients (with our User-Agent), Cluster API
//! discovery, the snapshot settings and the store. Shared by `serve` and `check`.

use std::sync::Arc;

use anyhow::Context;
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::apis::CapiApis;
use crate::config::{Config, KubeconfigSource};
use crate::metrics::Metrics;
use crate::snapshot::Settings;
use crate::store::{Store, Streaming, WatchSettings, streams_initial_lists};
use crate::version;

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

/// A client for a kubeconfig file, or the inferred (in-cluster) configuration.
pub async fn client_for(source: &KubeconfigSource) -> anyhow::Result<Client> {
    let config = kube_config(source).await?;
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
    watch_settings: WatchSettings,
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
        management,
        workload,
        apis,
        settings(config),
        metrics,
        events,
        watch_settings,
    ))
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
}
