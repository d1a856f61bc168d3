//! Flags and environment → one `Config` value. Flag names follow the in-tree provider and CA where they exist.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::capi::names::is_dns1123_subdomain;
use crate::capi::{DEFAULT_GROUP, Keys};
use crate::discovery::DiscoverySpec;

#[derive(Debug, Parser)]
#[command(
    name = "capi-autoscaler-provider",
    version,
    about = "cluster-autoscaler externalgrpc cloud provider for Cluster API",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `serve` is the default command.
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the externalgrpc CloudProvider service (the default).
    Serve(ServeArgs),
    /// Show what cluster-autoscaler will see: groups, bounds, templates, options, prices, problems.
    Check(CheckArgs),
    /// Print the scale-from-zero template Node of one node group as YAML.
    Template(TemplateArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// Kubeconfig of the management cluster (where the Cluster API objects are).
    #[arg(long = "cloud-config", value_name = "PATH")]
    pub cloud_config: Option<PathBuf>,
    /// Kubeconfig of the workload cluster (its Nodes label scale-from-zero templates).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Without --cloud-config, use the in-cluster config for the management cluster instead of --kubeconfig.
    #[arg(long = "clusterapi-cloud-config-authoritative")]
    pub cloud_config_authoritative: bool,
    /// Which scalable resources are node groups: `clusterapi:namespace=NS,clusterName=NAME,LABEL=VALUE`.
    /// Repeatable; a resource is a node group when it matches any spec. None: every annotated resource.
    #[arg(long = "node-group-auto-discovery", value_name = "SPEC")]
    pub node_group_auto_discovery: Vec<String>,
    /// API group of the Cluster API objects; also the prefix of the group-dependent annotation keys.
    #[arg(long = "capi-group", env = "CAPI_GROUP", default_value = DEFAULT_GROUP, hide_env_values = true)]
    pub capi_group: String,
    /// API version of the Cluster API objects; discovered (the served preferred version) when empty.
    #[arg(long = "capi-version", env = "CAPI_VERSION")]
    pub capi_version: Option<String>,
    /// Architecture of scale-from-zero templates whose infrastructure template has no status.nodeInfo.
    #[arg(long = "scale-zero-default-arch", env = "CAPI_SCALE_ZERO_DEFAULT_ARCH")]
    pub scale_zero_default_arch: Option<String>,
    /// Reference price of one CPU core per hour for PricingPodPrice; derived from the priced groups when unset.
    #[arg(long = "pod-price-per-cpu-hour", value_name = "PRICE")]
    pub cpu_hour_price: Option<f64>,
    /// Reference price of one GiB of memory per hour for PricingPodPrice; derived when unset.
    #[arg(long = "pod-price-per-gib-hour", value_name = "PRICE")]
    pub gib_hour_price: Option<f64>,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// gRPC listen address. The default is loopback: the provider runs as a sidecar of cluster-autoscaler.
    #[arg(long, default_value = "127.0.0.1:8086")]
    pub address: SocketAddr,
    /// HTTP address for /metrics, /healthz and /readyz; disabled when empty.
    #[arg(long = "metrics-address", default_value = "127.0.0.1:8087")]
    pub metrics_address: Option<String>,
    /// PEM certificate of the gRPC server; with --tls-key the listener speaks TLS.
    #[arg(long = "tls-cert", value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of the gRPC server.
    #[arg(long = "tls-key", value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle; when given, clients must present a certificate it signed (mTLS).
    #[arg(long = "tls-client-ca", value_name = "PATH", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: OutputFormat,
}

#[derive(Debug, Clone, Args)]
pub struct TemplateArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// Node group id, e.g. `MachineDeployment/default/md-0`.
    pub id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

/// Where a kubeconfig comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeconfigSource {
    File(PathBuf),
    /// The pod's service account, or whatever `kube::Config::infer` finds.
    Inferred,
}

/// Everything the provider needs to know, validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub management: KubeconfigSource,
    pub workload: Option<PathBuf>,
    pub discovery: Vec<DiscoverySpec>,
    pub keys: Keys,
    pub capi_version: Option<String>,
    pub default_arch: Option<String>,
    pub cpu_hour_price: Option<f64>,
    pub gib_hour_price: Option<f64>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("--node-group-auto-discovery {spec:?}: {reason}")]
    Discovery { spec: String, reason: String },
    #[error("CAPI_GROUP {0:?} is not a DNS subdomain")]
    Group(String),
    #[error("{flag} {value}: must be a finite, non-negative number")]
    Price { flag: &'static str, value: f64 },
}

