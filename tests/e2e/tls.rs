//! The gRPC listener with TLS and with mutual TLS, as cluster-autoscaler's cloud-config `cert`/`key`/
//! `cacert` uses it: real certificates, a real handshake, clients from the wrong CA refused.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use capi_autoscaler_provider::proto::NodeGroupsRequest;
use capi_autoscaler_provider::proto::cloud_provider_client::CloudProviderClient;
use support::pki::{Ca, CertPem, write_private};
use support::procs::{self, Check};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

struct Provider {
    child: Child,
    address: String,
    log: PathBuf,
}

impl Drop for Provider {
    fn drop(&mut self) {
        procs::kill_and_reap(&mut self.child);
    }
}

struct Pki {
    dir: PathBuf,
    ca: Ca,
    server: CertPem,
}

impl Pki {
    fn new() -> Pki {
        let dir = procs::scratch_dir();
        let ca = Ca::generate();
        let server = ca.serving_cert("capi-autoscaler-provider");
        Pki { dir, ca, server }
    }

    fn file(&self, name: &str, contents: &str) -> String {
        write_private(&self.dir, name, contents)
            .display()
            .to_string()
    }
}

fn start(pki: &Pki, kubeconfig: &Path, namespace: &str, client_ca: bool) -> Provider {
    let address = format!("127.0.0.1:{}", procs::free_port());
    let mut args = vec![
        "serve".to_string(),
        "--address".into(),
        address.clone(),
        "--metrics-address".into(),
        String::new(),
        "--cloud-config".into(),
        kubeconfig.display().to_string(),
        "--node-group-auto-discovery".into(),
        format!("clusterapi:namespace={namespace}"),
        "--tls-cert".into(),
        pki.file("server.crt", &pki.server.cert),
        "--tls-key".into(),
        pki.file("server.key", &pki.server.key),
    ];
    if client_ca {
        args.push("--tls-client-ca".into());
        args.push(pki.file("ca.crt", &pki.ca.cert_pem));
    }
    let log = pki
        .dir
        .join(format!("provider-{}.log", address.replace([':', '.'], "-")));
    let child = procs::spawn_logged(Path::new(support::provider::PROVIDER_BIN), &args, &log)
        .unwrap_or_else(|e| panic!("start the provider: {e}"));
    Provider {
        child,
        address,
        log,
    }
}

fn tls(pki: &Pki, identity: Option<&CertPem>) -> ClientTlsConfig {
    let mut config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca.cert_pem))
        .domain_name("localhost");
    if let Some(id) = identity {
        config = config.identity(Identity::from_pem(&id.cert, &id.key));
    }
    config
}

async fn connect(
    address: &str,
    tls: Option<ClientTlsConfig>,
) -> Result<Channel, tonic::transport::Error> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls)?;
    }
    endpoint.connect().await
}

/// Waits until the provider answers SERVING to a client that is allowed in.
async fn wait_serving(provider: &mut Provider, tls: ClientTlsConfig) {
    let address = provider.address.clone();
    let result = procs::poll_until(
        "provider serving over TLS",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let tls = tls.clone();
            let address = address.clone();
            let exited = provider.child.try_wait().ok().flatten();
            async move {
                if let Some(status) = exited {
                    return Check::Fatal(format!("provider exited: {status}"));
                }
                let Ok(channel) = connect(&address, Some(tls)).await else {
                    return Check::Wait("not accepting yet".to_string());
                };
                match HealthClient::new(channel)
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                {
                    Ok(r) if r.get_ref().status == ServingStatus::Serving as i32 => Check::Done(()),
                    Ok(r) => Check::Wait(format!("status {}", r.get_ref().status)),
                    Err(e) => Check::Wait(e.to_string()),
                }
            }
        },
    )
    .await;
    if let Err(e) = result {
        panic!(
            "{e}\n--- provider log ---\n{}",
            procs::log_tail(&provider.log, 4000)
        );
    }
}

async fn node_groups(channel: Channel) -> Result<usize, tonic::Status> {
    CloudProviderClient::new(channel)
        .node_groups(NodeGroupsRequest {})
        .await
        .map(|r| r.get_ref().node_groups.len())
}

#[tokio::test]
async fn server_tls_serves_tls_clients_and_refuses_plaintext() {
    let cp = support::control_plane(support::Setup::shipped());
    let ns = cp.fresh_namespace().await;
    let pki = Pki::new();
    let mut provider = start(&pki, cp.admin_kubeconfig(), &ns, false);
    wait_serving(&mut provider, tls(&pki, None)).await;

    let channel = connect(&provider.address, Some(tls(&pki, None)))
        .await
        .expect("TLS connect");
    assert_eq!(node_groups(channel).await.expect("NodeGroups over TLS"), 0);

    // A plaintext HTTP/2 client does not get an answer from a TLS listener.
    let plaintext = match connect(&provider.address, None).await {
        Ok(channel) => node_groups(channel).await.is_ok(),
        Err(_) => false,
    };
    assert!(
        !plaintext,
        "a plaintext client was served by the TLS listener"
    );
}

#[tokio::test]
async fn mutual_tls_accepts_only_clients_with_a_certificate_from_the_client_ca() {
    let cp = support::control_plane(support::Setup::shipped());
    let ns = cp.fresh_namespace().await;
    let pki = Pki::new();
    let trusted = pki.ca.client_cert("cluster-autoscaler", None);
    let mut provider = start(&pki, cp.admin_kubeconfig(), &ns, true);
    wait_serving(&mut provider, tls(&pki, Some(&trusted))).await;

    let channel = connect(&provider.address, Some(tls(&pki, Some(&trusted))))
        .await
        .expect("mTLS connect with a trusted client certificate");
    assert_eq!(node_groups(channel).await.expect("NodeGroups over mTLS"), 0);

    // A client certificate from another CA is refused during the handshake.
    let foreign = Ca::generate().client_cert("cluster-autoscaler", None);
    let refused = match connect(&provider.address, Some(tls(&pki, Some(&foreign)))).await {
        Ok(channel) => node_groups(channel).await.is_err(),
        Err(_) => true,
    };
    assert!(refused, "a client certificate from another CA was accepted");

    // So is a client with no certificate at all.
    let refused = match connect(&provider.address, Some(tls(&pki, None))).await {
        Ok(channel) => node_groups(channel).await.is_err(),
        Err(_) => true,
    };
    assert!(refused, "a client without a certificate was accepted");
}
