//! The write path under faults: invariants 2 (replicas never written outside [min, max] of the
//! version written over) and 3 (no delete mark without its replica decrement for longer than the
//! grace period and a repair interval, no decrement without its mark, no double decrement) while
//! cluster-autoscaler-like clients give up on deadlines, the provider is SIGKILLed between its two
//! writes, the kube-apiserver is SIGKILLed and SIGSTOPped, every write conflicts, bounds change under
//! a write, and MachinePool removals are retried across a restart in another spelling.
//!
//! The faults stall, kill and stop processes this binary shares (and each test times things), so the
//! tests run one at a time ([`SERIAL`]). Each prints its wall time.

pub mod support;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::{
    ExternalGrpcNode, NodeGroupDeleteNodesRequest, NodeGroupIncreaseSizeRequest,
};
use kube::api::{Patch, PatchParams};
use rand::{Rng as _, SeedableRng as _};
use serde_json::json;
use support::capi::{
    Capi, Kind, Owner, Rpc, Scalable, expect_code, fresh_capi, grpc_node, ids,
    kubeconfig_with_server, label_of, request_counts, socket_addr_of,
};
use support::faults::{
    ApiServer, GroupView, History, LEDGER_ANNOTATION, StallProxy, bound_violations, etcd_versions,
    our_mark_time, provider_metric,
};
use support::procs::announce;
use support::reconciler::{Reconciler, ReconcilerConfig};
use support::{
    CAPI_GROUP, Check, ControlPlane, ProviderProcess, Setup, poll_until, start_provider,
};
use tonic::{Code, Status};

const SETUP: Setup = Setup::shipped();
const VERSION: &str = "v1beta2";

/// One fault test at a time: they stall, kill and stop processes of this binary's control plane.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The provider's per-call bound on API requests (`CALL_TIMEOUT` in src/actuator.rs): stalls longer
/// than this make the provider give up on a request the network may still deliver.
const PROVIDER_CALL_TIMEOUT: Duration = Duration::from_secs(4);
/// Attempts at a replica write before the provider answers ABORTED (`MAX_ATTEMPTS`).
const PROVIDER_MAX_ATTEMPTS: f64 = 8.0;

struct Env {
    cp: &'static ControlPlane,
    capi: Capi,
}

async fn env() -> Env {
    let (cp, capi) = fresh_capi(SETUP, VERSION).await;
    Env { cp, capi }
}

fn discovery(capi: &Capi) -> String {
    format!("clusterapi:namespace={}", capi.ns)
}

/// A provider for the test's namespace talking to the API through `kubeconfig`, with `extra` flags.
async fn provider(
    env: &Env,
    kubeconfig: &std::path::Path,
    extra: &[&str],
) -> (ProviderProcess, Rpc) {
    let discovery = discovery(&env.capi);
    let mut args = vec!["--node-group-auto-discovery", discovery.as_str()];
    args.extend_from_slice(extra);
    let provider = start_provider(&args, kubeconfig).await;
    let rpc = Rpc::connect(&provider).await;
    (provider, rpc)
}