impl ConnectionArgs {
    pub fn config(&self) -> Result<Config, ConfigError> {
        let discovery = self
            .node_group_auto_discovery
            .iter()
            .map(|spec| {
                spec.parse::<DiscoverySpec>()
                    .map_err(|e| ConfigError::Discovery {
                        spec: spec.clone(),
                        reason: e.reason,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let group = if self.capi_group.is_empty() {
            DEFAULT_GROUP.to_string()
        } else {
            self.capi_group.clone()
        };
        if !is_dns1123_subdomain(&group) {
            return Err(ConfigError::Group(group));
        }
        for (flag, value) in [
            ("--pod-price-per-cpu-hour", self.cpu_hour_price),
            ("--pod-price-per-gib-hour", self.gib_hour_price),
        ] {
            if let Some(value) = value
                && !(value.is_finite() && value >= 0.0)
            {
                return Err(ConfigError::Price { flag, value });
            }
        }
        // As upstream: the management cluster is --cloud-config; without it, --kubeconfig unless the
        // cloud config is authoritative, in which case the in-cluster config.
        let management = match (&self.cloud_config, &self.kubeconfig) {
            (Some(path), _) => KubeconfigSource::File(path.clone()),
            (None, Some(path)) if !self.cloud_config_authoritative => {
                KubeconfigSource::File(path.clone())
            }
            _ => KubeconfigSource::Inferred,
        };
        Ok(Config {
            management,
            workload: self.kubeconfig.clone(),
            discovery,
            keys: Keys::new(&group),
            capi_version: self.capi_version.clone().filter(|v| !v.is_empty()),
            default_arch: self
                .scale_zero_default_arch
                .clone()
                .filter(|v| !v.is_empty()),
            cpu_hour_price: self.cpu_hour_price,
            gib_hour_price: self.gib_hour_price,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("capi-autoscaler-provider").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    fn serve_config(args: &[&str]) -> Result<Config, ConfigError> {
        let cli = parse(args);
        match cli.command {
            Some(Command::Serve(s)) => s.connection.config(),
            None => cli.serve.connection.config(),
            other => panic!("not serve: {other:?}"),
        }
    }

    #[test]
    fn serve_is_the_default_command() {
        let cli = parse(&["--address", "127.0.0.1:9000"]);
        assert!(cli.command.is_none());
        assert_eq!(cli.serve.address.to_string(), "127.0.0.1:9000");
    }

    #[test]
    fn management_cluster_resolution_follows_upstream() {
        let c = serve_config(&["serve", "--cloud-config", "/m", "--kubeconfig", "/w"]).unwrap();
        assert_eq!(c.management, KubeconfigSource::File("/m".into()));
        assert_eq!(c.workload, Some("/w".into()));
        let c = serve_config(&["serve", "--kubeconfig", "/w"]).unwrap();
        assert_eq!(c.management, KubeconfigSource::File("/w".into()));
        let c = serve_config(&[
            "serve",
            "--kubeconfig",
            "/w",
            "--clusterapi-cloud-config-authoritative",
        ])
        .unwrap();
        assert_eq!(c.management, KubeconfigSource::Inferred);
    }

    #[test]
    fn a_malformed_discovery_spec_is_a_startup_error_that_quotes_it() {
        let err = serve_config(&["serve", "--node-group-auto-discovery", "asg:tag=x"]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("\"asg:tag=x\""), "{text}");
    }

    #[test]
    fn capi_group_changes_the_keys() {
        let c = serve_config(&["serve", "--capi-group", "test.k8s.io"]).unwrap();
        assert_eq!(
            c.keys.min_size,
            "test.k8s.io/cluster-api-autoscaler-node-group-min-size"
        );
        assert_eq!(c.keys.delete_machine, "test.k8s.io/delete-machine");
        assert!(serve_config(&["serve", "--capi-group", "Not_A_Group"]).is_err());
    }

    #[test]
    fn tls_key_requires_a_certificate() {
        let r = Cli::try_parse_from(["x", "serve", "--tls-key", "/k"]);
        assert!(r.is_err());
    }

    #[test]
    fn negative_reference_prices_are_rejected() {
        let err = serve_config(&["serve", "--pod-price-per-cpu-hour=-1"]).unwrap_err();
        assert!(err.to_string().contains("--pod-price-per-cpu-hour"));
    }
}
