//! Model-based randomized test of the write path against the real Cluster API v1.14.2 manager
//! (`capi_manager`, the stand-in cloud and kubelets of `standin`): cluster-autoscaler-like clients
//! issue IncreaseSize, DecreaseTargetSize and DeleteNodes (with CA's retries: a node asked for again,
//! an aborted or unanswered call repeated) against reference models, while CAPI's own controllers
//! make and delete the Machines (the MachineSet controller's default order: Machines already being
//! deleted, then those carrying `delete-machine`, then those without a node ref, then by name) and
//! the stand-in's machine pool drops its newest instances when a MachinePool shrinks; the provider's
//! repair runs every 500 ms with a 3 s grace period. After every operation the group it touched is
//! checked:
//!
//! - the model: the provider's answer is one the model allows, and replicas are exactly what that
//!   answer implies (a removal lowers them by one per node not removed before; a retry of a removed
//!   node by nothing: a removal is paid at most once per mark, and a retry of a node of a group
//!   whose paid marks a scale-up absorbed is refused, unless the repair took that node's mark back,
//!   which makes it a fresh removal; a MachinePool removal is in the pool's ledger for as long as the instance is
//!   listed);
//! - invariant 2: replicas within [min, max], now and in every version written since the last check
//!   (a watch delivers each version; after the run, every version etcd holds is checked again);
//! - invariant 3: Machines marked by us and not being deleted exceed what replicas pay for (Machines
//!   beyond replicas) by no more than the operations in flight, plus the marks younger than the grace
//!   period and a repair round, plus what the group's raises within that time absorbed (a paid
//!   mark a scale-up absorbed waits for the repair, which leaves a group alone for the grace period
//!   after any raise; CA's retry of it is refused); the repair's lag beyond that is measured (a
//!   round waits behind each group's operation in flight, seconds under this load) and bounded by
//!   [`LATE_SECS`]; after quiescence no mark of ours is left at all once Cluster API converged; and
//!   over the whole run every Machine CAPI deleted without our mark (recorded from a watch) is paid
//!   by a DecreaseTargetSize decrement of its group: no removal ever cost an unmarked Machine.
//!
//! Real Cluster API acts seconds after a write under this load (its informers, queues and the
//! MachineSet controller's one-at-a-time creations), so a pending Machine a DecreaseTargetSize
//! cancels may have registered by then; the provider pins it with our mark (paid in the ledger)
//! before the decrement, so it is still the one to go. Capacity without a Machine is never
//! cancelled by a decrement alone while Cluster API is creating Machines for it, the replacements
//! of Machines being deleted included (refused, nothing written): a Machine it creates meanwhile
//! could register here within a second or two, as fast as the MachineSet acts on a decrement, and
//! be the one its scale-down removes. A registered Machine CAPI deleted without our mark fails the
//! run. A DeleteNodes naming a Machine so pinned,
//! or one CAPI is already deleting unmarked, is answered OK without a write. A DecreaseTargetSize
//! cancels capacity without a Machine by a write of its own first, so one refused (a pending
//! Machine registered before it was marked) or unanswered after that write lowered replicas by
//! part of its delta.
//!
//! Sequential groups have one client each (the model knows the order, so it is exact); the "hot"
//! group has three concurrent clients (only the invariants are checked). `MODEL_SEED` and
//! `MODEL_OPS` override the seed (printed, so a failure can be replayed: each client's choices follow
//! from it; the interleaving with Cluster API does not) and the number of operations
//! ([`DEFAULT_OPS`]).

pub mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use capi_autoscaler_provider::proto::instance_status::InstanceState;
use capi_autoscaler_provider::proto::{
    ExternalGrpcNode, NodeGroupDecreaseTargetSizeRequest, NodeGroupDeleteNodesRequest,
    NodeGroupIncreaseSizeRequest, NodeGroupNodesRequest,
};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::json;
use support::capi::{Capi, Kind, Rpc, grpc_node};
use support::faults::{GroupView, History};
use support::procs::announce;
use support::real_capi_scenario::{Deletion, MachineDeletions, RealCapiScenario};
use support::{Check, poll_until};
use tonic::Code;

const DEFAULT_SEED: u64 = 0x2026_1123_c0ff_ee01;
/// Enough for every kind of operation and outcome many times over in every group, in a few
/// minutes with the real manager on a loaded 2-core machine.
const DEFAULT_OPS: u64 = 2_000;
/// `--mark-grace-period`: under this load a MachineSet still deleting Machines created one for a
/// raise 4.2 s after it, so 3 s let a DecreaseTargetSize cancel capacity it was about to create.
const GRACE_SECS: u64 = 10;
const REPAIR_INTERVAL: &str = "500ms";
/// A mark younger than this may be unpaid without breaking invariant 3: the grace period, a repair
/// round (1 s), and 2 s for the unmark and the mark's whole-second time. What the imitation's runs
/// kept to.
const YOUNG_SECS: u64 = GRACE_SECS + 1 + 2;
/// How late the repair may take an unpaid mark back. A round goes over every group in turn, each
/// after the operation in flight on it (the hot group's three clients queue several) and confirmed
/// from the API (the group read, the namespace's Machines listed with the full status the real
/// controllers write); against the real manager on the loaded 2-core machine, with operations
/// taking seconds (some past the provider's 4 s handler timeout), unpaid marks were seen 13 s old
/// and more. The lag each check needed is measured and reported; beyond this it fails.
const LATE_SECS: u64 = 60;
const SEQUENTIAL: usize = 6;
const HOT_CLIENTS: usize = 3;
/// Each RPC's deadline; the provider answers within its own 4 s handler timeout.
const DEADLINE: Duration = Duration::from_secs(30);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| {
            let v = v.trim();
            v.strip_prefix("0x")
                .map(|h| u64::from_str_radix(h, 16).ok())
                .unwrap_or_else(|| v.parse().ok())
        })
        .unwrap_or(default)
}

