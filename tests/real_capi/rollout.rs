//! Rollout-safe scale-down against the real MachineDeployment controller, through the provider's
//! RPCs (no CA: what the provider answers, and what it writes, is asserted directly). While a
//! MachineDeployment rolls out, NodeGroups and NodeGroupForNode send its min raised to its target,
//! DeleteNodes answers FAILED_PRECONDITION naming what holds the rollout open and writes nothing,
//! scale-up still works; once the rollout is over a removal is paid and CAPI deletes exactly the
//! marked Machine. The provider reads a rollout from two signals, each proved here alone where real
//! CAPI gives it: an old MachineSet that still has replicas (a template change, maxSurge 1 as CAPI's
//! webhook defaults it, the new Machines held by the stand-in cloud), and the `RollingOut`
//! condition (a rollout-paused MachineDeployment whose template changed: CAPI makes no new
//! MachineSet, but its Machines are not up to date). tests/real_capi/autoscaler.rs has the rollout
//! with the real CA (no node removed while it rolls out, scale-down after).

use crate::support;

use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};
use support::capi::{Kind, Rpc, expect_code, grpc_node};
use support::procs::{Check, poll_until};
use support::real_capi::{REVISION, machines_of, machines_with_nodes, name_of, of_deployment};
use support::real_capi_scenario::RealCapiScenario;
use support::standin;
use tonic::Code;

/// Polls NodeGroups until group `id` is served with min size `want` (changes made behind the
/// provider's back reach it through its watches).
async fn wait_min(s: &RealCapiScenario, rpc: &Rpc, id: &str, want: i32) {
    let result = poll_until(
        &format!("min size of {id} == {want}"),
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            let mut rpc = rpc.clone();
            async move {
                match rpc.group(id).await {
                    Some(g) if g.min_size == want => Check::Done(()),
                    Some(g) => Check::Wait(format!("min size {}", g.min_size)),
                    None => Check::Wait("not served".into()),
                }
            }
        },
    )
    .await;
    if let Err(e) = result {
        s.fail(&e);
    }
}

/// Waits until `check` holds of the MachineDeployment `md` object; returns what it found.
async fn wait_md<T>(
    s: &RealCapiScenario,
    what: &str,
    md: &str,
    check: impl Fn(&Value) -> Result<T, String>,
) -> T {
    let api = s.capi.api(Kind::MachineDeployment);
    let result = poll_until(
        what,
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async {
            match api.get(md).await {
                Ok(o) => match check(&o.data) {
                    Ok(t) => Check::Done(t),
                    Err(why) => Check::Wait(why),
                },
                Err(e) => Check::Wait(e.to_string()),
            }
        },
    )
    .await;
    result.unwrap_or_else(|e| s.fail(&e))
}

/// The MachineDeployment's `RollingOut` condition status (`None` while CAPI has not set it).
fn rolling_out(md: &Value) -> Option<String> {
    md["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "RollingOut")
        .and_then(|c| c["status"].as_str())
        .map(String::from)
}

/// The MachineSets of MachineDeployment `md`: (name, revision, spec.replicas).
async fn machine_sets(
    s: &RealCapiScenario,
    md: &str,
) -> Result<Vec<(String, String, i64)>, String> {
    let sets = of_deployment(&s.capi.api(Kind::MachineSet), md).await?;
    Ok(sets
        .iter()
        .map(|ms| {
            let revision = ms
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(REVISION))
                .cloned()
                .unwrap_or_default();
            (
                name_of(ms),
                revision,
                ms.data["spec"]["replicas"].as_i64().unwrap_or(-1),
            )
        })
        .collect())
}