/// A provider whose API traffic goes through a new [`StallProxy`].
async fn proxied_provider(env: &Env, extra: &[&str]) -> (StallProxy, ProviderProcess, Rpc) {
    let proxy = StallProxy::start(socket_addr_of(&env.cp.server)).await;
    let kubeconfig =
        kubeconfig_with_server(env.cp.admin_kubeconfig(), &env.cp.server, &proxy.server());
    let (provider, rpc) = provider(env, &kubeconfig, extra).await;
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

/// CA-like clients call DeleteNodes with a 1 s deadline while the API is stalled (connections open,
/// no bytes) for longer than the provider's own call timeout; then the API resumes and delivers what
/// it held, late. Afterwards, once the grace period and a repair interval have passed, the Machines
/// marked by us and not being deleted are exactly `initial − replicas`: no unpaid mark, no lost
/// decrement, no double decrement. The nodes CA retried are removed; the one whose client gave up is
/// not (its mark, delivered late without its decrement, is taken back by the repair).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_deadlines_during_an_api_stall_leave_no_unpaid_mark_and_no_lost_decrement() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    const INITIAL: i64 = 10;
    const GRACE_SECS: u64 = 8;
    let stall = PROVIDER_CALL_TIMEOUT + Duration::from_secs(2);
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 20).replicas(INITIAL), false)
        .await;
    for i in 0..INITIAL {
        capi.create_machine(&capi.running(&format!("m{i}"), md.clone()))
            .await;
    }
    // Being deleted already: DeleteNodes of it takes the group's operation lock and writes nothing.
    // Operations of a group run one at a time in arrival order, so its answer means every operation
    // accepted before it has finished.
    capi.create_machine(&capi.running("probe", md.clone()).deleting())
        .await;
    capi.create(&Scalable::md("warm").bounds(0, 5).replicas(0))
        .await;
    let grace = format!("{GRACE_SECS}s");
    let (proxy, provider, rpc) = proxied_provider(
        &env,
        &["--repair-interval", "500ms", "--mark-grace-period", &grace],
    )
    .await;
    let id = capi.id(Kind::MachineDeployment, "md");
    let second = Duration::from_secs(1);
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
    // The client of m9 calls once and gives up (CA moves on). Its mark is the first request the
    // stall holds; the proxy delivers it after the provider has given up on it.
    let given_up = {
        let rpc = rpc.clone();
        let id = id.clone();
        let node = capi.grpc_node("m9");
        tokio::spawn(async move { delete_nodes(&rpc, &id, vec![node], second).await })
    };
    proxy
        .wait_held_request(Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The clients of m0 and m1 call again each time their deadline passes, until the API is back.
    let until = stalled_at + stall;
    let mut clients = tokio::task::JoinSet::new();
    for machine in ["m0", "m1"] {
        let rpc = rpc.clone();
        let id = id.clone();
        let node = capi.grpc_node(machine);
        clients.spawn(async move {
            let mut codes = Vec::new();
            while Instant::now() < until {
                codes.push(code_of(
                    &delete_nodes(&rpc, &id, vec![node.clone()], second).await,
                ));
            }
            (machine, codes)
        });
    }
    let mut during: Vec<(&str, Vec<Code>)> = Vec::new();
    while let Some(joined) = clients.join_next().await {
        during.push(joined.expect("a client task"));
    }
    during.push(("m9", vec![code_of(&given_up.await.expect("m9's client"))]));
    // The stall lasts as long as the scenario says (the clients above ran until then).
    tokio::time::sleep_until(until.into()).await;
    let before_resume = view(capi, Kind::MachineDeployment, "md").await;
    proxy.resume();
    let resumed_at = Instant::now();
    for (machine, codes) in &during {
        assert!(
            !codes.is_empty() && codes.iter().all(|c| *c != Code::Ok),
            "{machine}: no call can succeed while the API is stalled: {codes:?}"
        );
    }
    assert_eq!(
        before_resume.replicas,
        INITIAL,
        "nothing reached the API during the stall: {}",
        before_resume.describe()
    );

    // CA retries m0 and m1 with its usual deadline (10 s in our cloud-config).
    for machine in ["m0", "m1"] {
        delete_nodes(
            &rpc,
            &id,
            vec![capi.grpc_node(machine)],
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "DeleteNodes({machine}) after the stall: {e}\n{}",
                provider.log_contents()
            )
        });
    }
    delete_nodes(
        &rpc,
        &id,
        vec![capi.grpc_node("probe")],
        Duration::from_secs(60),
    )
    .await
    .expect("the probe after every queued operation");
    let settled = view(capi, Kind::MachineDeployment, "md").await;
    let late_mark = settled.marked().contains("m9");

    // Once the grace period and a repair interval have passed, the marks are exactly the removals
    // replicas pay for.
    let exact = |v: &GroupView| {
        v.marked().len() as i64 == INITIAL - v.replicas && v.unpaid() == 0 && v.within_bounds()
    };
    let final_view = wait_view(
        capi,
        Kind::MachineDeployment,
        "md",
        "marked and not deleting == initial − replicas",
        Duration::from_secs(GRACE_SECS + 15),
        exact,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    let held_for = resumed_at.elapsed();
    // And it stays so over further repair rounds.
    for _ in 0..6 {
        let v = view(capi, Kind::MachineDeployment, "md").await;
        assert!(exact(&v), "the invariant broke again: {}", v.describe());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // CA got OK for m0 and m1: both are removed. m9's accepted operation may have been completed
    // by the provider (operations run to completion; a mark that landed is owed its decrement, and
    // a retry of the group pays it) or its mark taken back by the repair; either way, counted.
    let marked = final_view.marked();
    assert!(
        marked.is_superset(&ids(&["m0", "m1"])) && marked.is_subset(&ids(&["m0", "m1", "m9"])),
        "{}",
        final_view.describe()
    );
    let m9_removed = marked.contains("m9");
    if late_mark && !m9_removed {
        let reasons: Vec<String> = capi
            .events_about("m9")
            .await
            .into_iter()
            .filter_map(|e| e.reason)
            .collect();
        assert!(
            reasons.iter().any(|r| r == "DeleteMarkRepaired"),
            "m9's late mark was taken back with an Event: {reasons:?}"
        );
    }
    announce(&format!(
        "faults: deadline cancellation: stall {:.1}s, calls during it {:?}, m9's mark delivered late: {late_mark}, \
         m9 removed: {m9_removed}; marks == initial − replicas ({} − {}) {:.1}s after the resume, and stable; \
         passed in {:.1}s",
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
}

/// A write the provider gave up on is delivered late. Every request shares the provider's one
/// HTTP/2 connection, so the network holds it with the write: the proxy holds that connection's
/// requests from the write on. The provider's ping goes unanswered, it gives the connection up,
/// reads the group again on a new one and finishes the operation there; only then is the held write
/// delivered, as through a load balancer that forwards a request whose client has gone. The change
/// must not be applied twice: one DeleteNodes lowers replicas by exactly one, one IncreaseSize(+1)
/// raises them by exactly one, and the late write is refused (409: the version it names is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_delivered_after_the_provider_gave_up_on_it_is_not_applied_twice() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let env = env().await;
    let capi = &env.capi;
    let admin = env.cp.admin_client().await;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 10).replicas(3), false)
        .await;
    for i in 0..3 {
        capi.create_machine(&capi.running(&format!("m{i}"), md.clone()))
            .await;
    }
    let mut history = History::start(capi, Kind::MachineDeployment).await;
    // A held connection is given up within about 2 s: before the provider's 4 s call timeout.
    let (proxy, provider, rpc) = proxied_provider(
        &env,
        &["--api-ping-interval", "1s", "--api-ping-timeout", "1s"],
    )
    .await;
    let id = capi.id(Kind::MachineDeployment, "md");
    // Delivers what the proxy holds once the provider has answered, and waits until the apiserver
    // has refused it.
    let deliver_late = |what: &'static str| {
        let (admin, proxy, provider) = (&admin, &proxy, &provider);
        async move {
            assert!(
                proxy.holding(),
                "{what}: held until the provider answered\n{}",
                provider.log_contents()
            );
            let before = refused_deployment_patches(admin).await;
            proxy.resume();
            poll_until(
                &format!("{what} delivered late and refused"),
                Duration::from_secs(30),
                Duration::from_millis(50),
                || async {
                    match refused_deployment_patches(admin).await {
                        n if n > before => Check::Done(()),
                        n => Check::Wait(format!("{n} refused MachineDeployment patches")),
                    }
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
    };

    // DeleteNodes: the group read, its Machines listed and the mark answered; the decrement that
    // follows is held.
    proxy.hold_after_answers(3);
    let removal = delete_nodes(
        &rpc,
        &id,
        vec![capi.grpc_node("m0")],
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(
        code_of(&removal),
        Code::Ok,
        "DeleteNodes finishes on a new connection\n{}",
        provider.log_contents()
    );
    deliver_late("the scale-down's decrement").await;
    drain_group(&rpc, &id).await;
    let after_removal = view(capi, Kind::MachineDeployment, "md").await;
    assert_eq!(
        (after_removal.replicas, after_removal.marked()),
        (2, ids(&["m0"])),
        "one DeleteNodes, one decrement: {}\n{}",
        after_removal.describe(),
        provider.log_contents()
    );

    // IncreaseSize: its write is held.
    proxy.hold_next_request();
    let increase = increase_size(&rpc, &id, 1, Duration::from_secs(10)).await;
    assert_eq!(
        code_of(&increase),
        Code::Ok,
        "IncreaseSize finishes on a new connection\n{}",
        provider.log_contents()
    );
    deliver_late("the scale-up's write").await;
    drain_group(&rpc, &id).await;
    let after_increase = view(capi, Kind::MachineDeployment, "md").await;
    assert_eq!(
        after_increase.replicas,
        3,
        "one IncreaseSize(+1), one increment: {}\n{}",
        after_increase.describe(),
        provider.log_contents()
    );
    let versions = history
        .check_new()
        .unwrap_or_else(|e| panic!("invariant 2: {e}"));
    announce(&format!(
        "faults: writes delivered after the provider gave up on their connection: DeleteNodes → replicas 3 → 2, \
         IncreaseSize(+1) → 2 → 3, both late writes refused (409); {versions} versions within bounds; passed in {:.1}s",
        started.elapsed().as_secs_f64()
    ));
}

/// How many MachineDeployment patches the apiserver has refused with 409 Conflict.
async fn refused_deployment_patches(admin: &kube::Client) -> f64 {
    request_counts(admin)
        .await
        .iter()
        .filter(|(series, _)| {
            label_of(series, "verb") == Some("PATCH")
                && label_of(series, "resource") == Some("machinedeployments")
                && label_of(series, "code") == Some("409")
        })
        .map(|(_, n)| n)
        .sum()
}

/// The provider SIGKILLed between its two writes, at a controlled point: the proxy holds the
/// apiserver's answers, so the mark reaches the API while the provider never learns it did and
/// cannot have sent the decrement; the test kills it as soon as it sees the mark in the API.
/// Restarted: the node CA retries is paid once (and only once); the node nobody retries has its mark
/// taken back within one repair interval after the grace period (and not before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_killed_between_mark_and_decrement_is_paid_or_repaired_after_restart() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    const GRACE_SECS: u64 = 4;
    const INTERVAL: Duration = Duration::from_millis(500);
    let env = env().await;
    let capi = &env.capi;
    for group in ["a", "b"] {
        let owner = Owner::Deployment(group.into());
        capi.create_deployment(&Scalable::md(group).bounds(0, 5).replicas(3), false)
            .await;
        for i in 0..3 {
            capi.create_machine(&capi.running(&format!("{group}{i}"), owner.clone()))
                .await;
        }
    }
    let (a, b) = (
        capi.id(Kind::MachineDeployment, "a"),
        capi.id(Kind::MachineDeployment, "b"),
    );
    // One provider per mark: a held answer also holds the TLS handshake of any new connection, so
    // each provider gets exactly one removal through (on a connection it already has).
    let mut killed_at = Instant::now();
    for (id, group, machine) in [(&a, "a", "a0"), (&b, "b", "b0")] {
        killed_at = kill_between_mark_and_decrement(&env, id, group, machine).await;
    }
    let (second, rpc) = provider(
        &env,
        env.cp.admin_kubeconfig(),
        &[
            "--repair-interval",
            "500ms",
            "--mark-grace-period",
            &format!("{GRACE_SECS}s"),
        ],
    )
    .await;
    let restarted_in = killed_at.elapsed();
    // CA retries b0 at once (well within the grace period): the decrement the mark is owed, once.
    for attempt in ["retry", "second retry"] {
        delete_nodes(
            &rpc,
            &b,
            vec![capi.grpc_node("b0")],
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("DeleteNodes(b0), {attempt}: {e}"));
        let v = view(capi, Kind::MachineDeployment, "b").await;
        assert_eq!(
            (v.replicas, v.marked()),
            (2, ids(&["b0"])),
            "{attempt}: {}",
            v.describe()
        );
    }
    // Nobody retries a0: the repair takes its mark back once it is older than the grace period.
    let mark = view(capi, Kind::MachineDeployment, "a")
        .await
        .machines
        .into_iter()
        .find(|m| m.name == "a0")
        .and_then(|m| m.mark)
        .expect("a0 is still marked after the restart");
    let marked_at = our_mark_time(&mark).expect("a mark of ours carries its time");
    let repaired = wait_view(
        capi,
        Kind::MachineDeployment,
        "a",
        "a0's mark taken back",
        Duration::from_secs(GRACE_SECS + 20),
        |v| v.marked().is_empty(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", second.log_contents()));
    let repaired_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    assert_eq!(repaired.replicas, 3, "{}", repaired.describe());
    // The mark's time has whole seconds: it was written in [marked_at, marked_at + 1).
    let eligible = marked_at as f64 + GRACE_SECS as f64;
    assert!(
        repaired_at >= eligible - 0.2,
        "taken back {:.1}s before the grace period ended",
        eligible - repaired_at
    );
    let late = repaired_at - (eligible + 1.0);
    assert!(
        late <= INTERVAL.as_secs_f64() + 1.0,
        "taken back {late:.1}s after the grace period ended: more than a repair interval (+1 s for the unmark and the polling)"
    );
    let reasons: Vec<String> = capi
        .events_about("a0")
        .await
        .into_iter()
        .filter_map(|e| e.reason)
        .collect();
    assert!(
        reasons.iter().any(|r| r == "DeleteMarkRepaired"),
        "{reasons:?}"
    );
    // b0's paid mark is past its grace period too and stays.
    for _ in 0..4 {
        let v = view(capi, Kind::MachineDeployment, "b").await;
        assert_eq!(
            (v.replicas, v.marked(), v.unpaid()),
            (2, ids(&["b0"]), 0),
            "{}",
            v.describe()
        );
        tokio::time::sleep(INTERVAL).await;
    }
    announce(&format!(
        "faults: provider SIGKILLed between mark and decrement: restarted and serving in {:.1}s; \
         retried node paid once; orphan mark taken back {:.1}s after its grace period ended \
         (repair interval {:.1}s); passed in {:.1}s",
        restarted_in.as_secs_f64(),
        (repaired_at - eligible).max(0.0),
        INTERVAL.as_secs_f64(),
        started.elapsed().as_secs_f64()
    ));
}

/// Starts a provider behind a [`StallProxy`], holds the apiserver's answers, calls
/// DeleteNodes(`machine`) and SIGKILLs the provider as soon as the mark is in the API; checks that
/// the decrement never happened. Returns when the provider was killed.
async fn kill_between_mark_and_decrement(
    env: &Env,
    id: &str,
    group: &str,
    machine: &str,
) -> Instant {
    let capi = &env.capi;
    let (proxy, provider, rpc) = proxied_provider(env, &[]).await;
    // The provider reads the group and lists its Machines before it marks: those answers pass.
    proxy.hold_answers_after(2);
    let call = {
        let rpc = rpc.clone();
        let id = id.to_string();
        let node = capi.grpc_node(machine);
        tokio::spawn(
            async move { delete_nodes(&rpc, &id, vec![node], Duration::from_secs(30)).await },
        )
    };
    wait_view(
        capi,
        Kind::MachineDeployment,
        group,
        &format!("{machine}'s mark in the API"),
        Duration::from_secs(10),
        |v| v.marked().contains(machine),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", provider.log_contents()));
    drop(provider); // SIGKILL
    let killed_at = Instant::now();
    assert_eq!(
        capi.replicas(Kind::MachineDeployment, group).await,
        3,
        "{group}: killed between mark and decrement: the decrement was never sent"
    );
    let result = call.await.expect("the DeleteNodes task");
    assert!(
        result.is_err(),
        "a DeleteNodes whose provider died before any answer reached it cannot have answered OK"
    );
    drop(proxy);
    killed_at
}

// ---------------------------------------------------------------------------------------------------
// The kube-apiserver killed and stopped under a workload.

/// What the CA-like clients of the apiserver test did.
#[derive(Default)]
struct Workload {
    codes: Vec<(&'static str, Code)>,
    ok_since_mark: usize,
}

/// One CA-like client of one group: IncreaseSize(+1 or +2), DeleteNodes of one Running node (now
/// and then again for a node it removed before, as CA retries), with CA's 10 s deadline, until
/// `stop`. No DecreaseTargetSize: every Machine the reconciler then deletes must carry a mark.
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
            let running: Vec<String> = match instances {
                Ok(Ok(r)) => r
                    .into_inner()
                    .instances
                    .into_iter()
                    .filter(|i| i.id.starts_with("e2e:///"))
                    .map(|i| i.id)
                    .collect(),
                _ => Vec::new(),
            };
            if running.is_empty() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let provider_id = running[rng.random_range(0..running.len())].clone();
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
        }
        // CA acts once per loop (10 s by default); faster here, but slow enough for the reconciler
        // (100 ms passes) to act on most removals before the next scale-up.
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..400))).await;
    }
}