/// What every client shares.
struct Shared {
    capi: Capi,
    rpc: Rpc,
    seed: u64,
    target: u64,
    ops: AtomicU64,
    checks: AtomicU64,
    versions: AtomicU64,
    deployments: tokio::sync::Mutex<History>,
    pools: tokio::sync::Mutex<History>,
    /// In-flight weight of the hot group's operations (nodes of a DeleteNodes, |delta| of a
    /// DecreaseTargetSize), as totals started and finished.
    hot_started: AtomicI64,
    hot_finished: AtomicI64,
    /// IncreaseSize calls by group name: when each finished (drained) and by how much it may have
    /// raised replicas. A raise makes as many paid marks unpaid, and the repair leaves them for the
    /// grace period after it.
    raises: std::sync::Mutex<BTreeMap<String, Vec<(Instant, i64)>>>,
    outcomes: std::sync::Mutex<BTreeMap<String, u64>>,
    /// Every Machine deletion Cluster API began, with whether it carried a mark then.
    deletions: MachineDeletions,
    /// By group name: how far DecreaseTargetSize calls may have lowered replicas (each decrement
    /// may make Cluster API delete one unmarked Machine).
    decrements: std::sync::Mutex<BTreeMap<String, i64>>,
    /// The most seconds beyond [`YOUNG_SECS`] any check needed to explain its unpaid marks, and
    /// how many checks needed more than [`YOUNG_SECS`].
    late: AtomicU64,
    late_checks: AtomicU64,
}

impl Shared {
    fn more(&self) -> bool {
        self.ops.load(Ordering::SeqCst) < self.target
    }