/// Points MachineDeployment `md` at stand-in template `template` (with `extra` spec fields merged).
async fn set_template(s: &RealCapiScenario, md: &str, template: &str, extra: Value) {
    let mut patch = json!({"spec": {"template": {"spec": {
        "infrastructureRef": standin::reference(standin::TEMPLATE_KIND, template),
    }}}});
    if let (Some(spec), Some(extra)) = (patch["spec"].as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    s.capi
        .api(Kind::MachineDeployment)
        .patch(md, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| s.fail(&format!("point {md} at template {template}: {e}")));
}

/// The node CA sends for Machine `name` of the stand-in (its Node has the Machine's name).
fn node_of(s: &RealCapiScenario, name: &str) -> capi_autoscaler_provider::proto::ExternalGrpcNode {
    grpc_node(&standin::provider_id(&s.ns, name), name)
}

/// No Machine of `md` carries a mark, and its replicas are still `replicas`.
async fn check_nothing_written(s: &RealCapiScenario, md: &str, replicas: i64, annotations: &Value) {
    let machines = machines_of(&s.client, &s.ns, md)
        .await
        .unwrap_or_else(|e| s.fail(&e));
    s.check(
        machines.iter().all(|(_, marked)| !marked),
        &format!("a Machine was marked: {machines:?}"),
    );
    s.check(
        s.replicas(md).await == replicas,
        &format!("replicas of {md} changed from {replicas}"),
    );
    let now = s
        .capi
        .api(Kind::MachineDeployment)
        .get(md)
        .await
        .unwrap_or_else(|e| s.fail(&e.to_string()));
    s.check(
        &json!(now.metadata.annotations) == annotations,
        &format!(
            "the annotations of {md} changed: {annotations} -> {:?}",
            now.metadata.annotations
        ),
    );
}

async fn annotations_of(s: &RealCapiScenario, md: &str) -> Value {
    let md = s
        .capi
        .api(Kind::MachineDeployment)
        .get(md)
        .await
        .unwrap_or_else(|e| s.fail(&e.to_string()));
    json!(md.metadata.annotations)
}

/// A template change on a group of 3 (maxSurge 1, maxUnavailable 0, the new Machines held by the
/// cloud): CAPI makes a MachineSet of revision 2 and keeps the old one at 3 replicas. The provider
/// serves min 3 (for the group and for a node of it), refuses DeleteNodes of an old and of a new
/// node naming the old MachineSet, writes nothing; IncreaseSize works and the min follows (4). The
/// cloud delivers, CAPI finishes the rollout and deletes the old MachineSet's Machines (its own,
/// unmarked): min back to 1, DeleteNodes of a new node is paid (replicas 3) and CAPI deletes
/// exactly that Machine, for its mark.
#[tokio::test]
async fn an_old_machine_set_with_replicas_pauses_scale_down_until_it_is_drained() {
    let mut s = RealCapiScenario::new("rollout-old-machine-set").await;
    s.template("v1", "2", "4Gi", false).await;
    s.template("v2", "2", "4Gi", false).await;
    s.create_md(&s.md("md", "v1", 1, 6, 3)).await;
    let old = s.wait_machines_with_nodes("md", 3).await;
    s.standin.hold("v2");
    set_template(&s, "md", "v2", json!({})).await;
    let old_set = poll_until(
        "a MachineSet of revision 2 with 1 replica beside the old one at 3",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let sets = match machine_sets(&s, "md").await {
                Ok(sets) => sets,
                Err(e) => return Check::Wait(e),
            };
            let old = sets.iter().find(|(_, r, n)| r == "1" && *n == 3);
            let new = sets.iter().find(|(_, r, n)| r == "2" && *n == 1);
            match (old, new, sets.len()) {
                (Some(old), Some(_), 2) => Check::Done(old.0.clone()),
                _ => Check::Wait(format!("MachineSets {sets:?}")),
            }
        },
    )
    .await
    .unwrap_or_else(|e| s.fail(&e));
    s.start_provider(&[]).await;
    let mut rpc = Rpc::connect(s.provider.as_ref().expect("the provider runs")).await;
    let id = s.capi.id(Kind::MachineDeployment, "md");
    let ns = s.ns.clone();

    // CA sees the group at its target: its nodes are no scale-down candidates.
    wait_min(&s, &rpc, &id, 3).await;
    let group = rpc.group(&id).await.expect("the MachineDeployment group");
    assert_eq!((group.min_size, group.max_size), (3, 6));
    let for_node = rpc.for_node(node_of(&s, &old[0])).await;
    assert_eq!((for_node.id.as_str(), for_node.min_size), (id.as_str(), 3));

    // DeleteNodes is refused, naming what holds the rollout open, and writes nothing.
    let annotations = annotations_of(&s, "md").await;
    let t = Instant::now();
    let message = expect_code(
        "DeleteNodes during the rollout",
        rpc.delete_nodes(&id, vec![node_of(&s, &old[0])]).await,
        Code::FailedPrecondition,
    );
    s.check(
        message.contains(&format!("MachineDeployment {ns}/md"))
            && message.contains(&format!("MachineSet {ns}/{old_set} still has 3 replicas")),
        &message,
    );
    check_nothing_written(&s, "md", 3, &annotations).await;

    // Scale-up is unaffected, and the min CA sees follows the target.
    if let Err(e) = rpc.increase(&id, 1).await {
        s.fail(&format!("IncreaseSize during the rollout: {e}"));
    }
    s.check(s.replicas("md").await == 4, "replicas 4 after IncreaseSize");
    wait_min(&s, &rpc, &id, 4).await;

    // The cloud delivers: CAPI finishes the rollout, the old MachineSet is drained and gone.
    s.standin.release("v2");
    let new = poll_until(
        "the rollout done: 4 Machines of the new MachineSet with Nodes, none of the old",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || async {
            match machines_with_nodes(&s.client, &s.ns, "md", 4).await {
                Check::Done(names) if names.iter().all(|m| !old.contains(m)) => Check::Done(names),
                Check::Done(names) => Check::Wait(format!("Machines {names:?}, old {old:?}")),
                other => other,
            }
        },
    )
    .await
    .map(|names| names.into_iter().collect::<Vec<String>>())
    .unwrap_or_else(|e| s.fail(&e));
    wait_min(&s, &rpc, &id, 1).await;
    let rolled = t.elapsed();
    if let Err(e) = rpc.delete_nodes(&id, vec![node_of(&s, &new[0])]).await {
        s.fail(&format!("DeleteNodes after the rollout: {e}"));
    }
    s.check(s.replicas("md").await == 3, "replicas 3 after DeleteNodes");
    s.wait_machines_with_nodes("md", 3).await;
    s.wait_deletions_done().await;
    let marked = s.deletions.marked();
    s.check(
        marked == [new[0].clone()],
        &format!(
            "CAPI deleted {marked:?} for a mark, want exactly {}",
            new[0]
        ),
    );
    let mut unmarked = s.deletions.unmarked();
    unmarked.sort();
    s.check(
        unmarked == old,
        &format!("the rollout deleted {unmarked:?} unmarked, want the old Machines {old:?}"),
    );
    support::procs::announce(&format!(
        "e2e: rollout-old-machine-set: refused while {old_set} held 3 replicas, IncreaseSize 3 -> 4 \
         served min 4; released -> rollout done and min back to 1 in {:.1}s",
        rolled.as_secs_f64()
    ));
    s.passed();
}

