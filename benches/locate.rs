//! `cargo bench --bench locate`: what answering NodeGroupForNode costs past the gRPC stack, at a
//! fleet's size. The snapshot is built from the objects of a `make bench` fleet
//! (`tests/support/listed.rs`) taken in through the watches' own path; then every Node of the fleet
//! (5 % in no group) is looked up, in a shuffled order as CA's nodes come, and its answer's bytes
//! taken, as the handler does. Beside it, the floor's work for the same question (the fleet bench's
//! floor: one map from providerID to the answer's bytes). The fleet bench measures the whole call;
//! this isolates the lookup, whose cache misses grow with the fleet.
//!
//! Prints nanoseconds per lookup (median, fastest and slowest of the rounds) for both.
//!
//! Environment (optional): `LOCATE_MACHINES` (100000), `LOCATE_GROUPS` (10000), `LOCATE_ROUNDS` (7).

#[allow(dead_code)]
#[path = "../tests/support/listed.rs"]
mod listed;

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use capi_autoscaler_provider::cache::Index;
use capi_autoscaler_provider::grpc::{group_field, node_ref};
use capi_autoscaler_provider::proto::ExternalGrpcNode;
use capi_autoscaler_provider::snapshot::{Settings, Snapshot};
use prost::bytes::Bytes;
use rand::SeedableRng as _;
use rand::seq::SliceRandom as _;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// A listed Node as CA sends it (its labels left out: no lookup reads them).
fn asked(bytes: &[u8]) -> ExternalGrpcNode {
    let node: serde_json::Value =
        serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("a listed Node: {e}"));
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    ExternalGrpcNode {
        provider_id: text(&node["spec"]["providerID"]),
        name: text(&node["metadata"]["name"]),
        annotations: node["metadata"]["annotations"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), text(v))).collect())
            .unwrap_or_default(),
        ..Default::default()
    }
}

fn main() {
    let machines = env_or("LOCATE_MACHINES", 100_000);
    let groups = env_or("LOCATE_GROUPS", 10_000);
    let rounds = env_or("LOCATE_ROUNDS", 7).max(1);
    let listed = listed::fleet("bench", machines, groups);
    let mut index = Index::default();
    for (_, what, objects) in listed.kinds() {
        listed::take(&mut index, &what, objects);
    }
    let settings = Settings::default();
    let snapshot = index.snapshot_reusing(&settings, &Snapshot::default());
    drop(index);
    let mut asked: Vec<ExternalGrpcNode> = listed.nodes.iter().map(|n| asked(n)).collect();
    asked.shuffle(&mut rand::rngs::StdRng::seed_from_u64(30));

    // The floor's map, from what the snapshot answers: the same answers, the same keys.
    let floor: HashMap<String, Bytes> = asked
        .iter()
        .filter_map(|n| {
            let group = snapshot.group_for_node(&node_ref(n), &settings.keys)?;
            Some((n.provider_id.clone(), group_field(group)))
        })
        .collect();
    let found = floor.len();
    assert!(
        found >= machines,
        "{found} of {machines} Machines' Nodes found"
    );

    let time = |lookup: &dyn Fn(&ExternalGrpcNode) -> Option<Bytes>| -> Vec<f64> {
        (0..rounds)
            .map(|_| {
                let started = Instant::now();
                for node in &asked {
                    black_box(lookup(black_box(node)));
                }
                started.elapsed().as_secs_f64() * 1e9 / asked.len() as f64
            })
            .collect()
    };
    let ours = time(&|n| {
        snapshot
            .group_for_node(&node_ref(n), &settings.keys)
            .map(group_field)
    });
    let floor = time(&|n| floor.get(&n.provider_id).cloned());

    println!(
        "NodeGroupForNode's lookup at {machines} Machines / {groups} groups: {} Nodes asked ({found} in a group), shuffled, {rounds} rounds\n",
        asked.len()
    );
    println!("| server | ns per lookup, median | fastest | slowest |");
    println!("|---|---|---|---|");
    let mut medians = Vec::new();
    for (name, mut times) in [
        ("ours: `Snapshot::group_for_node`, the group's bytes", ours),
        ("floor: providerID → the answer's bytes", floor),
    ] {
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        medians.push(median);
        println!(
            "| {name} | {median:.0} | {:.0} | {:.0} |",
            times[0],
            times[times.len() - 1]
        );
    }
    println!(
        "\nours − floor: {:.0} ns per NodeGroupForNode",
        medians[0] - medians[1]
    );
}
