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
fn api_pings_default_to_client_go_and_take_durations() {
    let c = serve_config(&["serve"]).unwrap();
    assert_eq!(c.api_ping, ApiPing::default());
    let c = serve_config(&[
        "serve",
        "--api-ping-interval",
        "1s",
        "--api-ping-timeout",
        "500ms",
    ])
    .unwrap();
    assert_eq!(
        c.api_ping,
        ApiPing {
            interval: std::time::Duration::from_secs(1),
            timeout: std::time::Duration::from_millis(500),
        }
    );
    let refused = Cli::try_parse_from(["capi-autoscaler-provider", "--api-ping-timeout", "0s"])
        .unwrap_err()
        .to_string();
    assert!(refused.contains("--api-ping-timeout"), "{refused}");
}

#[test]
fn a_malformed_discovery_spec_is_a_startup_error_that_quotes_it() {
    let err = serve_config(&["serve", "--node-group-auto-discovery", "asg:tag=x"]).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("\"asg:tag=x\""), "{text}");
}

#[test]
fn cluster_takes_a_name_or_namespace_and_name() {
    let c = serve_config(&["serve", "--cluster", "prod"]).unwrap();
    assert_eq!(
        c.cluster,
        Some(ClusterRef {
            namespace: None,
            name: "prod".into()
        })
    );
    let c = serve_config(&["serve", "--cluster", "fleet/prod"]).unwrap();
    assert_eq!(
        c.cluster.map(|c| c.to_string()).as_deref(),
        Some("fleet/prod")
    );
    assert_eq!(serve_config(&["serve"]).unwrap().cluster, None);
    assert_eq!(
        serve_config(&["serve", "--cluster", ""]).unwrap().cluster,
        None
    );
    for bad in ["Prod", "a/b/c", "/prod", "fleet/", "under_score"] {
        let err = serve_config(&["serve", "--cluster", bad])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("--cluster"), "{bad:?}: {err}");
    }
}

/// The shipped manifests carry a placeholder: left as is, the provider refuses to start and says
/// what to set.
#[test]
fn the_placeholder_cluster_is_a_startup_error_that_says_what_to_set() {
    let err = serve_config(&["serve", "--cluster", crate::scope::PLACEHOLDER])
        .unwrap_err()
        .to_string();
    assert!(err.contains("CAPI_AUTOSCALER_PROVIDER_CLUSTER"), "{err}");
    assert!(err.contains("placeholder"), "{err}");
    assert!(err.contains("NAMESPACE/NAME"), "{err}");
    let err = serve_config(&["serve", "--cluster", "default/REPLACE-WITH-CLUSTER-NAME"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("placeholder"), "{err}");
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

fn serve_args(args: &[&str]) -> ServeArgs {
    let cli = Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    match cli.command {
        Some(Command::Serve(serve)) => serve,
        _ => cli.serve,
    }
}

#[test]
fn scale_rpcs_off_loopback_need_client_certificates_or_an_explicit_flag() {
    let tls = ["--tls-cert", "/c", "--tls-key", "/k"];
    for ok in [
        vec!["serve"],
        vec!["serve", "--address", "127.0.0.1:8086"],
        vec!["serve", "--address", "[::1]:8086"],
        [
            &[
                "serve",
                "--address",
                "0.0.0.0:8086",
                "--tls-client-ca",
                "/ca",
            ][..],
            &tls,
        ]
        .concat(),
        vec![
            "serve",
            "--address",
            "0.0.0.0:8086",
            "--allow-unauthenticated-writes",
        ],
        vec![
            "serve",
            "--address",
            "10.1.2.3:8086",
            "--allow-unauthenticated-writes",
        ],
    ] {
        assert_eq!(serve_args(&ok).check_write_exposure(), Ok(()), "{ok:?}");
    }
    let plain = serve_args(&["serve", "--address", "0.0.0.0:8086"]).check_write_exposure();
    let e = plain.expect_err("plaintext on every address");
    assert!(e.contains("0.0.0.0:8086") && e.contains("plaintext"), "{e}");
    assert!(
        e.contains("--tls-client-ca") && e.contains("--allow-unauthenticated-writes"),
        "{e}"
    );
    let server_tls_only = [&["serve", "--address", "[::]:8086"][..], &tls].concat();
    let e = serve_args(&server_tls_only)
        .check_write_exposure()
        .expect_err("TLS alone authenticates nobody");
    assert!(e.contains("TLS without client certificates"), "{e}");
}

/// Every flag of every command, with its env name.
fn flags_and_envs() -> Vec<(String, String, Option<String>)> {
    use clap::CommandFactory;
    let root = Cli::command();
    let mut out = Vec::new();
    for cmd in std::iter::once(&root).chain(root.get_subcommands()) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if arg.is_positional() || id == "help" || id == "version" {
                continue;
            }
            let flag = format!("--{}", arg.get_long().unwrap_or(id));
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            out.push((cmd.get_name().to_string(), flag, env));
        }
    }
    out
}