    fn raised(&self, name: &str, by: i64) {
        self.raises
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_string())
            .or_default()
            .push((Instant::now(), by));
    }

    /// How many marks raises of `name` within `secs` (at most [`LATE_SECS`]) may have left unpaid.
    fn raised_within(&self, name: &str, secs: u64) -> i64 {
        let window = Duration::from_secs(secs);
        let mut raises = self.raises.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = raises.get_mut(name) else {
            return 0;
        };
        list.retain(|(at, _)| at.elapsed() < Duration::from_secs(LATE_SECS));
        list.iter()
            .filter(|(at, _)| at.elapsed() < window)
            .map(|(_, by)| by)
            .sum()
    }

    fn decremented(&self, name: &str, by: i64) {
        *self
            .decrements
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_string())
            .or_insert(0) += by;
    }

    /// Of `names` (Machines just named to DeleteNodes), how many Cluster API was deleting without
    /// our mark: capacity a DecreaseTargetSize cancelled. The provider skips such a node (it goes
    /// anyway) and pays nothing for it. The deletion watch may lag the API a moment.
    async fn deleted_unmarked(&self, capi: &Capi, name: &str, names: &[&str]) -> i64 {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let all = self.deletions.all();
            let active: BTreeSet<String> =
                match GroupView::read(capi, Kind::MachineDeployment, name).await {
                    Ok(v) => v
                        .machines
                        .into_iter()
                        .filter(|m| !m.deleting)
                        .map(|m| m.name)
                        .collect(),
                    Err(_) => BTreeSet::new(),
                };
            let mut unmarked = 0;
            let mut unknown = false;
            for n in names {
                match all.iter().find(|d| d.machine == *n) {
                    Some(d) if !d.marked => unmarked += 1,
                    Some(_) => {}
                    None if active.contains(*n) => {}
                    None => unknown = true,
                }
            }
            if !unknown || Instant::now() > deadline {
                return unmarked;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn count(&self, what: &str, code: Code) {
        self.ops.fetch_add(1, Ordering::SeqCst);
        *self
            .outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(format!("{what} {code:?}"))
            .or_insert(0) += 1;
    }

    /// Invariant 2 on every version written since the last check, for `kind`.
    async fn check_history(&self, kind: Kind) -> Result<(), String> {
        let mut history = match kind {
            Kind::MachinePool => self.pools.lock().await,
            _ => self.deployments.lock().await,
        };
        let n = history
            .check_new()
            .map_err(|e| format!("invariant 2: {e}"))?;
        self.versions.fetch_add(n as u64, Ordering::SeqCst);
        Ok(())
    }
}

fn code_of<T>(result: &Result<T, tonic::Status>) -> Code {
    match result {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

async fn increase(sh: &Shared, id: &str, delta: i32) -> Code {
    let mut client = sh.rpc.client.clone();
    let mut request = tonic::Request::new(NodeGroupIncreaseSizeRequest {
        delta,
        id: id.into(),
    });
    request.set_timeout(DEADLINE);
    code_of(&client.node_group_increase_size(request).await)
}

async fn decrease(sh: &Shared, id: &str, delta: i32) -> Code {
    let mut client = sh.rpc.client.clone();
    let mut request = tonic::Request::new(NodeGroupDecreaseTargetSizeRequest {
        delta,
        id: id.into(),
    });
    request.set_timeout(DEADLINE);
    code_of(&client.node_group_decrease_target_size(request).await)
}

async fn delete(sh: &Shared, id: &str, nodes: Vec<ExternalGrpcNode>) -> Code {
    let mut client = sh.rpc.client.clone();
    let mut request = tonic::Request::new(NodeGroupDeleteNodesRequest {
        nodes,
        id: id.into(),
    });
    request.set_timeout(DEADLINE);
    code_of(&client.node_group_delete_nodes(request).await)
}

/// The Running instances of a group, as CA sees them (providerIDs).
async fn running(sh: &Shared, id: &str) -> Vec<String> {
    let mut client = sh.rpc.client.clone();
    match client
        .node_group_nodes(NodeGroupNodesRequest { id: id.into() })
        .await
    {
        Ok(r) => r
            .into_inner()
            .instances
            .into_iter()
            .filter(|i| {
                i.status.as_ref().map(|s| s.instance_state)
                    == Some(InstanceState::InstanceRunning as i32)
            })
            .map(|i| i.id)
            .filter(|id| id.starts_with("standin:///"))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The node CA names for an instance of the stand-in (Node name = last providerID segment).
fn node_of(provider_id: &str) -> ExternalGrpcNode {
    grpc_node(
        provider_id,
        provider_id.rsplit('/').next().unwrap_or_default(),
    )
}

/// Every operation accepted for `id` before has finished when this returns: an IncreaseSize far
/// beyond max takes the group's operation lock (operations run one at a time, in arrival order) and
/// is refused without a write. Needed after an answer the handler timeout cut short (the operation
/// goes on to completion).
async fn drain(sh: &Shared, id: &str) -> Result<(), String> {
    poll_until(
        &format!("operations of {id} drained"),
        Duration::from_secs(180),
        Duration::from_millis(100),
        || async {
            match increase(sh, id, 100_000).await {
                Code::FailedPrecondition => Check::Done(()),
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
                    Check::Wait("not answered yet".into())
                }
                other => Check::Fatal(format!("the drain probe answered {other:?}")),
            }
        },
    )
    .await
}

/// Invariants 2 and 3 on `name` now; `in_flight` is the weight of operations that may be under way.
async fn check_group(
    sh: &Shared,
    kind: Kind,
    name: &str,
    in_flight: impl Fn() -> i64,
) -> Result<GroupView, String> {
    let view = GroupView::read(&sh.capi, kind, name).await?;
    let allowance = in_flight();
    sh.checks.fetch_add(1, Ordering::SeqCst);
    if !view.within_bounds() {
        return Err(format!("invariant 2: {name}: {}", view.describe()));
    }
    if kind == Kind::MachineDeployment {
        // The shortest window (from YOUNG_SECS up) within which every unpaid mark is explained.
        let explained = |secs: u64| {
            let young = view.marked().len() - view.marks_older_than(secs);
            young as i64 + sh.raised_within(name, secs) + allowance
        };
        let Some(window) = (YOUNG_SECS..=LATE_SECS).find(|s| view.unpaid() <= explained(*s)) else {
            let young = view.marked().len() - view.marks_older_than(LATE_SECS);
            let absorbed = sh.raised_within(name, LATE_SECS);
            return Err(format!(
                "invariant 3: {name}: {} unpaid marks, only {young} younger than {LATE_SECS}s, \
                 {absorbed} absorbed by raises within {LATE_SECS}s and {allowance} in flight: {}",
                view.unpaid(),
                view.describe()
            ));
        };
        sh.late.fetch_max(window - YOUNG_SECS, Ordering::SeqCst);
        if window > YOUNG_SECS {
            sh.late_checks.fetch_add(1, Ordering::SeqCst);
        }
    }
    sh.check_history(kind).await?;
    Ok(view)
}

/// What the model of a sequential group knows.
struct Model {
    kind: Kind,
    name: String,
    id: String,
    min: i64,
    max: i64,
    replicas: i64,
    /// Nodes removed by an OK DeleteNodes (providerID → a scale-up since may have absorbed the
    /// decrement). For a pool, keyed by the normalized id.
    removed: BTreeMap<String, bool>,
    /// Pending Machine creations when last looked (replicas above the Machines that exist): a
    /// removal now may cancel one of those instead of deleting its Machine, so its mark stays
    /// unpaid, like a removal a later scale-up absorbs.
    pending: bool,
    /// Removed pool instances that have left the providerIDList.
    gone: BTreeSet<String>,
    trace: Vec<String>,
}

impl Model {
    fn fail(&self, sh: &Shared, why: String) -> String {
        let last: Vec<&String> = self.trace.iter().rev().take(12).collect();
        format!(
            "seed {:#x}: {} {}: {why}\nlast operations, newest first:\n  {}",
            sh.seed,
            self.kind.as_str(),
            self.name,
            last.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        )
    }

    fn key(&self, provider_id: &str) -> String {
        match self.kind {
            Kind::MachinePool => provider_id.rsplit('/').next().unwrap_or_default().into(),
            _ => provider_id.into(),
        }
    }
}

/// One sequential client and its exact model.
async fn sequential(sh: Arc<Shared>, mut m: Model, seed: u64) -> Result<u64, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut steps = 0u64;
    while sh.more() {
        steps += 1;
        let roll = rng.random_range(0..100);
        let before = m.replicas;
        let mut raise = 0;
        // (what, code, allowed replicas after)
        let (what, code, allowed): (String, Code, BTreeSet<i64>) = if roll < 30 {
            let d = rng.random_range(1..=3);
            let mut code = increase(&sh, &m.id, d).await;
            let mut tries = 1;
            while matches!(code, Code::Aborted | Code::Unavailable) && tries < 3 {
                sh.count("IncreaseSize", code);
                code = increase(&sh, &m.id, d).await;
                tries += 1;
            }
            raise = i64::from(d) * tries;
            let fits = before + i64::from(d) <= m.max;
            let allowed = match code {
                Code::Ok if fits => BTreeSet::from([before + i64::from(d)]),
                Code::FailedPrecondition if !fits => BTreeSet::from([before]),
                Code::Aborted => BTreeSet::from([before]),
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
                    BTreeSet::from([before, before + i64::from(d)])
                }
                _ => BTreeSet::new(),
            };
            if code == Code::Ok {
                for absorbable in m.removed.values_mut() {
                    *absorbable = true;
                }
            }
            (format!("IncreaseSize({d})"), code, allowed)
        } else if roll < 45 {
            let d = -rng.random_range(1..=2);
            let mut code = decrease(&sh, &m.id, d).await;
            let mut tries = 1;
            while matches!(code, Code::Aborted | Code::Unavailable) && tries < 3 {
                sh.count("DecreaseTargetSize", code);
                code = decrease(&sh, &m.id, d).await;
                tries += 1;
            }
            let fits = before + i64::from(d) >= m.min;
            let allowed = match code {
                Code::Ok if fits => BTreeSet::from([before + i64::from(d)]),
                // Below min, or it would remove registered nodes (which the model does not track).
                Code::FailedPrecondition | Code::Aborted if !fits => BTreeSet::from([before]),
                // Capacity without a Machine is cancelled first, by a write of its own; a pending
                // Machine that got its Node before it was pinned then refuses the rest.
                Code::FailedPrecondition | Code::Aborted => {
                    (before + i64::from(d) + 1..=before).collect()
                }
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
                    (before + i64::from(d)..=before).collect()
                }
                _ => BTreeSet::new(),
            };
            (format!("DecreaseTargetSize({d})"), code, allowed)
        } else {
            // DeleteNodes: mostly nodes CA sees now; sometimes (a retry) nodes removed before, for a
            // pool now and then in another spelling of the providerID.
            let retry = roll >= 85 && !m.removed.is_empty();
            let ids: Vec<String> = if retry {
                let keys: Vec<&String> = m.removed.keys().collect();
                let key = keys[rng.random_range(0..keys.len())].clone();
                vec![match m.kind {
                    Kind::MachinePool if rng.random_bool(0.5) => format!("standin:////{key}"),
                    Kind::MachinePool => format!("standin:///{}/{key}", sh.capi.ns),
                    _ => key,
                }]
            } else {
                let mut candidates: Vec<String> = running(&sh, &m.id)
                    .await
                    .into_iter()
                    .filter(|id| {
                        let key = m.key(id);
                        !m.removed.contains_key(&key) && !m.gone.contains(&key)
                    })
                    .collect();
                if candidates.is_empty() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                let n = if rng.random_bool(0.3) { 2 } else { 1 };
                let mut chosen = Vec::new();
                while chosen.len() < n && !candidates.is_empty() {
                    chosen.push(candidates.swap_remove(rng.random_range(0..candidates.len())));
                }
                chosen
            };
            let nodes: Vec<ExternalGrpcNode> = ids.iter().map(|id| node_of(id)).collect();
            let fresh = ids
                .iter()
                .filter(|id| !m.removed.contains_key(&m.key(id)))
                .count() as i64;
            // Paid at most once per mark: a retried node is paid again only once the repair has
            // taken its mark back (a fresh removal), and the repair takes back as many paid marks
            // as scale-ups absorbed, of whichever Machines Cluster API kept: counted, not told apart.
            let repeats = ids.len() as i64 - fresh;
            let absorbed = m.removed.values().filter(|a| **a).count() as i64;
            let absorbable = repeats.min(absorbed);
            // Fresh nodes whose Machine a DecreaseTargetSize pinned (marked, paid) before this
            // call: Cluster API deletes it for that cancellation; the removal writes nothing.
            let pinned = if m.kind == Kind::MachineDeployment {
                let view = GroupView::read(&sh.capi, m.kind, &m.name).await?;
                ids.iter()
                    .filter(|id| !m.removed.contains_key(&m.key(id)))
                    .map(|id| id.rsplit('/').next().unwrap_or_default())
                    .filter(|name| {
                        view.machines
                            .iter()
                            .any(|x| x.name == *name && (x.deleting || x.mark.is_some()))
                    })
                    .count() as i64
            } else {
                0
            };
            let mut code = delete(&sh, &m.id, nodes.clone()).await;
            let mut tries = 1;
            while matches!(code, Code::Aborted | Code::Unavailable) && tries < 3 {
                sh.count("DeleteNodes", code);
                code = delete(&sh, &m.id, nodes.clone()).await;
                tries += 1;
            }
            // A MachinePool's removal is in its ledger: a retry never decrements again.
            let absorbable = if m.kind == Kind::MachinePool {
                0
            } else {
                absorbable
            };
            // A fresh node whose Machine Cluster API was already deleting for a cancellation (a
            // DecreaseTargetSize it acted on seconds later, once that Machine had registered) is
            // answered OK without a write.
            let vanished = if code == Code::Ok && m.kind == Kind::MachineDeployment {
                let names: Vec<&str> = ids
                    .iter()
                    .filter(|id| !m.removed.contains_key(&m.key(id)))
                    .map(|id| id.rsplit('/').next().unwrap_or_default())
                    .collect();
                sh.deleted_unmarked(&sh.capi, &m.name, &names).await + pinned
            } else {
                0
            };
            // A fresh node marked over a surplus someone else's decrement left (a cancellation
            // answered late, say): Cluster API deletes marked Machines first for it, so the
            // removal is credited that decrement and writes none of its own.
            let credited = if code == Code::Ok && m.kind == Kind::MachineDeployment {
                let after = GroupView::read(&sh.capi, m.kind, &m.name).await?;
                let marked = after.marked();
                let fresh_marked = ids
                    .iter()
                    .filter(|id| !m.removed.contains_key(&m.key(id)))
                    .filter(|id| marked.contains(id.rsplit('/').next().unwrap_or_default()))
                    .count() as i64;
                fresh_marked.min(after.surplus())
            } else {
                0
            };
            let all = before - fresh - absorbable..=before;
            let allowed: BTreeSet<i64> = match code {
                Code::Ok => {
                    (before - fresh - absorbable..=before - fresh + vanished + credited).collect()
                }
                Code::FailedPrecondition if before - fresh - absorbable < m.min => {
                    BTreeSet::from([before])
                }
                // The instance left the pool's list, or its Machine is gone.
                Code::FailedPrecondition | Code::NotFound if ids.len() == 1 => {
                    BTreeSet::from([before])
                }
                // Part of a multi-node call may have been done.
                Code::NotFound
                | Code::Aborted
                | Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::FailedPrecondition => all.collect(),
                _ => BTreeSet::new(),
            };
            if code == Code::Ok {
                for id in &ids {
                    m.removed.insert(m.key(id), m.pending);
                }
            } else if code != Code::FailedPrecondition || ids.len() > 1 {
                // A partial outcome: learn from the objects which nodes were removed, once an
                // operation the handler's timeout cut short has finished.
                if matches!(code, Code::DeadlineExceeded | Code::Cancelled) {
                    drain(&sh, &m.id).await?;
                }
                let view = GroupView::read(&sh.capi, m.kind, &m.name).await?;
                for id in &ids {
                    let key = m.key(id);
                    let name = id.rsplit('/').next().unwrap_or_default();
                    let done = match m.kind {
                        Kind::MachinePool => view.ledger.contains(&format!("id:{key}")),
                        _ => {
                            view.marked().contains(name)
                                || !view.machines.iter().any(|x| x.name == name)
                        }
                    };
                    if done {
                        // A node removed before this call keeps what a raise did to it since: its
                        // mark may still be the absorbed one.
                        m.removed.entry(key).or_insert(false);
                    } else if code == Code::NotFound {
                        m.removed.remove(&key);
                    }
                }
            }
            let retried = if retry { " retry" } else { "" };
            (
                format!(
                    "DeleteNodes{retried}({ids:?}; fresh {fresh}, absorbable {absorbable}, \
                     being deleted unmarked {vanished})"
                ),
                code,
                allowed,
            )
        };
        sh.count(what.split('(').next().unwrap_or_default(), code);
        if matches!(code, Code::DeadlineExceeded | Code::Cancelled) {
            drain(&sh, &m.id).await?;
        }
        if raise > 0 {
            sh.raised(&m.name, raise);
        }
        let view = check_group(&sh, m.kind, &m.name, || 0)
            .await
            .map_err(|e| m.fail(&sh, e))?;
        m.trace.push(format!(
            "{what} → {code:?}: replicas {before} → {} (model allows {allowed:?})",
            view.replicas
        ));
        if !allowed.contains(&view.replicas) {
            return Err(m.fail(
                &sh,
                format!(
                    "{what} answered {code:?}: replicas {before} → {}, the model allows {allowed:?}; {}",
                    view.replicas,
                    view.describe()
                ),
            ));
        }
        if what.starts_with("DecreaseTargetSize") && view.replicas < before {
            sh.decremented(&m.name, before - view.replicas);
        }
        m.replicas = view.replicas;
        m.pending = m.kind == Kind::MachineDeployment && (view.active() as i64) < view.replicas;
        if m.kind == Kind::MachineDeployment {
            // A Machine that is gone carries no mark a scale-up could have absorbed.
            for (id, absorbable) in m.removed.iter_mut() {
                let name = id.rsplit('/').next().unwrap_or_default();
                if !view.machines.iter().any(|x| x.name == name && !x.deleting) {
                    *absorbable = false;
                }
            }
        }
        if m.kind == Kind::MachinePool {
            // Every removal whose instance is still listed is in the ledger.
            for key in m.removed.keys() {
                let listed = view
                    .provider_ids
                    .iter()
                    .any(|id| id.rsplit('/').next() == Some(key.as_str()));
                if listed && !view.ledger.contains(&format!("id:{key}")) {
                    return Err(m.fail(
                        &sh,
                        format!(
                            "removed instance {key} is listed but not in the ledger: {}",
                            view.describe()
                        ),
                    ));
                }
            }
            // Instances that left the list are done with. The provider's cache may list one a
            // moment longer (its watch lags the read above), and naming it then is answered from
            // the ledger, which the model no longer tracks: it is not chosen again.
            let gone: Vec<String> = m
                .removed
                .keys()
                .filter(|key| {
                    !view
                        .provider_ids
                        .iter()
                        .any(|id| id.rsplit('/').next() == Some(key.as_str()))
                })
                .cloned()
                .collect();
            for key in gone {
                m.removed.remove(&key);
                m.gone.insert(key);
            }
        }
    }
    Ok(steps)
}

/// One of the hot group's concurrent clients: only the invariants are checked.
async fn hot(sh: Arc<Shared>, name: String, seed: u64) -> Result<u64, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let id = sh.capi.id(Kind::MachineDeployment, &name);
    let mut removed: Vec<String> = Vec::new();
    let mut steps = 0u64;
    while sh.more() {
        steps += 1;
        let roll = rng.random_range(0..100);
        let (what, weight, delta) = if roll < 35 {
            ("IncreaseSize", 0, rng.random_range(1..=2))
        } else if roll < 50 {
            ("DecreaseTargetSize", 1, -1)
        } else {
            ("DeleteNodes", 1, 0)
        };
        let target = if what == "DeleteNodes" {
            let retry = !removed.is_empty() && rng.random_bool(0.25);
            let target = if retry {
                Some(removed[rng.random_range(0..removed.len())].clone())
            } else {
                let candidates = running(&sh, &id).await;
                (!candidates.is_empty())
                    .then(|| candidates[rng.random_range(0..candidates.len())].clone())
            };
            match target {
                Some(t) => Some(t),
                None => continue,
            }
        } else {
            None
        };
        sh.hot_started.fetch_add(weight, Ordering::SeqCst);
        let code = match (what, &target) {
            ("IncreaseSize", _) => increase(&sh, &id, delta).await,
            ("DecreaseTargetSize", _) => decrease(&sh, &id, delta).await,
            (_, Some(node)) => {
                let code = delete(&sh, &id, vec![node_of(node)]).await;
                if code == Code::Ok {
                    removed.push(node.clone());
                }
                code
            }
            (_, None) => unreachable!("DeleteNodes always has a node"),
        };
        if matches!(code, Code::DeadlineExceeded | Code::Cancelled) {
            // The operation goes on after the handler's timeout: it is in flight until drained.
            drain(&sh, &id).await?;
        }
        if what == "IncreaseSize" {
            sh.raised(&name, i64::from(delta));
        }
        if what == "DecreaseTargetSize"
            && matches!(
                code,
                Code::Ok | Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled
            )
        {
            sh.decremented(&name, i64::from(-delta));
        }
        sh.hot_finished.fetch_add(weight, Ordering::SeqCst);
        sh.count(what, code);
        if !matches!(
            code,
            Code::Ok
                | Code::FailedPrecondition
                | Code::Aborted
                | Code::NotFound
                | Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
        ) {
            return Err(format!(
                "seed {:#x}: hot {what}: unexpected {code:?}",
                sh.seed
            ));
        }
        let finished_before = sh.hot_finished.load(Ordering::SeqCst);
        check_group(&sh, Kind::MachineDeployment, &name, || {
            sh.hot_started.load(Ordering::SeqCst) - finished_before
        })
        .await
        .map_err(|e| {
            format!(
                "seed {:#x}: hot group after {what} → {code:?}: {e}",
                sh.seed
            )
        })?;
    }
    Ok(steps)
}