/// Waits (at most `timeout`) until the clients have had `n` more successful operations.
async fn wait_progress(log: &std::sync::Mutex<Workload>, n: usize, what: &str, timeout: Duration) {
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
    .unwrap_or_else(|e| panic!("{e}"));
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

/// The kube-apiserver SIGKILLed and restarted (same port, same etcd), then SIGSTOPped for 30 s, while
/// CA-like clients scale three MachineDeployments and the test reconciler plays Cluster API.
/// Afterwards: every version of every group the watch delivered (it resumes from its last
/// resourceVersion, so versions written around the faults are included) has replicas within that
/// version's bounds; once operations are drained, the reconciler has converged and the grace period
/// and a repair interval have passed, no Machine carries an unpaid mark of ours; and every Machine the
/// reconciler deleted carried our mark (no decrement without its mark: the clients never call
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
    let env = env().await;
    let capi = &env.capi;
    let reconciler = Reconciler::start_with(
        capi.client.clone(),
        &capi.ns,
        ReconcilerConfig::default().interval(Duration::from_millis(100)),
    );
    for group in GROUPS {
        capi.create(&Scalable::md(group).bounds(1, 6).replicas(2))
            .await;
    }
    for group in GROUPS {
        wait_view(
            capi,
            Kind::MachineDeployment,
            group,
            "the reconciler made the Machines",
            Duration::from_secs(30),
            |v| v.active() == 2,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}; reconciler errors {:?}", reconciler.errors()));
    }
    let grace = format!("{GRACE_SECS}s");
    let (provider, rpc) = provider(
        &env,
        env.cp.admin_kubeconfig(),
        &["--repair-interval", "500ms", "--mark-grace-period", &grace],
    )
    .await;
    let mut apiserver = ApiServer::of(env.cp);

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
        &log,
        15,
        "scale operations under way",
        Duration::from_secs(60),
    )
    .await;

    let ops_before_kill = ops.load(Ordering::SeqCst);
    let restart = apiserver.kill_and_restart().await;
    wait_progress(
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

    // Converged and repaired: the reconciler made replicas Machines, and no mark of ours is unpaid.
    let mut finals = BTreeMap::new();
    for group in GROUPS {
        let v = wait_view(
            capi,
            Kind::MachineDeployment,
            group,
            "converged, no unpaid mark of ours",
            Duration::from_secs(GRACE_SECS + 30),
            |v| v.active() as i64 == v.replicas && v.unpaid() == 0,
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{group}: {e}\nreconciler errors {:?}\n{}",
                reconciler.errors(),
                provider.log_contents()
            )
        });
        assert!(v.within_bounds(), "{group}: {}", v.describe());
        finals.insert(group, v.replicas);
    }
    let settled_in = workload_done.elapsed();
    // Every version etcd stored (a watch through the restarted apiserver cannot resume from before
    // the restart: its watch cache starts afresh).
    let etcd = apiserver.etcd_url();
    let mut versions = 0;
    for group in GROUPS {
        let all = etcd_versions(
            &etcd,
            CAPI_GROUP,
            "machinedeployments",
            &capi.ns,
            group,
            &capi.min_key(),
            &capi.max_key(),
        )
        .await
        .unwrap_or_else(|e| panic!("{group}'s versions from etcd: {e}"));
        let violations = bound_violations(&all);
        assert!(
            violations.is_empty(),
            "invariant 2 for {group}:\n{}",
            violations.join("\n")
        );
        versions += all.len();
    }
    let unmarked_deletions: Vec<String> = reconciler
        .actions()
        .into_iter()
        .filter(|a| {
            a.starts_with("deleted Machine ") && !a.ends_with("(delete-machine annotation)")
        })
        .collect();
    assert!(
        unmarked_deletions.is_empty(),
        "invariant 3: replicas dropped without a mark (Cluster API removed unmarked Machines): {unmarked_deletions:?}"
    );
    let marked_deletions = reconciler.deleted_marked().len();
    let codes = log.lock().unwrap_or_else(|e| e.into_inner()).codes.clone();
    let mut by_op: BTreeMap<&str, Vec<Code>> = BTreeMap::new();
    for (op, code) in &codes {
        by_op.entry(op).or_default().push(*code);
    }
    for (op, codes) in &by_op {
        for code in codes {
            assert!(
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
                "{op}: unexpected {code:?}"
            );
        }
    }
    announce(&format!(
        "faults: kube-apiserver SIGKILL + restart ({:.1}s to ready) after {ops_before_kill} operations, \
         SIGSTOP {}s ({ops_during_stop} operations answered meanwhile); {} operations in all {:?}; \
         {versions} versions within bounds; {marked_deletions} Machines deleted for their mark, none unmarked; \
         final replicas {finals:?}; settled {:.1}s after the workload; passed in {:.1}s",
        restart.as_secs_f64(),
        STOP.as_secs(),
        codes.len(),
        by_op
            .iter()
            .map(|(op, c)| format!("{op}: {:?}", tally(c)))
            .collect::<Vec<_>>(),
        settled_in.as_secs_f64(),
        started.elapsed().as_secs_f64()
    ));
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
/// can) while the provider's requests take 25 ms to arrive, so every write the provider computes is
/// stale by the time it lands: 409 on every attempt. Each DeleteNodes and IncreaseSize answers OK
/// or ABORTED, within a bounded time and after at most MAX_ATTEMPTS conflicts; after every call the
/// marks are exactly `initial − replicas` (an aborted removal takes its mark back); no version is
/// outside the bounds. With the writer gone, CA's retries succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_on_every_attempt_end_in_ok_or_aborted_without_unpaid_marks() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    const INITIAL: i64 = 4;
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(1, 8).replicas(INITIAL), false)
        .await;
    for i in 0..INITIAL {
        capi.create_machine(&capi.running(&format!("m{i}"), md.clone()))
            .await;
    }
    let mut history = History::start(capi, Kind::MachineDeployment).await;
    let (proxy, provider, rpc) = proxied_provider(&env, &[]).await;
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
    .unwrap_or_else(|e| panic!("{e}"));

    let mut outcomes: Vec<(String, Code, f64, Duration)> = Vec::new();
    let mut aborted_nodes = Vec::new();
    // Removals first (the marks must match replicas exactly after each), then scale-ups.
    for machine in ["m0", "m1", "m2"] {
        let before = view(capi, Kind::MachineDeployment, "md").await;
        let c0 = conflicts().await;
        let t = Instant::now();
        let result = delete_nodes(
            &rpc,
            &id,
            vec![capi.grpc_node(machine)],
            Duration::from_secs(60),
        )
        .await;
        let took = t.elapsed();
        let code = code_of(&result);
        let after = view(capi, Kind::MachineDeployment, "md").await;
        assert!(
            matches!(code, Code::Ok | Code::Aborted),
            "DeleteNodes({machine}) under conflicts: {result:?}"
        );
        assert_eq!(
            after.marked().len() as i64,
            INITIAL - after.replicas,
            "DeleteNodes({machine}) → {code:?}: marks and replicas disagree: {}",
            after.describe()
        );
        match code {
            Code::Ok => assert_eq!(after.replicas, before.replicas - 1),
            _ => {
                assert_eq!(after.replicas, before.replicas, "aborted: no decrement");
                assert!(
                    !after.marked().contains(machine),
                    "aborted: the mark is taken back"
                );
                aborted_nodes.push(machine);
            }
        }
        outcomes.push((
            format!("DeleteNodes({machine})"),
            code,
            conflicts().await - c0,
            took,
        ));
    }
    for _ in 0..3 {
        let before = view(capi, Kind::MachineDeployment, "md").await;
        let c0 = conflicts().await;
        let t = Instant::now();
        let result = increase_size(&rpc, &id, 1, Duration::from_secs(60)).await;
        let took = t.elapsed();
        let code = code_of(&result);
        assert!(
            matches!(code, Code::Ok | Code::Aborted),
            "IncreaseSize(1) under conflicts: {result:?}"
        );
        let after = view(capi, Kind::MachineDeployment, "md").await;
        let grew = if code == Code::Ok { 1 } else { 0 };
        assert_eq!(after.replicas, before.replicas + grew, "{code:?}");
        outcomes.push(("IncreaseSize(1)".into(), code, conflicts().await - c0, took));
    }
    let writes = poker.writes();
    poker.stop().await;
    for (what, code, conflicts, took) in &outcomes {
        assert!(
            *conflicts <= PROVIDER_MAX_ATTEMPTS,
            "{what}: {conflicts} conflicts for one call (bounded attempts)"
        );
        assert!(
            *took < Duration::from_secs(30),
            "{what}: answered {code:?} after {took:?}"
        );
    }
    let aborted = outcomes.iter().filter(|o| o.1 == Code::Aborted).count();
    assert!(
        aborted > 0,
        "the concurrent writer ({writes} writes) never forced ABORTED: the test did not exercise conflicts on every attempt: {outcomes:?}"
    );

    // The writer is gone: CA's retries of the aborted removals succeed.
    proxy.delay_requests(Duration::ZERO);
    for machine in &aborted_nodes {
        delete_nodes(
            &rpc,
            &id,
            vec![capi.grpc_node(machine)],
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("DeleteNodes({machine}) retried without conflicts: {e}"));
    }
    let last = view(capi, Kind::MachineDeployment, "md").await;
    assert_eq!(
        last.marked(),
        ids(&["m0", "m1", "m2"]),
        "{}",
        last.describe()
    );
    let versions = history
        .check_new()
        .unwrap_or_else(|e| panic!("invariant 2: {e}"));
    announce(&format!(
        "faults: 409 on every attempt ({writes} concurrent writes, requests delayed 25 ms): {:?}; \
         {versions} versions within bounds; passed in {:.1}s",
        outcomes
            .iter()
            .map(|(w, c, n, t)| format!("{w} {c:?} after {n} conflicts in {:.2}s", t.as_secs_f64()))
            .collect::<Vec<_>>(),
        started.elapsed().as_secs_f64()
    ));
}