#[test]
fn every_flag_can_be_set_from_the_environment() {
    // So that `kubectl exec … check` in the pod sees the configuration `serve` was given by env.
    let flags = flags_and_envs();
    assert!(flags.len() > 20, "{flags:?}");
    let upstream = ["CAPI_GROUP", "CAPI_VERSION", "CAPI_SCALE_ZERO_DEFAULT_ARCH"];
    for (cmd, flag, env) in &flags {
        let env = env
            .as_deref()
            .unwrap_or_else(|| panic!("{cmd} {flag} has no env"));
        assert!(
            upstream.contains(&env) || env.starts_with("CAPI_AUTOSCALER_PROVIDER_"),
            "{cmd} {flag}: {env}"
        );
    }
    // One flag, one env name, whichever command it is given to.
    let mut by_flag = std::collections::BTreeMap::new();
    for (_, flag, env) in &flags {
        let previous = by_flag.insert(flag.clone(), env.clone());
        assert!(
            previous.is_none() || previous == Some(env.clone()),
            "{flag}"
        );
    }
}

#[test]
fn the_readme_documents_every_env_name() {
    let readme = include_str!("../../README.md");
    for (cmd, flag, env) in flags_and_envs() {
        let env = env.unwrap_or_default();
        assert!(
            readme.contains(&format!("`{env}`")),
            "{cmd} {flag}: README.md does not name `{env}`"
        );
    }
}

#[test]
fn limits_have_safe_defaults_and_refuse_nonsense() {
    let cli = parse(&["serve"]);
    let Some(Command::Serve(s)) = cli.command else {
        panic!("not serve")
    };
    assert_eq!(s.max_message_size, 16 << 20);
    assert_eq!(s.max_concurrent_requests, 64);
    // Below CA's default gRPC timeout of 5 s.
    assert!(s.request_timeout < std::time::Duration::from_secs(5));
    assert_eq!(s.watch_stale_after, std::time::Duration::from_secs(60));
    assert_eq!(s.watch_timeout, std::time::Duration::from_secs(60));
    assert_eq!(parse_size("4194304"), Ok(4 << 20));
    assert_eq!(parse_size("2Gi"), Ok(2 << 30));
    for bad in ["", "0", "0Mi", "16MB", "-1", "Mi", "99999999999999999999Gi"] {
        assert!(parse_size(bad).is_err(), "{bad:?}");
    }
    for bad in [
        &["serve", "--max-concurrent-requests", "0"][..],
        &["serve", "--request-timeout", "0s"],
        &["serve", "--watch-timeout", "300s"],
        &["serve", "--watch-timeout", "500ms"],
        &["serve", "--watch-stale-after", "0s"],
    ] {
        assert!(
            Cli::try_parse_from(std::iter::once("x").chain(bad.iter().copied())).is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn negative_reference_prices_are_rejected() {
    let err = serve_config(&["serve", "--pod-price-per-cpu-hour=-1"]).unwrap_err();
    assert!(err.to_string().contains("--pod-price-per-cpu-hour"));
}