/// A rollout-paused MachineDeployment (`spec.paused`) whose template changes: CAPI makes no new
/// MachineSet (one MachineSet, no old revision), but its Machines are not up to date, so CAPI sets
/// `RollingOut` True. The provider serves min 3 and refuses DeleteNodes naming the condition alone,
/// writing nothing. The template changed back, CAPI sets the condition False: min back to 1,
/// DeleteNodes is paid (replicas 2) and CAPI deletes exactly the marked Machine.
#[tokio::test]
async fn the_rolling_out_condition_pauses_scale_down_while_it_is_true() {
    let mut s = RealCapiScenario::new("rollout-condition").await;
    s.template("v1", "2", "4Gi", false).await;
    s.template("v2", "2", "4Gi", false).await;
    s.create_md(&s.md("md", "v1", 1, 6, 3)).await;
    let machines = s.wait_machines_with_nodes("md", 3).await;
    set_template(&s, "md", "v2", json!({"paused": true})).await;
    let message = wait_md(
        &s,
        "CAPI sets RollingOut True",
        "md",
        |md| match rolling_out(md).as_deref() {
            Some("True") => Ok(md["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "RollingOut")
                .map(|c| c["message"].to_string())
                .unwrap_or_default()),
            other => Err(format!("RollingOut {other:?}")),
        },
    )
    .await;
    let sets = machine_sets(&s, "md").await.unwrap_or_else(|e| s.fail(&e));
    s.check(
        sets.len() == 1,
        &format!("a paused MachineDeployment got a new MachineSet: {sets:?}"),
    );
    s.start_provider(&[]).await;
    let mut rpc = Rpc::connect(s.provider.as_ref().expect("the provider runs")).await;
    let id = s.capi.id(Kind::MachineDeployment, "md");
    wait_min(&s, &rpc, &id, 3).await;

    let annotations = annotations_of(&s, "md").await;
    let refusal = expect_code(
        "DeleteNodes while RollingOut is True",
        rpc.delete_nodes(&id, vec![node_of(&s, &machines[0])]).await,
        Code::FailedPrecondition,
    );
    s.check(
        refusal.contains("condition RollingOut is True") && !refusal.contains("MachineSet"),
        &refusal,
    );
    check_nothing_written(&s, "md", 3, &annotations).await;

    let t = Instant::now();
    set_template(&s, "md", "v1", json!({})).await;
    wait_md(
        &s,
        "CAPI sets RollingOut False",
        "md",
        |md| match rolling_out(md).as_deref() {
            Some("False") => Ok(()),
            other => Err(format!("RollingOut {other:?}")),
        },
    )
    .await;
    wait_min(&s, &rpc, &id, 1).await;
    let resumed = t.elapsed();
    if let Err(e) = rpc.delete_nodes(&id, vec![node_of(&s, &machines[0])]).await {
        s.fail(&format!("DeleteNodes once RollingOut is False: {e}"));
    }
    s.check(s.replicas("md").await == 2, "replicas 2 after DeleteNodes");
    s.wait_machines_with_nodes("md", 2).await;
    s.wait_deletions_done().await;
    let deleted = s.deletions.marked();
    s.check(
        deleted == [machines[0].clone()],
        &format!("CAPI deleted {deleted:?}, want exactly {}", machines[0]),
    );
    s.check_every_deletion_marked();
    support::procs::announce(&format!(
        "e2e: rollout-condition: paused with template v2 -> RollingOut True ({message}), one \
         MachineSet, DeleteNodes refused: {refusal}; template back -> min 1 in {:.1}s",
        resumed.as_secs_f64()
    ));
    s.passed();
}
