//! The write path under faults, with the real Cluster API v1.14.2 manager doing what Cluster API
//! does (MachineSets, Machines, delete order, drain, Node deletion) and the stand-in playing only the
//! cloud and the kubelets: invariants 2 (replicas never written outside [min, max] of the version
//! written over) and 3 (no delete mark without its replica decrement for longer than the grace
//! period and a repair interval, no decrement without its mark, no double decrement, no Machine
//! deleted without its mark) while cluster-autoscaler-like clients give up on deadlines, the
//! provider is SIGKILLed between its two writes, the kube-apiserver is SIGKILLed and SIGSTOPped
//! (the manager lives through both), every write conflicts, bounds change under a write, and
//! MachinePool removals are retried across a restart in another spelling.
//!
//! Every test has a namespace of its own on the binary's one control plane and manager
//! (`RealCapiScenario`); Machine deletions are recorded from a watch (`MachineDeletions`). The
//! faults stall, kill and stop processes this binary shares (and each test times things), so the
//! tests run one at a time ([`SERIAL`]). Each prints its wall time. The SIGKILL of the manager itself
//! during a scale-down is tests/real_capi_faults.rs (a dead manager takes CAPI's webhooks with it).

pub mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::{
    ExternalGrpcNode, NodeGroupDeleteNodesRequest, NodeGroupIncreaseSizeRequest,
};
use kube::ResourceExt as _;
use kube::api::{Patch, PatchParams};
use rand::{Rng as _, SeedableRng as _};
use serde_json::json;
use support::capi::{
    Capi, Kind, Rpc, expect_code, grpc_node, kubeconfig_with_server, label_of, request_counts,
    socket_addr_of,
};
use support::faults::{
    ApiServer, CLAIMS_ANNOTATION, GroupView, History, LEDGER_ANNOTATION, StallProxy,
    provider_metric,
};
use support::procs::{self, announce};
use support::real_capi_scenario::RealCapiScenario;
use support::{Check, ProviderProcess, poll_until, start_provider};
use tonic::{Code, Status};

/// One fault test at a time: they stall, kill and stop processes of this binary's control plane.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The provider's per-call bound on API requests (`CALL_TIMEOUT` in src/scale/api.rs): stalls longer
/// than this make the provider give up on a request the network may still deliver.
const PROVIDER_CALL_TIMEOUT: Duration = Duration::from_secs(4);
/// Attempts at a replica write before the provider answers ABORTED (`MAX_ATTEMPTS`).
const PROVIDER_MAX_ATTEMPTS: f64 = 8.0;
/// The stand-in machine template of every MachineDeployment here.
const TEMPLATE: &str = "small";
/// How long the real manager may take to converge a group (create or delete its Machines).
const CONVERGE: Duration = Duration::from_secs(90);

/// A scenario on the binary's real Cluster API manager with the stand-in template [`TEMPLATE`].
async fn scenario(name: &str) -> RealCapiScenario {
    let s = RealCapiScenario::new(name).await;
    s.template(TEMPLATE, "2", "4Gi", true).await;
    s
}

/// Creates MachineDeployment `name` with bounds and replicas; waits until CAPI made its Machines
/// and the stand-in their Ready Nodes; returns the Machine names (in name order).
async fn group(s: &RealCapiScenario, name: &str, min: i64, max: i64, replicas: i64) -> Vec<String> {
    s.create_md(&s.md(name, TEMPLATE, min, max, replicas)).await;
    s.wait_machines_with_nodes(name, usize::try_from(replicas).unwrap_or(0))
        .await
}

/// The node CA sends for Machine `machine`: its providerID and the Node of its node ref.
async fn node_of(s: &RealCapiScenario, machine: &str) -> ExternalGrpcNode {
    let m = s
        .capi
        .api(Kind::Machine)
        .get(machine)
        .await
        .unwrap_or_else(|e| s.fail(&format!("get Machine {machine}: {e}")));
    let provider_id = m.data["spec"]["providerID"].as_str().unwrap_or_default();
    let node = m.data["status"]["nodeRef"]["name"]
        .as_str()
        .unwrap_or_default();
    if provider_id.is_empty() || node.is_empty() {
        s.fail(&format!(
            "Machine {machine} has no providerID or node ref yet"
        ));
    }
    grpc_node(provider_id, node)
}

/// The Machines of MachineDeployment `md` CAPI began to delete: (with the mark, without it). CAPI
/// names a MachineDeployment's Machines `<md>-<set hash>-<suffix>`.
fn deletions_of(s: &RealCapiScenario, md: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let prefix = format!("{md}-");
    let (mut marked, mut unmarked) = (BTreeSet::new(), BTreeSet::new());
    for d in s.deletions.all() {
        if d.machine.starts_with(&prefix) {
            if d.marked {
                marked.insert(d.machine);
            } else {
                unmarked.insert(d.machine);
            }
        }
    }
    (marked, unmarked)
}

/// The Machines of `md` whose removal a mark of ours asked for: those carrying it now (being
/// deleted or not) and those CAPI deleted with a mark. With the real controllers a paid mark's
/// Machine goes soon after the decrement, so invariant 3 counts these, not the marks left standing.
fn asked(s: &RealCapiScenario, md: &str, v: &GroupView) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = v
        .machines
        .iter()
        .filter(|m| m.ours())
        .map(|m| m.name.clone())
        .collect();
    names.extend(deletions_of(s, md).0);
    names
}

/// Fails unless CAPI deleted no Machine of the namespace that did not carry the mark.
fn check_no_unmarked_deletion(s: &RealCapiScenario) {
    let unmarked = s.deletions.unmarked();
    s.check(
        unmarked.is_empty(),
        &format!(
            "invariant 3: CAPI deleted Machines without a mark (replicas lowered without one): {unmarked:?}"
        ),
    );
}