/// The stand-in machine template every MachineDeployment of the model uses.
const TEMPLATE: &str = "small";

/// MachinePool `name` of [`CLUSTER`] on a stand-in machine pool of the same name, with autoscaler
/// bounds and `replicas`.
async fn create_pool(s: &RealCapiScenario, name: &str, bounds: (i64, i64), replicas: i64) {
    s.create_pool(&s.mp(name, bounds.0, bounds.1, replicas), json!({}))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_scale_operations_keep_the_model_and_invariants_2_and_3() {
    let started = Instant::now();
    let seed = env_u64("MODEL_SEED", DEFAULT_SEED);
    let target = env_u64("MODEL_OPS", DEFAULT_OPS);
    announce(&format!(
        "model: seed {seed:#x} (replay with MODEL_SEED={seed:#x}), {target} operations"
    ));
    let mut s = RealCapiScenario::new("model").await;
    s.template(TEMPLATE, "2", "4Gi", false).await;
    let capi = s.capi.clone();
    let mut rng = StdRng::seed_from_u64(seed);

    // Groups: sequential MachineDeployments with random bounds, a MachinePool, the hot one.
    let mut models = Vec::new();
    for i in 0..SEQUENTIAL {
        let name = format!("seq-{i}");
        let min = rng.random_range(0..=2);
        let max = min + rng.random_range(3..=6);
        let replicas = min + 1;
        s.create_md(&s.md(&name, TEMPLATE, min, max, replicas))
            .await;
        models.push(Model {
            kind: Kind::MachineDeployment,
            id: capi.id(Kind::MachineDeployment, &name),
            name,
            min,
            max,
            replicas,
            removed: BTreeMap::new(),
            pending: false,
            gone: BTreeSet::new(),
            trace: Vec::new(),
        });
    }
    create_pool(&s, "pool", (0, 6), 2).await;
    models.push(Model {
        kind: Kind::MachinePool,
        id: capi.id(Kind::MachinePool, "pool"),
        name: "pool".into(),
        min: 0,
        max: 6,
        replicas: 2,
        removed: BTreeMap::new(),
        pending: false,
        gone: BTreeSet::new(),
        trace: Vec::new(),
    });
    s.create_md(&s.md("hot", TEMPLATE, 1, 8, 3)).await;
    // Every group up (Machines, Nodes, CAPI's node refs; the pool's instances listed by CAPI)
    // before the clients start.
    for m in models.iter().filter(|m| m.kind == Kind::MachineDeployment) {
        s.wait_machines_with_nodes(&m.name, m.replicas as usize)
            .await;
    }
    s.wait_machines_with_nodes("hot", 3).await;
    if let Err(e) = poll_until(
        "CAPI lists the pool's 2 instances",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            match GroupView::read(&capi, Kind::MachinePool, "pool").await {
                Ok(v) if v.provider_ids.len() == 2 => Check::Done(()),
                Ok(v) => Check::Wait(v.describe()),
                Err(e) => Check::Wait(e),
            }
        },
    )
    .await
    {
        s.fail(&e);
    }
    let set_up = started.elapsed();
    let deployments = History::start(&capi, Kind::MachineDeployment).await;
    let pools = History::start(&capi, Kind::MachinePool).await;
    let grace = format!("{GRACE_SECS}s");
    s.start_provider(&[
        "--repair-interval",
        REPAIR_INTERVAL,
        "--mark-grace-period",
        &grace,
    ])
    .await;
    let rpc = Rpc::connect(s.provider.as_ref().expect("the provider runs")).await;
    let sh = Arc::new(Shared {
        capi: capi.clone(),
        rpc,
        seed,
        target,
        ops: AtomicU64::new(0),
        checks: AtomicU64::new(0),
        versions: AtomicU64::new(0),
        deployments: tokio::sync::Mutex::new(deployments),
        pools: tokio::sync::Mutex::new(pools),
        hot_started: AtomicI64::new(0),
        raises: std::sync::Mutex::new(BTreeMap::new()),
        hot_finished: AtomicI64::new(0),
        outcomes: std::sync::Mutex::new(BTreeMap::new()),
        deletions: MachineDeletions::start(&capi).await,
        decrements: std::sync::Mutex::new(BTreeMap::new()),
        late: AtomicU64::new(0),
        late_checks: AtomicU64::new(0),
    });

    let run_started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    let names: Vec<(Kind, String, i64, i64)> = models
        .iter()
        .map(|m| (m.kind, m.name.clone(), m.min, m.max))
        .collect();
    for (i, model) in models.into_iter().enumerate() {
        let sh = Arc::clone(&sh);
        let client_seed = seed.wrapping_add(1 + i as u64);
        clients.spawn(async move { sequential(sh, model, client_seed).await });
    }
    for c in 0..HOT_CLIENTS {
        let sh = Arc::clone(&sh);
        let client_seed = seed.wrapping_add(1000 + c as u64);
        clients.spawn(async move { hot(sh, "hot".into(), client_seed).await });
    }
    let mut failures = Vec::new();
    while let Some(joined) = clients.join_next().await {
        match joined {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                failures.push(e);
                // Stop the others: one failure is enough to replay.
                sh.ops.fetch_add(sh.target, Ordering::SeqCst);
            }
            Err(e) => failures.push(format!("a client panicked: {e}")),
        }
    }
    let run_took = run_started.elapsed();
    if !failures.is_empty() {
        s.fail(&failures.join("\n\n"));
    }

    // Quiescence: no operation in flight; Cluster API converges, the repair takes back whatever
    // marks a scale-up absorbed; then no mark of ours is left anywhere.
    let mut finals = BTreeMap::new();
    let groups: Vec<(Kind, String)> = names
        .iter()
        .map(|(k, n, _, _)| (*k, n.clone()))
        .chain([(Kind::MachineDeployment, "hot".to_string())])
        .collect();
    for (kind, name) in &groups {
        let v = poll_until(
            &format!("{name} converged without marks"),
            Duration::from_secs(GRACE_SECS + 90),
            Duration::from_millis(200),
            || async {
                match GroupView::read(&capi, *kind, name).await {
                    Ok(v)
                        if *kind == Kind::MachinePool
                            && v.provider_ids.len() as i64 == v.replicas =>
                    {
                        Check::Done(v)
                    }
                    Ok(v)
                        if *kind != Kind::MachinePool
                            && v.active() as i64 == v.replicas
                            && v.marked().is_empty() =>
                    {
                        Check::Done(v)
                    }
                    Ok(v) => Check::Wait(v.describe()),
                    Err(e) => Check::Wait(e),
                }
            },
        )
        .await
        .unwrap_or_else(|e| {
            s.fail(&format!(
                "seed {seed:#x}: invariant 3 after quiescence: {e}"
            ))
        });
        s.check(v.within_bounds(), &format!("{name}: {}", v.describe()));
        finals.insert(name.clone(), v.replicas);
    }

    // Invariant 2 once more over every version etcd holds.
    let etcd = support::faults::ApiServer::of(s.cp).etcd_url();
    let mut stored = 0;
    for (kind, name) in groups.clone() {
        let (versions, violations) = s.stored_bound_violations(&etcd, kind.plural(), &name).await;
        s.check(
            violations.is_empty(),
            &format!(
                "seed {seed:#x}: invariant 2 for {name}:\n{}",
                violations.join("\n")
            ),
        );
        stored += versions;
    }

    // Invariant 3 over the whole run: every Machine CAPI deleted without our mark is paid by a
    // DecreaseTargetSize decrement of its group (a cancellation); none went for a removal.
    s.wait_deletions_done().await;
    let deletions = s.deletions.all();
    let decrements = sh
        .decrements
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let mut unmarked: BTreeMap<String, Vec<&Deletion>> = BTreeMap::new();
    for d in deletions.iter().filter(|d| !d.marked) {
        let group = groups
            .iter()
            .map(|(_, g)| g)
            .find(|g| d.machine.starts_with(&format!("{g}-")))
            .cloned()
            .unwrap_or_default();
        unmarked.entry(group).or_default().push(d);
    }
    for (group, list) in &unmarked {
        let paid = decrements.get(group).copied().unwrap_or(0);
        s.check(
            list.len() as i64 <= paid,
            &format!(
                "seed {seed:#x}: invariant 3: CAPI deleted {} Machines of {group:?} without our mark, \
                 DecreaseTargetSize lowered it by {paid} only: {list:?}",
                list.len()
            ),
        );
    }
    // A DecreaseTargetSize pins the pending Machines it cancels with our mark before its
    // decrement, and cancels capacity without a Machine only once Cluster API can no longer be
    // creating Machines for a raise (--mark-grace-period after it; refused before): no Machine
    // that had registered is ever deleted without our mark.
    let registered_unmarked: Vec<&Deletion> = deletions
        .iter()
        .filter(|d| !d.marked && d.node.is_some())
        .collect();
    let registered_cancelled = registered_unmarked.len();
    let marked = deletions.iter().filter(|d| d.marked).count();
    let ops = sh.ops.load(Ordering::SeqCst);
    let checks = sh.checks.load(Ordering::SeqCst);
    s.check(ops >= target, &format!("{ops} operations, wanted {target}"));
    let errors = s.standin.errors();
    s.check(errors.is_empty(), &format!("stand-in errors: {errors:?}"));
    s.check(
        registered_unmarked.is_empty(),
        &format!(
            "seed {seed:#x}: CAPI deleted {registered_cancelled} registered Machines without our mark \
             (unmarked and registered; decrements {decrements:?}; outcomes {:?}): {registered_unmarked:?}",
            sh.outcomes.lock().unwrap_or_else(|e| e.into_inner())
        ),
    );
    announce(&format!(
        "model: seed {seed:#x}: {ops} operations by {} clients ({} sequential groups with exact models, \
         {HOT_CLIENTS} clients on one hot group) in {:.1}s against the real Cluster API manager \
         (groups up in {:.1}s); {checks} invariant checks (one after every operation; {} of them found a mark unpaid longer \
         than {YOUNG_SECS}s, by up to {}s more: the repair's lag), {} versions \
         checked as they were written, {stored} versions in etcd checked after; CAPI deleted {} \
         Machines: {marked} for our mark, {} unmarked for DecreaseTargetSize ({registered_cancelled} of \
         them had registered by the time CAPI acted; decrements {decrements:?}; watch re-lists: {}); \
         outcomes {:?}; final replicas {finals:?}; passed in {:.1}s",
        SEQUENTIAL + 1 + HOT_CLIENTS,
        SEQUENTIAL + 1,
        run_took.as_secs_f64(),
        set_up.as_secs_f64(),
        sh.late_checks.load(Ordering::SeqCst),
        sh.late.load(Ordering::SeqCst),
        sh.versions.load(Ordering::SeqCst),
        deletions.len(),
        deletions.len() - marked,
        s.deletions.gaps(),
        sh.outcomes.lock().unwrap_or_else(|e| e.into_inner()),
        started.elapsed().as_secs_f64()
    ));
    s.passed();
}
