//! Who made which apiserver requests: every program under test gets identities of its own, and API
//! Priority and Fairness (APF) FlowSchemas put each identity's requests in a flow schema of its own,
//! so the apiserver's `apiserver_flowcontrol_dispatched_requests_total{flow_schema}` counts them per
//! program. WATCH requests go to a schema of their own: a watch is a stream the client keeps, not a
//! request of a loop (its re-establishment every few minutes is reported apart).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use crate::support::{self, Check, ControlPlane, poll_until};

const PRIORITY_LEVEL: &str = "bench";
const METRIC: &str = "apiserver_flowcontrol_dispatched_requests_total";

/// A subject the apiserver authenticates.
#[derive(Clone, Debug)]
pub enum Subject {
    User(String),
    ServiceAccount { namespace: String, name: String },
}

/// An identity bound to cluster-admin, with its flow schemas.
#[derive(Clone, Debug)]
pub struct Identity {
    /// Short name: the flow schemas are `bench-<name>` and `bench-<name>-watch`.
    pub name: String,
    pub subject: Subject,
    /// For users: a kubeconfig with the client certificate.
    pub kubeconfig: Option<PathBuf>,
    /// For service accounts: a bearer token.
    pub token: Option<String>,
}

impl Identity {
    pub fn kubeconfig(&self) -> PathBuf {
        self.kubeconfig.clone().unwrap_or_default()
    }
}

/// A client-certificate user bound to cluster-admin, its requests counted under `name`.
pub async fn user(cp: &ControlPlane, name: &str) -> Identity {
    let (_, kubeconfig) = cp.restricted_identity("cluster-admin").await;
    let user = kubeconfig
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default()
        .to_string();
    let identity = Identity {
        name: name.to_string(),
        subject: Subject::User(user),
        kubeconfig: Some(kubeconfig),
        token: None,
    };
    flow_schemas(&cp.admin_client().await, &identity).await;
    identity
}

/// A ServiceAccount in `ns` bound to cluster-admin with a token valid for a day, its requests counted
/// under `name`.
pub async fn service_account(cp: &ControlPlane, ns: &str, name: &str) -> Identity {
    let admin = cp.admin_client().await;
    let sa_name = format!("bench-{name}");
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": sa_name}})).unwrap_or_default();
    match accounts.create(&PostParams::default(), &account).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create ServiceAccount {ns}/{sa_name}: {e}"),
    }
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": format!("{ns}-{sa_name}")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": ns}],
    }))
    .unwrap_or_default();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .patch(
            &format!("{ns}-{sa_name}"),
            &PatchParams::apply("bench").force(),
            &Patch::Apply(&binding),
        )
        .await
        .unwrap_or_else(|e| panic!("bind {ns}/{sa_name} to cluster-admin: {e}"));
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(Vec::new()),
            expiration_seconds: Some(86_400),
            ..Default::default()
        }),
        ..Default::default()
    };
    let token = accounts
        .create_token_request(&sa_name, &PostParams::default(), &request)
        .await
        .unwrap_or_else(|e| panic!("TokenRequest for {ns}/{sa_name}: {e}"))
        .status
        .and_then(|s| s.token)
        .unwrap_or_default();
    let kubeconfig = support::procs::work_dir().join(format!("sa-{name}.kubeconfig"));
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: bench\n  cluster:\n    server: {}\n    \
         certificate-authority: {}\nusers:\n- name: {sa_name}\n  user:\n    token: {token}\n\
         contexts:\n- name: bench\n  context:\n    cluster: bench\n    user: {sa_name}\n\
         current-context: bench\n",
        cp.server,
        cp.dir.join("ca.crt").display(),
    );
    std::fs::write(&kubeconfig, text)
        .unwrap_or_else(|e| panic!("write {}: {e}", kubeconfig.display()));
    let identity = Identity {
        name: name.to_string(),
        subject: Subject::ServiceAccount {
            namespace: ns.to_string(),
            name: sa_name,
        },
        kubeconfig: Some(kubeconfig),
        token: Some(token),
    };
    flow_schemas(&admin, &identity).await;
    identity
}

/// The priority level every bench identity is served at: limited (APF counts its dispatches) but with
/// far more shares than the built-in levels, so it never queues here.
async fn priority_level(admin: &Client) {
    let level: PriorityLevelConfiguration = serde_json::from_value(json!({
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "PriorityLevelConfiguration",
        "metadata": {"name": PRIORITY_LEVEL},
        "spec": {"type": "Limited", "limited": {
            "nominalConcurrencyShares": 1000,
            "lendablePercent": 0,
            "limitResponse": {"type": "Queue", "queuing": {"queues": 64, "handSize": 6, "queueLengthLimit": 1000}},
        }},
    }))
    .unwrap_or_default();
    Api::<PriorityLevelConfiguration>::all(admin.clone())
        .patch(
            PRIORITY_LEVEL,
            &PatchParams::apply("bench").force(),
            &Patch::Apply(&level),
        )
        .await
        .unwrap_or_else(|e| panic!("apply PriorityLevelConfiguration {PRIORITY_LEVEL}: {e}"));
}