/// Waits until the namespace's Cluster API objects have stopped changing for 2 s: CAPI has written
/// the statuses of what it made. The proxy's holds count the answers the provider gets, and watch
/// events that share its connection would count as answers.
async fn wait_quiet(s: &RealCapiScenario) {
    const QUIET: Duration = Duration::from_secs(2);
    let deadline = Instant::now() + CONVERGE;
    let mut last: Option<Vec<String>> = None;
    let mut since = Instant::now();
    loop {
        let mut versions = Vec::new();
        for kind in [
            Kind::MachineDeployment,
            Kind::MachineSet,
            Kind::Machine,
            Kind::MachinePool,
        ] {
            match s.capi.api(kind).list(&Default::default()).await {
                Ok(l) => versions.extend(
                    l.items
                        .into_iter()
                        .map(|o| o.metadata.resource_version.unwrap_or_default()),
                ),
                Err(e) => versions.push(e.to_string()),
            }
        }
        if last.as_ref() == Some(&versions) {
            if since.elapsed() >= QUIET {
                return;
            }
        } else {
            last = Some(versions);
            since = Instant::now();
        }
        if Instant::now() > deadline {
            s.fail("the namespace's Cluster API objects never stayed unchanged for 2 s");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn discovery(s: &RealCapiScenario) -> String {
    format!("clusterapi:namespace={}", s.ns)
}

/// A provider for the scenario's namespace talking to the API through `kubeconfig`, with `extra`
/// flags (not the scenario's own: a test kills and restarts these).
async fn provider(
    s: &RealCapiScenario,
    kubeconfig: &Path,
    extra: &[&str],
) -> (ProviderProcess, Rpc) {
    let discovery = discovery(s);
    let mut args = vec!["--node-group-auto-discovery", discovery.as_str()];
    args.extend_from_slice(extra);
    let provider = start_provider(&args, kubeconfig).await;
    let rpc = Rpc::connect(&provider).await;
    (provider, rpc)
}

/// A provider whose API traffic goes through a new [`StallProxy`] (the manager's does not).
async fn proxied_provider(
    s: &RealCapiScenario,
    extra: &[&str],
) -> (StallProxy, ProviderProcess, Rpc) {
    let proxy = StallProxy::start(socket_addr_of(&s.cp.server)).await;
    let kubeconfig = kubeconfig_with_server(s.cp.admin_kubeconfig(), &s.cp.server, &proxy.server());
    let (provider, rpc) = provider(s, &kubeconfig, extra).await;
    (proxy, provider, rpc)
}

/// A call as cluster-autoscaler makes it: the deadline travels as `grpc-timeout` and the client
/// gives up when it passes (the RPC is cancelled, as Go's gRPC does).
async fn with_deadline<T>(
    deadline: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<(), Status> {
    match tokio::time::timeout(deadline, call).await {
        Ok(result) => result.map(drop),
        Err(_) => Err(Status::deadline_exceeded(format!(
            "client deadline {deadline:?} passed"
        ))),
    }
}

async fn delete_nodes(
    rpc: &Rpc,
    id: &str,
    nodes: Vec<ExternalGrpcNode>,
    deadline: Duration,
) -> Result<(), Status> {
    let mut request = tonic::Request::new(NodeGroupDeleteNodesRequest {
        nodes,
        id: id.to_string(),
    });
    request.set_timeout(deadline);
    let mut client = rpc.client.clone();
    with_deadline(deadline, client.node_group_delete_nodes(request)).await
}

async fn increase_size(rpc: &Rpc, id: &str, delta: i32, deadline: Duration) -> Result<(), Status> {
    let mut request = tonic::Request::new(NodeGroupIncreaseSizeRequest {
        delta,
        id: id.to_string(),
    });
    request.set_timeout(deadline);
    let mut client = rpc.client.clone();
    with_deadline(deadline, client.node_group_increase_size(request)).await
}

async fn view(capi: &Capi, kind: Kind, name: &str) -> GroupView {
    GroupView::read(capi, kind, name)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Polls (every 100 ms, at most `timeout`) until `ok` holds for the group's view; returns that view.
async fn wait_view(
    capi: &Capi,
    kind: Kind,
    name: &str,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&GroupView) -> bool,
) -> Result<GroupView, String> {
    poll_until(what, timeout, Duration::from_millis(100), || async {
        match GroupView::read(capi, kind, name).await {
            Ok(v) if ok(&v) => Check::Done(v),
            Ok(v) => Check::Wait(v.describe()),
            Err(e) => Check::Wait(e),
        }
    })
    .await
}

fn code_of(result: &Result<(), Status>) -> Code {
    match result {
        Ok(()) => Code::Ok,
        Err(s) => s.code(),
    }
}

fn tally(codes: &[Code]) -> BTreeMap<String, usize> {
    let mut t = BTreeMap::new();
    for c in codes {
        *t.entry(format!("{c:?}")).or_insert(0) += 1;
    }
    t
}

fn series(operation: &str, outcome: &str) -> String {
    format!(
        "capi_autoscaler_provider_api_writes_total{{operation=\"{operation}\",outcome=\"{outcome}\"}}"
    )
}

/// Every operation accepted for group `id` before this call has finished when it returns: an
/// IncreaseSize far beyond max takes the group's operation lock (in arrival order) and is refused
/// without a write. UNAVAILABLE (a provider that does not trust its view yet) is retried.
async fn drain_group(rpc: &Rpc, id: &str) {
    poll_until(
        &format!("operations of {id} drained"),
        Duration::from_secs(120),
        Duration::from_millis(200),
        || async {
            match increase_size(rpc, id, 1000, Duration::from_secs(60)).await {
                Err(s) if s.code() == Code::FailedPrecondition => Check::Done(()),
                Err(s) if s.code() == Code::Unavailable => Check::Wait(s.to_string()),
                other => Check::Fatal(format!("the drain probe answered {other:?}")),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// CA-like clients call DeleteNodes with a 1 s deadline while the provider's API traffic is stalled
/// (connections open, no bytes) for longer than the provider's own call timeout; then it resumes and
/// delivers what it held, late. The real manager keeps running meanwhile (its traffic is not
/// stalled). Afterwards, once the grace period and a repair interval have passed and CAPI has
/// converged: the Machines our marks asked to remove (deleted by CAPI with the mark, or still
/// marked) are exactly `initial − replicas`, no mark is unpaid, CAPI deleted no Machine without a
/// mark, replicas are within bounds. The nodes CA retried are removed; the one whose client gave up
/// is either removed too (its operation completed) or keeps its Machine (its late mark taken back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_deadlines_during_an_api_stall_leave_no_unpaid_mark_and_no_lost_decrement() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    const INITIAL: i64 = 6;
    const GRACE_SECS: u64 = 8;
    let stall = PROVIDER_CALL_TIMEOUT + Duration::from_secs(2);
    let s = scenario("fault-deadline-cancellation").await;
    let capi = &s.capi;
    let machines = group(&s, "md", 0, 20, INITIAL).await;
    group(&s, "warm", 0, 5, 0).await;
    let (first, second, late) = (
        machines[0].clone(),
        machines[1].clone(),
        machines[machines.len() - 1].clone(),
    );
    let mut nodes = BTreeMap::new();
    for m in [&first, &second, &late] {
        nodes.insert(m.clone(), node_of(&s, m).await);
    }
    let grace = format!("{GRACE_SECS}s");
    let (proxy, provider, rpc) = proxied_provider(
        &s,
        &["--repair-interval", "500ms", "--mark-grace-period", &grace],
    )
    .await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let one_second = Duration::from_secs(1);
    // A write elsewhere leaves an idle connection in the provider's pool: the next request goes out
    // on it at once, so the stall holds a request rather than a TLS handshake.
    increase_size(
        &rpc,
        &capi.id(Kind::MachineDeployment, "warm"),
        1,
        Duration::from_secs(10),
    )
    .await
    .expect("IncreaseSize of the warm-up group");

    proxy.stall();
    let stalled_at = Instant::now();
    // The client of `late` calls once and gives up (CA moves on). Its mark is the first request
    // the stall holds; the proxy delivers it after the provider has given up on it.
    let given_up = {
        let rpc = rpc.clone();
        let id = id.clone();
        let node = nodes[&late].clone();
        tokio::spawn(async move { delete_nodes(&rpc, &id, vec![node], one_second).await })
    };
    proxy
        .wait_held_request(Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| s.fail(&e));
    // The clients of `first` and `second` call again each time their deadline passes, until the
    // API is back.
    let until = stalled_at + stall;
    let mut clients = tokio::task::JoinSet::new();
    for machine in [&first, &second] {
        let rpc = rpc.clone();
        let id = id.clone();
        let node = nodes[machine].clone();
        let machine = machine.clone();
        clients.spawn(async move {
            let mut codes = Vec::new();
            while Instant::now() < until {
                codes.push(code_of(
                    &delete_nodes(&rpc, &id, vec![node.clone()], one_second).await,
                ));
            }
            (machine, codes)
        });
    }
    let mut during: Vec<(String, Vec<Code>)> = Vec::new();
    while let Some(joined) = clients.join_next().await {
        during.push(joined.expect("a client task"));
    }
    during.push((
        late.clone(),
        vec![code_of(&given_up.await.expect("the late client"))],
    ));
    // The stall lasts as long as the scenario says (the clients above ran until then).
    tokio::time::sleep_until(until.into()).await;
    let before_resume = view(capi, Kind::MachineDeployment, "md").await;
    proxy.resume();
    let resumed_at = Instant::now();
    for (machine, codes) in &during {
        s.check(
            !codes.is_empty() && codes.iter().all(|c| *c != Code::Ok),
            &format!("{machine}: no call can succeed while the API is stalled: {codes:?}"),
        );
    }
    s.check(
        before_resume.replicas == INITIAL,
        &format!(
            "nothing reached the API during the stall: {}",
            before_resume.describe()
        ),
    );

    // CA retries `first` and `second` with its usual deadline (10 s in our cloud-config), in its
    // next loops until one is answered: a removal that began in the stall and ran out of time to
    // mark answers UNAVAILABLE (its claim taken back), as does a retry that joined it.
    for machine in [&first, &second] {
        let answered = poll_until(
            &format!("DeleteNodes({machine}) after the stall"),
            Duration::from_secs(60),
            Duration::from_millis(200),
            || async {
                match delete_nodes(
                    &rpc,
                    &id,
                    vec![nodes[machine].clone()],
                    Duration::from_secs(10),
                )
                .await
                {
                    Ok(()) => Check::Done(()),
                    Err(e)
                        if matches!(
                            e.code(),
                            Code::Unavailable | Code::DeadlineExceeded | Code::Aborted
                        ) =>
                    {
                        Check::Wait(e.to_string())
                    }
                    Err(e) => Check::Fatal(e.to_string()),
                }
            },
        )
        .await;
        if let Err(e) = answered {
            s.fail(&format!("{e}\n{}", provider.log_contents()));
        }
    }
    drain_group(&rpc, &id).await;
    let settled = view(capi, Kind::MachineDeployment, "md").await;
    let late_mark = asked(&s, "md", &settled).contains(&late);

    // Once the grace period and a repair interval have passed and CAPI has deleted what replicas
    // say, the removals our marks asked for are exactly those replicas pay for.
    let exact = |v: &GroupView| {
        asked(&s, "md", v).len() as i64 == INITIAL - v.replicas
            && v.unpaid() == 0
            && v.within_bounds()
            && v.active() as i64 == v.replicas
            && v.machines.iter().all(|m| !m.deleting)
    };
    let final_view = wait_view(
        capi,
        Kind::MachineDeployment,
        "md",
        "removals asked for == initial − replicas, CAPI converged",
        Duration::from_secs(GRACE_SECS) + CONVERGE,
        exact,
    )
    .await
    .unwrap_or_else(|e| s.fail(&format!("{e}\n{}", provider.log_contents())));
    let held_for = resumed_at.elapsed();
    // And it stays so over further repair rounds.
    for _ in 0..6 {
        let v = view(capi, Kind::MachineDeployment, "md").await;
        s.check(
            exact(&v),
            &format!("the invariant broke again: {}", v.describe()),
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    check_no_unmarked_deletion(&s);
    // CA got OK for `first` and `second`: both are removed. The late node's accepted operation may
    // have been completed by the provider (operations run to completion; a mark that landed is owed
    // its decrement, and a retry of the group pays it) or its mark taken back by the repair; either
    // way, counted.
    let removed = deletions_of(&s, "md").0;
    let wanted: BTreeSet<String> = [first.clone(), second.clone()].into();
    let allowed: BTreeSet<String> = [first.clone(), second.clone(), late.clone()].into();
    s.check(
        removed.is_superset(&wanted) && removed.is_subset(&allowed),
        &format!(
            "CAPI removed {removed:?}; CA removed {wanted:?} and gave up on {late}: {}",
            final_view.describe()
        ),
    );
    let late_removed = removed.contains(&late);
    if late_mark && !late_removed {
        let reasons: Vec<String> = capi
            .events_about(&late)
            .await
            .into_iter()
            .filter_map(|e| e.reason)
            .collect();
        s.check(
            reasons.iter().any(|r| r == "DeleteMarkRepaired"),
            &format!("{late}'s late mark was taken back with an Event: {reasons:?}"),
        );
    }
    announce(&format!(
        "faults: deadline cancellation (real CAPI): stall {:.1}s, calls during it {:?}, the late mark landed: {late_mark}, \
         its Machine removed: {late_removed}; removals == initial − replicas ({} − {}) and CAPI converged {:.1}s \
         after the resume, and stable; passed in {:.1}s",
        stall.as_secs_f64(),
        during
            .iter()
            .map(|(m, c)| format!("{m}: {:?}", tally(c)))
            .collect::<Vec<_>>(),
        INITIAL,
        final_view.replicas,
        held_for.as_secs_f64(),
        started.elapsed().as_secs_f64()
    ));
    s.passed();
}

/// A write the provider gave up on is delivered late. Every request shares the provider's one
/// HTTP/2 connection, so the network holds it with the write: the proxy holds that connection's
/// requests from the write on (DeleteNodes: its mark, held once the test sees its claim land;
/// IncreaseSize: its one write). The provider's ping goes unanswered, it gives the connection up,
/// reads the group again on a new one and finishes the operation there; only then is the held write
/// delivered, as through a load balancer that forwards a request whose client has gone. The change
/// must not be applied twice: one DeleteNodes lowers replicas by exactly one (and CAPI deletes
/// exactly that Machine), one IncreaseSize(+1) raises them by exactly one (and CAPI makes one
/// Machine), and the late write is refused (409: the version it names is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_delivered_after_the_provider_gave_up_on_it_is_not_applied_twice() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let s = scenario("fault-late-write").await;
    let capi = &s.capi;
    let admin = s.cp.admin_client().await;
    let machines = group(&s, "md", 0, 10, 3).await;
    let victim = machines[0].clone();
    let victim_node = node_of(&s, &victim).await;
    let mut history = History::start(capi, Kind::MachineDeployment).await;
    // A held connection is given up within about 2 s. The requests before the held one are
    // delayed (see REACTION): a call has 8 s to finish on a new connection.
    let (proxy, provider, rpc) = proxied_provider(
        &s,
        &[
            "--api-ping-interval",
            "1s",
            "--api-ping-timeout",
            "1s",
            "--request-timeout",
            "8s",
        ],
    )
    .await;
    let id = capi.id(Kind::MachineDeployment, "md");
    // Delivers what the proxy holds once the provider has answered, and waits until the apiserver
    // has refused it.
    let deliver_late = |what: &'static str, resource: &'static str| {
        let (admin, proxy, provider, s) = (&admin, &proxy, &provider, &s);
        async move {
            s.check(
                proxy.holding(),
                &format!(
                    "{what}: held until the provider answered\n{}",
                    provider.log_contents()
                ),
            );
            let before = refused_patches(admin, resource).await;
            proxy.resume();
            poll_until(
                &format!("{what} delivered late and refused"),
                Duration::from_secs(30),
                Duration::from_millis(50),
                || async {
                    match refused_patches(admin, resource).await {
                        n if n > before => Check::Done(()),
                        n => Check::Wait(format!("{n} refused patches of {resource}")),
                    }
                },
            )
            .await
            .unwrap_or_else(|e| s.fail(&e));
        }
    };

    // DeleteNodes: the mark it writes once its claim landed is held.
    wait_quiet(&s).await;
    proxy.delay_requests(REACTION);
    let removal = {
        let rpc = rpc.clone();
        let id = id.clone();
        tokio::spawn(async move {
            delete_nodes(&rpc, &id, vec![victim_node], Duration::from_secs(10)).await
        })
    };
    let claims = s.capi.api(Kind::MachineDeployment);
    wait_annotated(&s, &claims, "md", CLAIMS_ANNOTATION, &provider).await;
    proxy.hold_open_connections();
    proxy.delay_requests(Duration::ZERO);
    let removal = removal.await.expect("the DeleteNodes task");
    s.check(
        code_of(&removal) == Code::Ok,
        &format!(
            "DeleteNodes finishes on a new connection: {removal:?}\n{}",
            provider.log_contents()
        ),
    );
    deliver_late("the scale-down's mark", "machines").await;
    drain_group(&rpc, &id).await;
    let after_removal = view(capi, Kind::MachineDeployment, "md").await;
    s.check(
        after_removal.replicas == 2 && asked(&s, "md", &after_removal) == [victim.clone()].into(),
        &format!(
            "one DeleteNodes, one decrement, one mark: {}\n{}",
            after_removal.describe(),
            provider.log_contents()
        ),
    );
    // CAPI deletes exactly the marked Machine.
    let converged = |v: &GroupView| v.active() == 2 && v.machines.iter().all(|m| !m.deleting);
    wait_view(
        capi,
        Kind::MachineDeployment,
        "md",
        "CAPI deleted the marked Machine",
        CONVERGE,
        converged,
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
    let removed = deletions_of(&s, "md").0;
    s.check(
        removed == [victim.clone()].into(),
        &format!("CAPI deleted {removed:?}, want only {victim}"),
    );

    // IncreaseSize: its read answered (the group and its Cluster together: one round, a raise
    // lists nothing), its write is held.
    wait_quiet(&s).await;
    proxy.hold_after_answers(1);
    let increase = increase_size(&rpc, &id, 1, Duration::from_secs(10)).await;
    s.check(
        code_of(&increase) == Code::Ok,
        &format!(
            "IncreaseSize finishes on a new connection: {increase:?}\n{}",
            provider.log_contents()
        ),
    );
    deliver_late("the scale-up's write", "machinedeployments").await;
    drain_group(&rpc, &id).await;
    let after_increase = view(capi, Kind::MachineDeployment, "md").await;
    s.check(
        after_increase.replicas == 3,
        &format!(
            "one IncreaseSize(+1), one increment: {}\n{}",
            after_increase.describe(),
            provider.log_contents()
        ),
    );
    s.wait_machines_with_nodes("md", 3).await;
    check_no_unmarked_deletion(&s);
    let versions = history
        .check_new()
        .unwrap_or_else(|e| s.fail(&format!("invariant 2: {e}")));
    announce(&format!(
        "faults: writes delivered after the provider gave up on their connection (real CAPI): DeleteNodes → \
         replicas 3 → 2 and CAPI deleted exactly that Machine, IncreaseSize(+1) → 2 → 3 and CAPI made one, \
         the late mark and the late raise refused (409); {versions} versions within bounds; passed in {:.1}s",
        started.elapsed().as_secs_f64()
    ));
    s.passed();
}

/// How long a proxy delays each request so that the test, polling the API, sees a write land
/// before the provider's next request passes the proxy (see [`StallProxy::hold_open_connections`]).
const REACTION: Duration = Duration::from_millis(250);

/// Waits until object `name` of `api` carries annotation `key`, polling faster than
/// [`REACTION`].
async fn wait_annotated(
    s: &RealCapiScenario,
    api: &kube::Api<kube::api::DynamicObject>,
    name: &str,
    key: &str,
    provider: &ProviderProcess,
) {
    poll_until(
        &format!("{name}'s {key} in the API"),
        Duration::from_secs(10),
        Duration::from_millis(10),
        || async {
            match api.get(name).await {
                Ok(m) if m.annotations().contains_key(key) => Check::Done(()),
                Ok(m) => Check::Wait(format!("annotations {:?}", m.annotations())),
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&format!("{e}\n{}", provider.log_contents())));
}

/// How many patches of `resource` (not of their status) the apiserver refused with 409.
async fn refused_patches(admin: &kube::Client, resource: &str) -> f64 {
    request_counts(admin)
        .await
        .iter()
        .filter(|(series, _)| {
            label_of(series, "verb") == Some("PATCH")
                && label_of(series, "resource") == Some(resource)
                && matches!(label_of(series, "subresource"), None | Some(""))
                && label_of(series, "code") == Some("409")
        })
        .map(|(_, n)| n)
        .sum()
}

/// The provider SIGKILLed between its two writes, at a controlled point: the proxy delays each
/// request; as soon as the test sees the mark in the API it holds every request the provider
/// sends from then on (its read after the mark is still on its way, so the decrement is not sent
/// yet) and kills the provider: the mark is in the API, the decrement never reaches it.
/// Restarted: the node CA retries is paid once (and only once) and CAPI deletes exactly that
/// Machine; the node nobody retries has its mark taken back once its claim has stood the grace
/// period on the restarted provider (and not before), and CAPI deletes nothing of its group meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_killed_between_mark_and_decrement_is_paid_or_repaired_after_restart() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    // Longer than the restart and CA's retries take, and than a removal may mark in
    // (--request-timeout, 4 s, plus 4 s): nothing is taken back before the retries.
    const GRACE_SECS: u64 = 10;
    const INTERVAL: Duration = Duration::from_millis(500);
    // A record's age is counted in the API server's whole seconds: its stamp rounds up (by up to
    // 2 s), the repair's time down (by up to 1 s).
    const ROUNDING: Duration = Duration::from_secs(3);
    let s = scenario("fault-provider-killed").await;
    let capi = &s.capi;
    s.create_md(&s.md("a", TEMPLATE, 0, 5, 3)).await;
    s.create_md(&s.md("b", TEMPLATE, 0, 5, 3)).await;
    let a0 = s.wait_machines_with_nodes("a", 3).await[0].clone();
    let b0 = s.wait_machines_with_nodes("b", 3).await[0].clone();
    let (a, b) = (
        capi.id(Kind::MachineDeployment, "a"),
        capi.id(Kind::MachineDeployment, "b"),
    );
    let b0_node = node_of(&s, &b0).await;
    // One provider per mark: each is killed with its decrement held.
    let (a_asked, _) = kill_between_mark_and_decrement(&s, &a, "a", &a0).await;
    let (_, killed_at) = kill_between_mark_and_decrement(&s, &b, "b", &b0).await;
    let (second, rpc) = provider(
        &s,
        s.cp.admin_kubeconfig(),
        &[
            "--repair-interval",
            "500ms",
            "--mark-grace-period",
            &format!("{GRACE_SECS}s"),
        ],
    )
    .await;
    let serving_since = Instant::now();
    let restarted_in = killed_at.elapsed();
    // CA retries b0 at once (well within the grace period): the decrement the mark is owed, once.
    for attempt in ["retry", "second retry"] {
        if let Err(e) = delete_nodes(&rpc, &b, vec![b0_node.clone()], Duration::from_secs(10)).await
        {
            s.fail(&format!("DeleteNodes({b0}), {attempt}: {e}"));
        }
        let v = view(capi, Kind::MachineDeployment, "b").await;
        s.check(
            v.replicas == 2 && asked(&s, "b", &v) == [b0.clone()].into(),
            &format!("{attempt}: {}", v.describe()),
        );
    }
    // Nobody retries a0: the repair takes its mark back once its claim is the grace period old on
    // the API server's clock, counted from its removal's start (its stamp), not from the restart.
    s.check(
        view(capi, Kind::MachineDeployment, "a")
            .await
            .marked()
            .contains(&a0),
        &format!("{a0} is still marked after the restart"),
    );
    let repaired = wait_view(
        capi,
        Kind::MachineDeployment,
        "a",
        "a0's mark taken back",
        Duration::from_secs(GRACE_SECS + 20),
        |v| v.marked().is_empty(),
    )
    .await
    .unwrap_or_else(|e| s.fail(&format!("{e}\n{}", second.log_contents())));
    let seen_repaired = Instant::now();
    s.check(
        repaired.replicas == 3 && repaired.active() == 3,
        &repaired.describe(),
    );
    let grace = Duration::from_secs(GRACE_SECS);
    let age = seen_repaired - a_asked;
    s.check(
        age >= grace,
        &format!(
            "taken back {:.1}s after DeleteNodes({a0}) was asked, within the grace period",
            age.as_secs_f64()
        ),
    );
    // Ripe a grace period after the removal's start (at most ROUNDING later), or at the restart if
    // that is later; taken back at the next pass: at most two intervals after, and 1 s for the
    // writes and polling.
    let due = (a_asked + grace + ROUNDING).max(serving_since);
    let late = seen_repaired.saturating_duration_since(due);
    s.check(
        late <= INTERVAL * 2 + Duration::from_secs(1),
        &format!(
            "taken back {:.1}s after it was due: more than two repair intervals (+1 s)",
            late.as_secs_f64()
        ),
    );
    // The Event is recorded beside the unmark, not before it: polled for.
    poll_until(
        &format!("a DeleteMarkRepaired Event about {a0}"),
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let reasons: Vec<String> = capi
                .events_about(&a0)
                .await
                .into_iter()
                .filter_map(|e| e.reason)
                .collect();
            if reasons.iter().any(|r| r == "DeleteMarkRepaired") {
                Check::Done(())
            } else {
                Check::Wait(format!("{reasons:?}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
    // CAPI deleted b0 (its mark paid) and stays at 2; nothing of a went.
    let b_converged = wait_view(
        capi,
        Kind::MachineDeployment,
        "b",
        "CAPI deleted b0",
        CONVERGE,
        |v| v.active() == 2 && v.machines.iter().all(|m| !m.deleting),
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
    for _ in 0..4 {
        let v = view(capi, Kind::MachineDeployment, "b").await;
        s.check(
            v.replicas == 2 && v.unpaid() == 0 && asked(&s, "b", &v) == [b0.clone()].into(),
            &v.describe(),
        );
        tokio::time::sleep(INTERVAL).await;
    }
    s.check(
        deletions_of(&s, "b").0 == [b0.clone()].into() && deletions_of(&s, "a").0.is_empty(),
        &format!(
            "CAPI deleted exactly {b0}: {:?}; b {}",
            s.deletions.all(),
            b_converged.describe()
        ),
    );
    check_no_unmarked_deletion(&s);
    announce(&format!(
        "faults: provider SIGKILLed between mark and decrement (real CAPI): restarted and serving in {:.1}s; \
         retried node paid once and its Machine deleted by CAPI; orphan mark taken back {:.1}s after its removal \
         began ({GRACE_SECS}s grace on the API server's clock, {:.1}s after it was due; repair interval {:.1}s), its group \
         untouched; passed in {:.1}s",
        restarted_in.as_secs_f64(),
        age.as_secs_f64(),
        late.as_secs_f64(),
        INTERVAL.as_secs_f64(),
        started.elapsed().as_secs_f64()
    ));
    s.passed();
}

/// Starts a provider behind a [`StallProxy`], holds the apiserver's answers, calls
/// DeleteNodes(`machine`) and SIGKILLs the provider as soon as the mark is in the API; checks that
/// the decrement never happened. Returns when DeleteNodes was asked and when the provider was killed.
async fn kill_between_mark_and_decrement(
    s: &RealCapiScenario,
    id: &str,
    group: &str,
    machine: &str,
) -> (Instant, Instant) {
    let capi = &s.capi;
    let node = node_of(s, machine).await;
    let (proxy, provider, rpc) = proxied_provider(s, &[]).await;
    wait_quiet(s).await;
    proxy.delay_requests(REACTION);
    let asked = Instant::now();
    let call = {
        let rpc = rpc.clone();
        let id = id.to_string();
        tokio::spawn(
            async move { delete_nodes(&rpc, &id, vec![node], Duration::from_secs(30)).await },
        )
    };
    let machines = s.capi.api(Kind::Machine);
    wait_annotated(s, &machines, machine, &s.capi.delete_key(), &provider).await;
    proxy.hold_open_connections();
    drop(provider); // SIGKILL
    let killed_at = Instant::now();
    s.check(
        capi.replicas(Kind::MachineDeployment, group).await == 3,
        &format!("{group}: killed between mark and decrement: the decrement was never sent"),
    );
    let result = call.await.expect("the DeleteNodes task");
    s.check(
        result.is_err(),
        "a DeleteNodes whose provider died before any answer reached it cannot have answered OK",
    );
    drop(proxy);
    (asked, killed_at)
}

// ---------------------------------------------------------------------------------------------------
// The kube-apiserver killed and stopped under a workload.

/// What the CA-like clients of the apiserver test did.
#[derive(Default)]
struct Workload {
    codes: Vec<(&'static str, Code)>,
    /// Per operation and refusal, how often each message came (the numbers in it blanked).
    refusals: BTreeMap<(&'static str, String), BTreeMap<String, usize>>,
    ok_since_mark: usize,
}

/// One CA-like client of one group: IncreaseSize(+1 or +2), DeleteNodes of one Running node (now
/// and then again for a node it removed before, as CA retries), with CA's 10 s deadline, until
/// `stop`. No DecreaseTargetSize: every Machine CAPI then deletes must carry a mark.
async fn ca_client(
    rpc: Rpc,
    id: String,
    seed: u64,
    stop: Arc<AtomicBool>,
    log: Arc<std::sync::Mutex<Workload>>,
    ops: Arc<AtomicU64>,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut removed: Vec<ExternalGrpcNode> = Vec::new();
    let deadline = Duration::from_secs(10);
    while !stop.load(Ordering::SeqCst) {
        let (what, result) = if rng.random_bool(0.4) {
            let delta = rng.random_range(1..=2);
            (
                "IncreaseSize",
                increase_size(&rpc, &id, delta, deadline).await,
            )
        } else if !removed.is_empty() && rng.random_bool(0.2) {
            let node = removed[rng.random_range(0..removed.len())].clone();
            (
                "DeleteNodes(retry)",
                delete_nodes(&rpc, &id, vec![node], deadline).await,
            )
        } else {
            let mut client = rpc.client.clone();
            let instances = tokio::time::timeout(
                deadline,
                client.node_group_nodes(capi_autoscaler_provider::proto::NodeGroupNodesRequest {
                    id: id.clone(),
                }),
            )
            .await;
            // Instances the stand-in cloud provisioned (the rest have the provider's placeholders).
            let running: Vec<String> = match instances {
                Ok(Ok(r)) => r
                    .into_inner()
                    .instances
                    .into_iter()
                    .filter(|i| i.id.starts_with("standin:///"))
                    .map(|i| i.id)
                    .collect(),
                _ => Vec::new(),
            };
            if running.is_empty() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let provider_id = running[rng.random_range(0..running.len())].clone();
            // The stand-in names a Node after its machine, the last segment of the providerID.
            let name = provider_id
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_string();
            let node = grpc_node(&provider_id, &name);
            let result = delete_nodes(&rpc, &id, vec![node.clone()], deadline).await;
            if result.is_ok() {
                removed.push(node);
            }
            ("DeleteNodes", result)
        };
        ops.fetch_add(1, Ordering::SeqCst);
        let code = code_of(&result);
        {
            let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
            if code == Code::Ok {
                log.ok_since_mark += 1;
            }
            log.codes.push((what, code));
            if let Err(status) = &result {
                let message: String = status
                    .message()
                    .chars()
                    .map(|c| if c.is_ascii_digit() { '#' } else { c })
                    .collect();
                *log.refusals
                    .entry((what, format!("{code:?}")))
                    .or_default()
                    .entry(message)
                    .or_insert(0) += 1;
            }
        }
        // CA acts once per loop (10 s by default); faster here, but slow enough for CAPI to act on
        // most removals before the next scale-up.
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..600))).await;
    }
}

/// Waits (at most `timeout`) until the clients have had `n` more successful operations.
async fn wait_progress(
    s: &RealCapiScenario,
    log: &std::sync::Mutex<Workload>,
    n: usize,
    what: &str,
    timeout: Duration,
) {
    log.lock().unwrap_or_else(|e| e.into_inner()).ok_since_mark = 0;
    poll_until(what, timeout, Duration::from_millis(100), || async {
        let done = log.lock().unwrap_or_else(|e| e.into_inner()).ok_since_mark;
        if done >= n {
            Check::Done(())
        } else {
            Check::Wait(format!("{done} of {n} successful operations"))
        }
    })
    .await
    .unwrap_or_else(|e| s.fail(&e));
}

/// Waits until the manager's `/readyz` answers ok (it lived through the faults of the apiserver).
async fn wait_manager_ready(s: &RealCapiScenario, what: &str) {
    let address = &s.manager.health_address;
    poll_until(
        &format!("the CAPI manager ready {what}"),
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async move {
            match procs::http_get(address, "/readyz").await {
                Ok((200, _)) => Check::Done(()),
                Ok((code, body)) => Check::Wait(format!("{code}: {body}")),
                Err(e) => Check::Wait(e),
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
}

/// The kube-apiserver SIGKILLed and restarted (same port, same etcd), then SIGSTOPped for 30 s, while
/// CA-like clients scale three MachineDeployments and the real manager (same process throughout:
/// it retries) makes and deletes their Machines. Afterwards: every version of every group in etcd
/// has replicas within that version's bounds; once operations are drained, CAPI has converged and the
/// grace period and a repair interval have passed, no Machine carries an unpaid mark of ours; every
/// Machine CAPI deleted carried our mark (no decrement without its mark: the clients never call
/// DecreaseTargetSize). The provider served writes again after each fault.
///
/// 30 s of SIGSTOP outlast every timeout on the path: the provider's per-call 4 s and the ~13 s it
/// spends resolving an unknown outcome, CA's 10 s deadline; requests sent meanwhile sit in the
/// stopped apiserver's socket buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apiserver_killed_and_stopped_during_scale_operations_keeps_bounds_and_marks() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    const GROUPS: [&str; 3] = ["g0", "g1", "g2"];
    const GRACE_SECS: u64 = 5;
    const STOP: Duration = Duration::from_secs(30);
    let s = scenario("fault-apiserver").await;
    let capi = &s.capi;
    for group in GROUPS {
        s.create_md(&s.md(group, TEMPLATE, 1, 6, 2)).await;
    }
    for group in GROUPS {
        s.wait_machines_with_nodes(group, 2).await;
    }
    let manager_pid = s.manager.pid();
    let grace = format!("{GRACE_SECS}s");
    let (provider, rpc) = provider(
        &s,
        s.cp.admin_kubeconfig(),
        &["--repair-interval", "500ms", "--mark-grace-period", &grace],
    )
    .await;
    let mut apiserver = ApiServer::of(s.cp);

    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(std::sync::Mutex::new(Workload::default()));
    let ops = Arc::new(AtomicU64::new(0));
    let seed = 0x5eed_0a91;
    let mut clients = tokio::task::JoinSet::new();
    for (i, group) in GROUPS.iter().enumerate() {
        clients.spawn(ca_client(
            rpc.clone(),
            capi.id(Kind::MachineDeployment, group),
            seed + i as u64,
            Arc::clone(&stop),
            Arc::clone(&log),
            Arc::clone(&ops),
        ));
    }
    wait_progress(
        &s,
        &log,
        15,
        "scale operations under way",
        Duration::from_secs(60),
    )
    .await;

    let ops_before_kill = ops.load(Ordering::SeqCst);
    let restart = apiserver.kill_and_restart().await;
    wait_progress(
        &s,
        &log,
        15,
        "successful operations after the apiserver restart",
        Duration::from_secs(90),
    )
    .await;

    let ops_before_stop = ops.load(Ordering::SeqCst);
    apiserver.stop();
    // The fault's length, not a wait for a condition.
    tokio::time::sleep(STOP).await;
    apiserver.resume();
    let ops_during_stop = ops.load(Ordering::SeqCst) - ops_before_stop;
    wait_progress(
        &s,
        &log,
        15,
        "successful operations after SIGCONT",
        Duration::from_secs(90),
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    while let Some(joined) = clients.join_next().await {
        joined.expect("a client task");
    }
    let workload_done = Instant::now();
    for group in GROUPS {
        drain_group(&rpc, &capi.id(Kind::MachineDeployment, group)).await;
    }
    wait_manager_ready(&s, "after the apiserver's SIGKILL and SIGSTOP").await;
    s.check(
        s.manager.pid() == manager_pid,
        &format!(
            "the same manager process throughout: {manager_pid:?}, now {:?}",
            s.manager.pid()
        ),
    );

    // Converged and repaired: CAPI made replicas Machines, and no mark of ours is unpaid.
    let mut finals = BTreeMap::new();
    for group in GROUPS {
        let v = wait_view(
            capi,
            Kind::MachineDeployment,
            group,
            "converged, no unpaid mark of ours",
            Duration::from_secs(GRACE_SECS) + CONVERGE,
            |v| {
                v.active() as i64 == v.replicas
                    && v.machines.iter().all(|m| !m.deleting)
                    && v.unpaid() == 0
            },
        )
        .await
        .unwrap_or_else(|e| s.fail(&format!("{group}: {e}\n{}", provider.log_contents())));
        s.check(v.within_bounds(), &format!("{group}: {}", v.describe()));
        finals.insert(group, v.replicas);
    }
    let settled_in = workload_done.elapsed();
    // Every version etcd stored (a watch through the restarted apiserver cannot resume from before
    // the restart: its watch cache starts afresh).
    let etcd = apiserver.etcd_url();
    let mut versions = 0;
    for group in GROUPS {
        let (stored, violations) = s
            .stored_bound_violations(&etcd, "machinedeployments", group)
            .await;
        s.check(
            violations.is_empty(),
            &format!("invariant 2 for {group}:\n{}", violations.join("\n")),
        );
        versions += stored;
    }
    check_no_unmarked_deletion(&s);
    let marked_deletions = s.deletions.marked().len();
    let codes = log.lock().unwrap_or_else(|e| e.into_inner()).codes.clone();
    let refusals = log
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .refusals
        .clone();
    for ((op, code), messages) in &refusals {
        eprintln!("faults: apiserver workload: {op} {code}: {messages:?}");
    }
    // A raise soon after a removal, before CAPI acted on the lower count, absorbs a paid mark: the
    // removals refused for that until the repair took the mark back.
    let absorbed: usize = refusals
        .values()
        .flat_map(|m| m.iter())
        .filter(|(message, _)| message.contains("absorbed"))
        .map(|(_, n)| n)
        .sum();
    let mut by_op: BTreeMap<&str, Vec<Code>> = BTreeMap::new();
    for (op, code) in &codes {
        by_op.entry(op).or_default().push(*code);
    }
    for (op, codes) in &by_op {
        for code in codes {
            s.check(
                matches!(
                    code,
                    Code::Ok
                        | Code::FailedPrecondition
                        | Code::Unavailable
                        | Code::DeadlineExceeded
                        | Code::Aborted
                        | Code::NotFound
                        | Code::Cancelled
                        | Code::Unknown
                ),
                &format!("{op}: unexpected {code:?}"),
            );
        }
    }
    announce(&format!(
        "faults: kube-apiserver SIGKILL + restart ({:.1}s to ready) after {ops_before_kill} operations, \
         SIGSTOP {}s ({ops_during_stop} operations answered meanwhile), the real CAPI manager alive throughout; \
         {} operations in all {:?}; {versions} versions within bounds; {marked_deletions} Machines deleted by CAPI \
         for their mark, none unmarked (watch re-lists: {}); {absorbed} removals refused as absorbed by a raise; final replicas {finals:?}; converged {:.1}s after the \
         workload; passed in {:.1}s",
        restart.as_secs_f64(),
        STOP.as_secs(),
        codes.len(),
        by_op
            .iter()
            .map(|(op, c)| format!("{op}: {:?}", tally(c)))
            .collect::<Vec<_>>(),
        s.deletions.gaps(),
        settled_in.as_secs_f64(),
        started.elapsed().as_secs_f64()
    ));
    s.passed();
}

// ---------------------------------------------------------------------------------------------------
// Conflicts and bounds.

/// Writers that patch an unrelated annotation of `name` as fast as they can, until dropped.
struct Poker {
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
    tasks: tokio::task::JoinSet<()>,
}

impl Poker {
    fn start(capi: &Capi, kind: Kind, name: &str, writers: usize) -> Poker {
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicU64::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..writers {
            let api = capi.api(kind);
            let name = name.to_string();
            let (stop, writes) = (Arc::clone(&stop), Arc::clone(&writes));
            tasks.spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    let patch = json!({"metadata": {"annotations": {
                        format!("e2e.test/poke-{w}"): n.to_string()
                    }}});
                    if api
                        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .is_ok()
                    {
                        writes.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        }
        Poker {
            stop,
            writes,
            tasks,
        }
    }

    fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    async fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        while self.tasks.join_next().await.is_some() {}
    }
}

/// A concurrent writer keeps changing the MachineDeployment (an unrelated annotation, as fast as it
/// can, each write through CAPI's webhooks) while the provider's requests take 25 ms to arrive, so
/// every write the provider computes is stale by the time it lands: 409 on every attempt. Each
/// DeleteNodes and IncreaseSize answers OK or ABORTED, within a bounded time and after at most
/// MAX_ATTEMPTS conflicts; after every removal the Machines our marks asked to remove are exactly
/// `initial − replicas` (an aborted removal takes its mark back); no version is outside the bounds.
/// With the writer gone, CA's retries succeed, and CAPI deletes exactly the three marked Machines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_on_every_attempt_end_in_ok_or_aborted_without_unpaid_marks() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    const INITIAL: i64 = 4;
    let s = scenario("fault-conflicts").await;
    let capi = &s.capi;
    let machines = group(&s, "md", 1, 8, INITIAL).await;
    let mut nodes = BTreeMap::new();
    for m in &machines {
        nodes.insert(m.clone(), node_of(&s, m).await);
    }
    let mut history = History::start(capi, Kind::MachineDeployment).await;
    let (proxy, provider, rpc) = proxied_provider(&s, &[]).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let conflicts = || async {
        provider_metric(
            &provider.metrics_address,
            &series("delete-nodes", "conflict"),
        )
        .await
            + provider_metric(
                &provider.metrics_address,
                &series("increase-size", "conflict"),
            )
            .await
    };

    proxy.delay_requests(Duration::from_millis(25));
    let poker = Poker::start(capi, Kind::MachineDeployment, "md", 2);
    poll_until(
        "the concurrent writer is writing",
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            match poker.writes() {
                n if n >= 20 => Check::Done(()),
                n => Check::Wait(format!("{n} writes")),
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));

    let mut outcomes: Vec<(String, Code, f64, Duration)> = Vec::new();
    let mut aborted_nodes = Vec::new();
    let removals = &machines[..3];
    // Removals first (the removals asked for must match replicas exactly after each), then
    // scale-ups.
    for machine in removals {
        let before = view(capi, Kind::MachineDeployment, "md").await;
        let c0 = conflicts().await;
        let t = Instant::now();
        let result = delete_nodes(
            &rpc,
            &id,
            vec![nodes[machine].clone()],
            Duration::from_secs(60),
        )
        .await;
        let took = t.elapsed();
        let code = code_of(&result);
        let after = view(capi, Kind::MachineDeployment, "md").await;
        s.check(
            matches!(code, Code::Ok | Code::Aborted),
            &format!("DeleteNodes({machine}) under conflicts: {result:?}"),
        );
        let asked_now = asked(&s, "md", &after);
        s.check(
            asked_now.len() as i64 == INITIAL - after.replicas,
            &format!(
                "DeleteNodes({machine}) → {code:?}: removals asked for {asked_now:?} and replicas disagree: {}",
                after.describe()
            ),
        );
        match code {
            Code::Ok => s.check(
                after.replicas == before.replicas - 1,
                &format!("OK: one decrement: {}", after.describe()),
            ),
            _ => {
                s.check(
                    after.replicas == before.replicas,
                    &format!("aborted: no decrement: {}", after.describe()),
                );
                s.check(
                    !asked_now.contains(machine),
                    &format!("aborted: the mark is taken back: {}", after.describe()),
                );
                aborted_nodes.push(machine.clone());
            }
        }
        outcomes.push((
            format!("DeleteNodes({machine})"),
            code,
            conflicts().await - c0,
            took,
        ));
    }
    // CAPI begins deleting what the removals paid for before CA scales up again: a raise before
    // that would absorb a paid mark (CAPI then keeps a marked Machine of its choice; the repair's
    // business, proven in tests/real_capi/marks.rs, not this test's).
    wait_view(
        capi,
        Kind::MachineDeployment,
        "md",
        "CAPI deleting the Machines of the paid removals",
        CONVERGE,
        |v| v.marked().is_empty(),
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
    for _ in 0..3 {
        let before = view(capi, Kind::MachineDeployment, "md").await;
        let c0 = conflicts().await;
        let t = Instant::now();
        let result = increase_size(&rpc, &id, 1, Duration::from_secs(60)).await;
        let took = t.elapsed();
        let code = code_of(&result);
        s.check(
            matches!(code, Code::Ok | Code::Aborted),
            &format!("IncreaseSize(1) under conflicts: {result:?}"),
        );
        let after = view(capi, Kind::MachineDeployment, "md").await;
        let grew = if code == Code::Ok { 1 } else { 0 };
        s.check(
            after.replicas == before.replicas + grew,
            &format!("{code:?}: {}", after.describe()),
        );
        outcomes.push(("IncreaseSize(1)".into(), code, conflicts().await - c0, took));
    }
    let writes = poker.writes();
    poker.stop().await;
    for (what, code, conflicts, took) in &outcomes {
        s.check(
            *conflicts <= PROVIDER_MAX_ATTEMPTS,
            &format!("{what}: {conflicts} conflicts for one call (bounded attempts)"),
        );
        s.check(
            *took < Duration::from_secs(30),
            &format!("{what}: answered {code:?} after {took:?}"),
        );
    }
    let aborted = outcomes.iter().filter(|o| o.1 == Code::Aborted).count();
    s.check(
        aborted > 0,
        &format!(
            "the concurrent writer ({writes} writes) never forced ABORTED: the test did not exercise conflicts on every attempt: {outcomes:?}"
        ),
    );

    // The writer is gone: CA's retries of the aborted removals succeed.
    proxy.delay_requests(Duration::ZERO);
    for machine in &aborted_nodes {
        if let Err(e) = delete_nodes(
            &rpc,
            &id,
            vec![nodes[machine].clone()],
            Duration::from_secs(10),
        )
        .await
        {
            s.fail(&format!(
                "DeleteNodes({machine}) retried without conflicts: {e}"
            ));
        }
    }
    let want: BTreeSet<String> = removals.iter().cloned().collect();
    let last = view(capi, Kind::MachineDeployment, "md").await;
    s.check(
        asked(&s, "md", &last) == want,
        &format!("removals asked for: want {want:?}: {}", last.describe()),
    );
    let converged = wait_view(
        capi,
        Kind::MachineDeployment,
        "md",
        "CAPI converged",
        CONVERGE,
        |v| v.active() as i64 == v.replicas && v.machines.iter().all(|m| !m.deleting),
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
    let removed = deletions_of(&s, "md").0;
    s.check(
        removed == want,
        &format!(
            "CAPI deleted {removed:?}, want exactly {want:?}: {}",
            converged.describe()
        ),
    );
    check_no_unmarked_deletion(&s);
    let versions = history
        .check_new()
        .unwrap_or_else(|e| s.fail(&format!("invariant 2: {e}")));
    announce(&format!(
        "faults: 409 on every attempt (real CAPI; {writes} concurrent writes, requests delayed 25 ms): {:?}; \
         CAPI deleted exactly the 3 marked Machines; {versions} versions within bounds; passed in {:.1}s",
        outcomes
            .iter()
            .map(|(w, c, n, t)| format!("{w} {c:?} after {n} conflicts in {:.2}s", t.as_secs_f64()))
            .collect::<Vec<_>>(),
        started.elapsed().as_secs_f64()
    ));
    s.passed();
}

/// Bounds lowered while IncreaseSize is under way. First deterministic: the provider's write is held
/// in the network while max drops from 10 to 3, so it lands on an older version, conflicts, and the
/// provider re-reads and refuses (FAILED_PRECONDITION) rather than writing 7. Then raced: a writer
/// flips max between 4 and 6 as fast as it can (through CAPI's webhooks) while IncreaseSize(+1) is
/// called repeatedly; every replica write in the object's history lies within the max of the
/// version it was written over. CAPI makes the Machines of every raise meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_lowered_during_increase_size_are_those_of_the_version_written_over() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    const LOW: i64 = 4;
    const HIGH: i64 = 6;
    let s = scenario("fault-bounds").await;
    let capi = &s.capi;
    group(&s, "md", 0, 10, 2).await;
    let mut history = History::start(capi, Kind::MachineDeployment).await;
    let (proxy, provider, rpc) = proxied_provider(&s, &[]).await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let max_key = capi.max_key();
    let set_max = |max: i64| {
        let patch = json!({"metadata": {"annotations": {max_key.as_str(): max.to_string()}}});
        async move {
            capi.patch(Kind::MachineDeployment, "md", patch).await;
        }
    };

    // Deterministic: the write computed against max 10 is in flight when max becomes 3.
    let conflicts_before = provider_metric(
        &provider.metrics_address,
        &series("increase-size", "conflict"),
    )
    .await;
    // Its read answered (the group and its Cluster together: one round, a raise lists
    // nothing), its write held.
    proxy.hold_after_answers(1);
    let call = {
        let rpc = rpc.clone();
        let id = id.clone();
        tokio::spawn(async move { increase_size(&rpc, &id, 5, Duration::from_secs(30)).await })
    };
    proxy
        .wait_held_request(Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| s.fail(&e));
    set_max(3).await;
    proxy.resume();
    let result = call.await.expect("the IncreaseSize task");
    let message = expect_code(
        "IncreaseSize(5) written over a version whose max is 3",
        result,
        Code::FailedPrecondition,
    );
    s.check(
        capi.replicas(Kind::MachineDeployment, "md").await == 2,
        "the refused IncreaseSize wrote nothing",
    );
    let conflicts = provider_metric(
        &provider.metrics_address,
        &series("increase-size", "conflict"),
    )
    .await
        - conflicts_before;
    s.check(
        conflicts >= 1.0,
        &format!("the held write conflicted with the lowered max ({message})"),
    );

    // Raced: max flips between LOW and HIGH as fast as a writer can.
    set_max(HIGH).await;
    let stop = Arc::new(AtomicBool::new(false));
    let flips = Arc::new(AtomicU64::new(0));
    let flipper = {
        let api = capi.api(Kind::MachineDeployment);
        let (stop, flips, key) = (Arc::clone(&stop), Arc::clone(&flips), capi.max_key());
        tokio::spawn(async move {
            let mut max = LOW;
            while !stop.load(Ordering::SeqCst) {
                let patch = json!({"metadata": {"annotations": {key.as_str(): max.to_string()}}});
                if api
                    .patch("md", &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .is_ok()
                {
                    flips.fetch_add(1, Ordering::SeqCst);
                    max = if max == LOW { HIGH } else { LOW };
                }
            }
        })
    };
    let mut codes = Vec::new();
    for _ in 0..30 {
        codes.push(code_of(
            &increase_size(&rpc, &id, 1, Duration::from_secs(30)).await,
        ));
    }
    stop.store(true, Ordering::SeqCst);
    flipper.await.expect("the flipper");
    for code in &codes {
        s.check(
            matches!(code, Code::Ok | Code::FailedPrecondition | Code::Aborted),
            &format!("IncreaseSize(1) while max flips: {code:?}"),
        );
    }
    let versions = history.check_new().unwrap_or_else(|e| {
        s.fail(&format!(
            "invariant 2: replicas written above the max of the version written over:\n{e}\n{}",
            provider.log_contents()
        ))
    });
    let final_replicas = capi.replicas(Kind::MachineDeployment, "md").await;
    s.check(
        codes.contains(&Code::Ok),
        &format!("some IncreaseSize landed: {codes:?}"),
    );
    // CAPI makes the Machines the raises asked for, and deletes none.
    s.wait_machines_with_nodes("md", usize::try_from(final_replicas).unwrap_or(0))
        .await;
    check_no_unmarked_deletion(&s);
    s.check(
        s.deletions.all().is_empty(),
        &format!("no Machine deleted: {:?}", s.deletions.all()),
    );
    announce(&format!(
        "faults: bounds lowered during IncreaseSize (real CAPI): held write refused after {conflicts} conflict(s) \
         ({message}); raced against {} max flips: {:?}, replicas 2 → {final_replicas} and CAPI made their Machines, \
         {versions} versions each within its own bounds; passed in {:.1}s",
        flips.load(Ordering::SeqCst),
        tally(&codes),
        started.elapsed().as_secs_f64()
    ));
    s.passed();
}

// ---------------------------------------------------------------------------------------------------
// MachinePool removals across restarts and spellings.

/// MachinePool `pool` of [`CLUSTER`] on a stand-in machine pool, with bounds and replicas; waits
/// until CAPI lists the stand-in's `replicas` instances in its `spec.providerIDList`, and returns
/// them.
async fn machine_pool(s: &RealCapiScenario, min: i64, max: i64, replicas: i64) -> Vec<String> {
    s.create_pool(&s.mp("pool", min, max, replicas), json!({}))
        .await;
    wait_pool_listing(s, usize::try_from(replicas).unwrap_or(0)).await
}

/// Waits until CAPI lists `n` instances in MachinePool `pool`'s `spec.providerIDList`; returns them.
async fn wait_pool_listing(s: &RealCapiScenario, n: usize) -> Vec<String> {
    let capi = &s.capi;
    poll_until(
        &format!("{n} instances listed in MachinePool pool"),
        CONVERGE,
        Duration::from_millis(200),
        || async move {
            match GroupView::read(capi, Kind::MachinePool, "pool").await {
                Ok(v) if v.provider_ids.len() == n => Check::Done(v.provider_ids),
                Ok(v) => Check::Wait(format!("listed {:?}", v.provider_ids)),
                Err(e) => Check::Wait(e),
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e))
}

/// A MachinePool node without a Machine: DeleteNodes lowers replicas once and records the node in
/// the pool's ledger annotation. The provider is SIGKILLed and restarted; CA retries the node with a
/// differently spelled providerID (`standin:////<name>` for `standin:///<ns>/<name>`, and the bare
/// name) and then as before: replicas do not drop again. Another node still decrements once, and
/// its retry in the other spelling not. The real MachinePool controller and the stand-in cloud
/// follow replicas: the cloud picks which instance goes (the newest), CAPI drops it from the list
/// and deletes its Node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_pool_retry_across_a_restart_and_spellings_decrements_once() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let s = RealCapiScenario::new("fault-machinepool-retry").await;
    let capi = &s.capi;
    let listed = machine_pool(&s, 0, 5, 3).await;
    let id = capi.id(Kind::MachinePool, "pool");
    let name_of = |provider_id: &str| {
        provider_id
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string()
    };
    let node = |provider_id: &str| grpc_node(provider_id, &name_of(provider_id));
    let replicas = || capi.replicas(Kind::MachinePool, "pool");
    let (one, two) = (listed[0].clone(), listed[1].clone());
    let (one_name, two_name) = (name_of(&one), name_of(&two));

    let (first, rpc) = provider(&s, s.cp.admin_kubeconfig(), &[]).await;
    if let Err(e) = delete_nodes(&rpc, &id, vec![node(&one)], Duration::from_secs(10)).await {
        s.fail(&format!("DeleteNodes({one}): {e}"));
    }
    s.check(replicas().await == 2, "one decrement");
    let ledger = view(capi, Kind::MachinePool, "pool").await.ledger;
    s.check(
        ledger.len() == 1,
        &format!("the removal is recorded on the pool ({LEDGER_ANNOTATION}): {ledger:?}"),
    );
    drop(first); // SIGKILL: nothing in memory survives
    let after_first = wait_pool_listing(&s, 2).await;

    let (_second, rpc) = provider(&s, s.cp.admin_kubeconfig(), &[]).await;
    for spelling in [
        format!("standin:////{one_name}"),
        one.clone(),
        one_name.clone(),
    ] {
        let result = delete_nodes(&rpc, &id, vec![node(&spelling)], Duration::from_secs(10)).await;
        s.check(
            result.is_ok(),
            &format!("DeleteNodes({spelling}) after the restart: {result:?}"),
        );
        s.check(
            replicas().await == 2,
            &format!("DeleteNodes({spelling}) after the restart must not decrement again"),
        );
    }
    let other = format!("standin:////{two_name}");
    if let Err(e) = delete_nodes(&rpc, &id, vec![node(&other)], Duration::from_secs(10)).await {
        s.fail(&format!("DeleteNodes({other}): {e}"));
    }
    s.check(replicas().await == 1, "another node decrements once");
    let retry = delete_nodes(&rpc, &id, vec![node(&two)], Duration::from_secs(10)).await;
    s.check(
        replicas().await == 1,
        &format!("and its retry in the other spelling not ({retry:?})"),
    );
    let ledger = view(capi, Kind::MachinePool, "pool").await.ledger;
    let after_second = wait_pool_listing(&s, 1).await;
    s.check(ledger.len() <= 2, &format!("{ledger:?}"));
    announce(&format!(
        "faults: MachinePool retry across a SIGKILL + restart and spellings (real CAPI): one decrement per node, \
         retry of the second node {:?}, ledger {ledger:?}; the cloud's choice of instances: {listed:?} → \
         {after_first:?} → {after_second:?}; passed in {:.1}s",
        code_of(&retry),
        started.elapsed().as_secs_f64()
    ));
    s.passed();
}
