//! How long the real Cluster API controllers may still act on a lowered replica count after a
//! raise: the figure `--mark-grace-period` must exceed. A measurement, not a timed assertion: it
//! prints min / median / max over many rounds and asserts only what every round must show (the
//! controllers caught up, no Machine went unmarked). Ignored by `make test` (a few minutes of
//! rounds); run it with
//! `cargo test --test real_capi grace_after_a_raise -- --ignored --nocapture`.

use crate::support;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kube::api::ListParams;
use support::procs::{self, Check, poll_until};
use support::real_capi::{DELETE_MACHINE, DEPLOYMENT_NAME, MACHINES, api, name_of};
use support::real_capi_namespace::RealCapiNamespace;

const ROUNDS: usize = 20;
/// Time between DeleteNodes and IncreaseSize, round by round: back to back, and with the lowered
/// count given time to reach the MachineSet controller (a deliberate interleaving, not a wait).
const GAPS_MS: [u64; 4] = [0, 250, 500, 1000];
/// How often the objects are read while waiting for the controllers to catch up.
const SAMPLE: Duration = Duration::from_millis(20);
/// The grace used while measuring: long enough that rounds whose mark the raise absorbed settle
/// without an unmarked Machine going even on a loaded machine, short enough for 20 rounds.
const GRACE: &str = "--mark-grace-period=10s";

/// What one DeleteNodes + IncreaseSize pair showed, times from the start of the IncreaseSize call.
struct Round {
    /// Milliseconds between DeleteNodes and IncreaseSize.
    gap: u64,
    /// Until the MachineDeployment controller and the MachineSet controller had both observed
    /// (status.observedGeneration) the generation carrying the raised count: from then on neither
    /// can act on the lowered one.
    caught_up: Duration,
    /// When the marked Machine was seen being deleted (the MachineSet controller acting on the
    /// lowered count), if it was; `None` when the raise absorbed the mark.
    victim_deleted: Option<f64>,
}

fn figures(mut xs: Vec<f64>) -> String {
    if xs.is_empty() {
        return "none".into();
    }
    xs.sort_by(f64::total_cmp);
    format!(
        "min {:.0} ms, median {:.0} ms, max {:.0} ms (n={})",
        xs[0] * 1000.0,
        xs[xs.len() / 2] * 1000.0,
        xs[xs.len() - 1] * 1000.0,
        xs.len()
    )
}

/// Whether the MachineDeployment `md` and every MachineSet of it observed their current generation
/// with the MachineSets' replicas adding up to the MachineDeployment's; the marked `victim`'s
/// deletion seen meanwhile is reported through `deleted`.
async fn caught_up(
    client: &kube::Client,
    ns: &str,
    md: &str,
    victim: &str,
    deleted: &mut Option<Instant>,
) -> Result<bool, String> {
    let deployment = api(client, ns, "v1beta2", "MachineDeployment")
        .get(md)
        .await
        .map_err(|e| e.to_string())?;
    let observed = |o: &kube::api::DynamicObject| {
        o.data["status"]["observedGeneration"].as_i64() >= o.metadata.generation
    };
    let sets = api(client, ns, "v1beta2", "MachineSet")
        .list(&ListParams::default().labels(&format!("{DEPLOYMENT_NAME}={md}")))
        .await
        .map_err(|e| e.to_string())?;
    if deleted.is_none() {
        let machine = api(client, ns, "v1beta2", "Machine")
            .get_opt(victim)
            .await
            .map_err(|e| e.to_string())?;
        if machine.is_none_or(|m| m.metadata.deletion_timestamp.is_some()) {
            *deleted = Some(Instant::now());
        }
    }
    let want = deployment.data["spec"]["replicas"].as_i64();
    let total: i64 = sets
        .items
        .iter()
        .filter_map(|s| s.data["spec"]["replicas"].as_i64())
        .sum();
    Ok(observed(&deployment) && sets.items.iter().all(observed) && Some(total) == want)
}