async fn flow_schemas(admin: &Client, identity: &Identity) {
    priority_level(admin).await;
    let subject = match &identity.subject {
        Subject::User(name) => json!({"kind": "User", "user": {"name": name}}),
        Subject::ServiceAccount { namespace, name } => {
            json!({"kind": "ServiceAccount", "serviceAccount": {"namespace": namespace, "name": name}})
        }
    };
    let all_resources = |verbs: &[&str]| json!([{"verbs": verbs, "apiGroups": ["*"], "resources": ["*"], "clusterScope": true, "namespaces": ["*"]}]);
    let schemas = [
        (
            format!("bench-{}-watch", identity.name),
            50,
            json!([{"subjects": [subject], "resourceRules": all_resources(&["watch"])}]),
        ),
        (
            format!("bench-{}", identity.name),
            51,
            json!([{
                "subjects": [subject],
                "resourceRules": all_resources(&["*"]),
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            }]),
        ),
    ];
    for (name, precedence, rules) in schemas {
        let schema: FlowSchema = serde_json::from_value(json!({
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": name},
            "spec": {
                "priorityLevelConfiguration": {"name": PRIORITY_LEVEL},
                "matchingPrecedence": precedence,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": rules,
            },
        }))
        .unwrap_or_default();
        Api::<FlowSchema>::all(admin.clone())
            .patch(
                &name,
                &PatchParams::apply("bench").force(),
                &Patch::Apply(&schema),
            )
            .await
            .unwrap_or_else(|e| panic!("apply FlowSchema {name}: {e}"));
    }
}

/// Waits until the apiserver counts a request of `identity` under its schema.
pub async fn wait_counted(admin: &Client, identity: &Identity) {
    let client = support::client_from_kubeconfig(&identity.kubeconfig()).await;
    let schema = format!("bench-{}", identity.name);
    poll_until(
        &format!(
            "APF counts the requests of {} under {schema}",
            identity.name
        ),
        Duration::from_secs(60),
        Duration::from_millis(500),
        || {
            let admin = admin.clone();
            let client = client.clone();
            let schema = schema.clone();
            async move {
                let _ = client.apiserver_version().await;
                let counts = counts(&admin).await;
                if counts.get(&schema).copied().unwrap_or(0.0) > 0.0 {
                    Check::Done(())
                } else {
                    Check::Wait(format!("{schema} not counted yet"))
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Dispatched requests by flow schema (bench schemas only), from the apiserver's metrics.
pub async fn counts(admin: &Client) -> BTreeMap<String, f64> {
    let Ok(request) = http::Request::get("/metrics").body(Vec::new()) else {
        return BTreeMap::new();
    };
    let Ok(text) = admin.request_text(request).await else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(METRIC) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once(' ') else {
            continue;
        };
        let Some(schema) = support::capi::label_of(labels.trim_start_matches('{'), "flow_schema")
        else {
            continue;
        };
        if !schema.starts_with("bench-") {
            continue;
        }
        if let Ok(v) = value.trim().parse::<f64>() {
            *out.entry(schema.to_string()).or_insert(0.0) += v;
        }
    }
    out
}

/// Requests (not watches) of `identities` between two [`counts`].
pub fn requests(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    identities: &[&Identity],
) -> f64 {
    identities
        .iter()
        .map(|i| {
            let schema = format!("bench-{}", i.name);
            after.get(&schema).copied().unwrap_or(0.0) - before.get(&schema).copied().unwrap_or(0.0)
        })
        .sum()
}

/// Watches `identities` opened between two [`counts`].
pub fn watches(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    identities: &[&Identity],
) -> f64 {
    identities
        .iter()
        .map(|i| {
            let schema = format!("bench-{}-watch", i.name);
            after.get(&schema).copied().unwrap_or(0.0) - before.get(&schema).copied().unwrap_or(0.0)
        })
        .sum()
}

/// Writes the token and the apiserver's CA where client-go's in-cluster configuration looks, in a
/// directory of the work dir (copied into a private mount namespace by the W launcher).
pub fn write_in_cluster_files(cp: &ControlPlane, identity: &Identity) -> PathBuf {
    let dir = support::procs::work_dir().join(format!("sa-{}", identity.name));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    std::fs::write(
        dir.join("token"),
        identity.token.clone().unwrap_or_default(),
    )
    .unwrap_or_else(|e| panic!("write the token: {e}"));
    std::fs::copy(cp.dir.join("ca.crt"), dir.join("ca.crt"))
        .unwrap_or_else(|e| panic!("copy ca.crt: {e}"));
    std::fs::write(dir.join("namespace"), "default").unwrap_or_else(|e| panic!("write: {e}"));
    dir
}