/// Bounds lowered while IncreaseSize is under way. First deterministic: the provider's write is held
/// in the network while max drops from 10 to 3, so it lands on an older version, conflicts, and the
/// provider re-reads and refuses (FAILED_PRECONDITION) rather than writing 7. Then raced: a writer
/// flips max between 4 and 10 as fast as it can while IncreaseSize(+1) is called repeatedly; every
/// replica write in the object's history lies within the max of the version it was written over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_lowered_during_increase_size_are_those_of_the_version_written_over() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let env = env().await;
    let capi = &env.capi;
    let md = Owner::Deployment("md".into());
    capi.create_deployment(&Scalable::md("md").bounds(0, 10).replicas(2), false)
        .await;
    for i in 0..2 {
        capi.create_machine(&capi.running(&format!("m{i}"), md.clone()))
            .await;
    }
    let mut history = History::start(capi, Kind::MachineDeployment).await;
    let (proxy, provider, rpc) = proxied_provider(&env, &[]).await;
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
    proxy.hold_requests();
    let call = {
        let rpc = rpc.clone();
        let id = id.clone();
        tokio::spawn(async move { increase_size(&rpc, &id, 5, Duration::from_secs(30)).await })
    };
    proxy
        .wait_held_request(Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    set_max(3).await;
    proxy.resume();
    let result = call.await.expect("the IncreaseSize task");
    let message = expect_code(
        "IncreaseSize(5) written over a version whose max is 3",
        result,
        Code::FailedPrecondition,
    );
    assert_eq!(capi.replicas(Kind::MachineDeployment, "md").await, 2);
    let conflicts = provider_metric(
        &provider.metrics_address,
        &series("increase-size", "conflict"),
    )
    .await
        - conflicts_before;
    assert!(
        conflicts >= 1.0,
        "the held write conflicted with the lowered max ({message})"
    );

    // Raced: max flips between 4 and 10 as fast as a writer can.
    set_max(10).await;
    let stop = Arc::new(AtomicBool::new(false));
    let flips = Arc::new(AtomicU64::new(0));
    let flipper = {
        let api = capi.api(Kind::MachineDeployment);
        let (stop, flips, key) = (Arc::clone(&stop), Arc::clone(&flips), capi.max_key());
        tokio::spawn(async move {
            let mut max = 4;
            while !stop.load(Ordering::SeqCst) {
                let patch = json!({"metadata": {"annotations": {key.as_str(): max.to_string()}}});
                if api
                    .patch("md", &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .is_ok()
                {
                    flips.fetch_add(1, Ordering::SeqCst);
                    max = if max == 4 { 10 } else { 4 };
                }
            }
        })
    };
    let mut codes = Vec::new();
    for _ in 0..40 {
        codes.push(code_of(
            &increase_size(&rpc, &id, 1, Duration::from_secs(30)).await,
        ));
    }
    stop.store(true, Ordering::SeqCst);
    flipper.await.expect("the flipper");
    for code in &codes {
        assert!(
            matches!(code, Code::Ok | Code::FailedPrecondition | Code::Aborted),
            "IncreaseSize(1) while max flips: {code:?}"
        );
    }
    let versions = history.check_new().unwrap_or_else(|e| {
        panic!(
            "invariant 2: replicas written above the max of the version written over:\n{e}\n{}",
            provider.log_contents()
        )
    });
    let final_replicas = capi.replicas(Kind::MachineDeployment, "md").await;
    assert!(
        codes.contains(&Code::Ok),
        "some IncreaseSize landed: {codes:?}"
    );
    announce(&format!(
        "faults: bounds lowered during IncreaseSize: held write refused after {conflicts} conflict(s) ({message}); \
         raced against {} max flips: {:?}, replicas 2 → {final_replicas}, {versions} versions each within \
         its own bounds; passed in {:.1}s",
        flips.load(Ordering::SeqCst),
        tally(&codes),
        started.elapsed().as_secs_f64()
    ));
}

// ---------------------------------------------------------------------------------------------------
// MachinePool removals across restarts and spellings.

/// A MachinePool node without a Machine: DeleteNodes lowers replicas once and records the node in
/// the pool's ledger annotation. The provider is SIGKILLed and restarted; CA retries the node with a
/// differently spelled providerID (`aws:////i-1` for `aws:///zone/i-1`) and then as before: replicas
/// do not drop again. Another node still decrements once, and its retry in the other spelling not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_pool_retry_across_a_restart_and_spellings_decrements_once() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let env = env().await;
    let capi = &env.capi;
    let listed: Vec<String> = (1..=3).map(|i| format!("aws:///zone/i-{i}")).collect();
    capi.create(
        &Scalable::mp("pool")
            .bounds(0, 5)
            .replicas(3)
            .provider_ids(&listed),
    )
    .await;
    let id = capi.id(Kind::MachinePool, "pool");
    let node = |provider_id: &str| grpc_node(provider_id, "ip-10-0-0-1");
    let replicas = || capi.replicas(Kind::MachinePool, "pool");

    let (first, rpc) = provider(&env, env.cp.admin_kubeconfig(), &[]).await;
    delete_nodes(
        &rpc,
        &id,
        vec![node("aws:///zone/i-1")],
        Duration::from_secs(10),
    )
    .await
    .expect("DeleteNodes(aws:///zone/i-1)");
    assert_eq!(replicas().await, 2);
    let ledger = view(capi, Kind::MachinePool, "pool").await.ledger;
    assert_eq!(
        ledger.len(),
        1,
        "the removal is recorded on the pool ({LEDGER_ANNOTATION}): {ledger:?}"
    );
    drop(first); // SIGKILL: nothing in memory survives

    let (_second, rpc) = provider(&env, env.cp.admin_kubeconfig(), &[]).await;
    for spelling in ["aws:////i-1", "aws:///zone/i-1", "i-1"] {
        delete_nodes(&rpc, &id, vec![node(spelling)], Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("DeleteNodes({spelling}) after the restart: {e}"));
        assert_eq!(
            replicas().await,
            2,
            "DeleteNodes({spelling}) after the restart must not decrement again"
        );
    }
    delete_nodes(
        &rpc,
        &id,
        vec![node("aws:////i-2")],
        Duration::from_secs(10),
    )
    .await
    .expect("DeleteNodes(aws:////i-2)");
    assert_eq!(replicas().await, 1, "another node decrements once");
    delete_nodes(
        &rpc,
        &id,
        vec![node("aws:///zone/i-2")],
        Duration::from_secs(10),
    )
    .await
    .expect("DeleteNodes(aws:///zone/i-2)");
    assert_eq!(
        replicas().await,
        1,
        "and its retry in the other spelling not"
    );
    let ledger = view(capi, Kind::MachinePool, "pool").await.ledger;
    assert_eq!(ledger.len(), 2, "{ledger:?}");
    announce(&format!(
        "faults: MachinePool retry across a SIGKILL + restart and spellings: one decrement per node, ledger {ledger:?}; passed in {:.1}s",
        started.elapsed().as_secs_f64()
    ));
}