/// DeleteNodes then IncreaseSize, 20 times (back to back, or 250 ms, 500 ms, 1 s apart), against
/// the real MachineDeployment and MachineSet controllers, each round timing how long they take to
/// observe the raised count (and whether the MachineSet controller deleted the marked Machine on the
/// lowered count first).
#[tokio::test]
#[ignore = "a measurement of a few minutes; run by hand (see the module doc)"]
async fn grace_after_a_raise_measured_against_the_real_controllers() {
    let s = RealCapiNamespace::new(&[]).await;
    s.plain_group("grace", ("1", "5", 3)).await;
    let provider = s.provider_with(&["--repair-interval=1s", GRACE]).await;
    let (mut rpc, id) = s.served_group(&provider).await;
    let machine_api = api(&s.client, &s.ns, "v1beta2", "Machine");
    let fail = |message: String| -> ! { s.fail(message, &provider, None) };

    let mut rounds = Vec::new();
    let mut unmarked = BTreeSet::new();
    for round in 0..ROUNDS {
        let current = s
            .wait_settled(
                &format!("round {round}: 3 Machines with Nodes, none marked"),
                "grace",
                3,
            )
            .await
            .unwrap_or_else(|e| fail(e));
        let victim = current.last().expect("three Machines").clone();
        let node = s.grpc_node(&victim).await;
        if let Err(e) = rpc.delete_nodes(&id, vec![node]).await {
            fail(format!("round {round}: DeleteNodes {victim}: {e}"));
        }
        let gap = GAPS_MS[round % GAPS_MS.len()];
        tokio::time::sleep(Duration::from_millis(gap)).await;
        let raised = Instant::now();
        if let Err(e) = rpc.increase(&id, 1).await {
            fail(format!("round {round}: IncreaseSize: {e}"));
        }
        let mut deleted = None;
        let deadline = raised + MACHINES;
        let caught = loop {
            match caught_up(&s.client, &s.ns, "grace", &victim, &mut deleted).await {
                Ok(true) => break raised.elapsed(),
                Ok(false) | Err(_) if Instant::now() < deadline => {}
                Ok(false) => fail(format!("round {round}: controllers never caught up")),
                Err(e) => fail(format!("round {round}: {e}")),
            }
            tokio::time::sleep(SAMPLE).await;
        };
        // Whether the victim goes after the catch-up is already decided; wait to know.
        let settled = poll_until(
            &format!("round {round}: Machine {victim} deleted or its mark taken back"),
            MACHINES,
            Duration::from_millis(50),
            || async {
                let all = match machine_api
                    .list(&ListParams::default().labels(&format!("{DEPLOYMENT_NAME}=grace")))
                    .await
                {
                    Ok(list) => list.items,
                    Err(e) => return Check::Wait(e.to_string()),
                };
                for m in all
                    .iter()
                    .filter(|m| m.metadata.deletion_timestamp.is_some())
                {
                    let marked = m
                        .metadata
                        .annotations
                        .as_ref()
                        .is_some_and(|a| a.contains_key(DELETE_MACHINE));
                    if !marked {
                        return Check::Fatal(format!("Machine {} deleted unmarked", name_of(m)));
                    }
                }
                match all.iter().find(|m| name_of(m) == victim) {
                    None => Check::Done(true),
                    Some(m) if m.metadata.deletion_timestamp.is_some() => Check::Done(true),
                    Some(m)
                        if m.metadata
                            .annotations
                            .as_ref()
                            .is_none_or(|a| !a.contains_key(DELETE_MACHINE)) =>
                    {
                        Check::Done(false)
                    }
                    Some(_) => Check::Wait("victim still marked".into()),
                }
            },
        )
        .await;
        let went = match settled {
            Ok(went) => went,
            Err(e) if e.contains("deleted unmarked") => {
                unmarked.insert(e);
                true
            }
            Err(e) => fail(e),
        };
        rounds.push(Round {
            gap,
            caught_up: caught,
            victim_deleted: went.then(|| {
                deleted.map_or(f64::NAN, |at| {
                    at.checked_duration_since(raised).map_or_else(
                        || -raised.duration_since(at).as_secs_f64(),
                        |d| d.as_secs_f64(),
                    )
                })
            }),
        });
    }
    let caught: Vec<f64> = rounds.iter().map(|r| r.caught_up.as_secs_f64()).collect();
    let deleted: Vec<f64> = rounds
        .iter()
        .filter_map(|r| r.victim_deleted)
        .filter(|d| d.is_finite())
        .collect();
    let by_gap: Vec<String> = GAPS_MS
        .iter()
        .map(|gap| {
            let of_gap: Vec<&Round> = rounds.iter().filter(|r| r.gap == *gap).collect();
            format!(
                "gap {gap} ms: {} of {} deleted, caught up {}",
                of_gap.iter().filter(|r| r.victim_deleted.is_some()).count(),
                of_gap.len(),
                figures(of_gap.iter().map(|r| r.caught_up.as_secs_f64()).collect())
            )
        })
        .collect();
    let report = format!(
        "raise -> both controllers observed it: {}; marked Machine seen deleting, from the raise: {} \
         ({} of {ROUNDS} rounds deleted it, the rest absorbed the mark); {by_gap:?}",
        figures(caught),
        figures(deleted),
        rounds.iter().filter(|r| r.victim_deleted.is_some()).count(),
    );
    assert!(
        unmarked.is_empty(),
        "Machines deleted without their mark: {unmarked:?}; {report}"
    );
    procs::announce(&format!(
        "e2e: measurement real-capi-grace-after-a-raise done in {:.1}s: {report}",
        s.started.elapsed().as_secs_f64()
    ));
}
