//! The memory a Machine costs, guarded: the objects of a `make bench` fleet (`support/listed.rs`)
//! go through the watches' own path into the cache, and a snapshot is built from it, while a counting
//! allocator measures what each keeps. A change that makes the cache or the snapshot keep more per
//! Machine fails here, long before a 100,000-Machine fleet would show it (docs/benchmarks.md, where
//! the bytes are). Not a timed test: bytes are counted, not time.

#[allow(dead_code)]
#[path = "support/listed.rs"]
mod listed;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use capi_autoscaler_provider::cache::Index;
use capi_autoscaler_provider::cache::writer::Watched;
use capi_autoscaler_provider::capi::ScalableKind;
use capi_autoscaler_provider::snapshot::{Settings, Snapshot};

/// Bytes asked of the allocator and not given back.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is passed to the system allocator as it is; only the sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Most bytes the cache may keep per Machine (its view, its key, its share of the maps), per Node,
/// and the snapshot per Machine (its instance, location and lookups, its group's share of the
/// rest, its template above all). Measured here, 5,000 Machines in 500 groups: 753 B, 343 B and
/// 1,263 B (before the views were made compact: 1,486 B, 913 B and 1,421 B at 20,000, `cargo
/// bench --bench heap`); about a fifth more is allowed.
const MACHINE_BOUND: isize = 1_000;
/// Most bytes the cache may keep per MachineDeployment and per MachineSet: measured 1,222 B and
/// 1,118 B at 20,000 Machines (`cargo bench --bench heap`), 2,991 B and 2,922 B while their labels
/// and annotations were tree maps of strings of their own.
const GROUP_BOUND: isize = 1_500;
const NODE_BOUND: isize = 420;
const SNAPSHOT_BOUND: isize = 1_550;

/// Takes `objects` into `index` as a watch's list does; returns the bytes the index kept of them.
fn list(index: &mut Index, what: Watched, objects: &[Vec<u8>]) -> isize {
    let before = live();
    listed::take(index, &what, objects);
    live() - before
}

#[test]
fn a_machine_costs_the_cache_and_the_snapshot_no_more_than_their_bounds() {
    let (machines, groups) = (5_000, 500);
    let fleet = listed::fleet("fleet", machines, groups);
    let mut index = Index::default();
    let per_deployment = list(
        &mut index,
        Watched::Scalable(ScalableKind::MachineDeployment),
        &fleet.deployments,
    ) / fleet.deployments.len().max(1) as isize;
    let per_machine_set = list(
        &mut index,
        Watched::Scalable(ScalableKind::MachineSet),
        &fleet.machine_sets,
    ) / fleet.machine_sets.len().max(1) as isize;
    let per_machine = list(&mut index, Watched::Machine, &fleet.machines) / machines as isize;
    let per_node =
        list(&mut index, Watched::Node, &fleet.nodes) / fleet.nodes.len().max(1) as isize;
    let before = live();
    let snapshot = index.snapshot_reusing(&Settings::default(), &Snapshot::default());
    let per_snapshot_machine = (live() - before) / machines as isize;
    assert_eq!(snapshot.groups.len(), groups, "every group is served");
    assert_eq!(snapshot.machines, machines);
    eprintln!(
        "per Machine: cache {per_machine} B, its Node {per_node} B, snapshot {per_snapshot_machine} B; per MachineDeployment {per_deployment} B, per MachineSet {per_machine_set} B"
    );
    assert!(
        per_deployment <= GROUP_BOUND && per_machine_set <= GROUP_BOUND,
        "the cache keeps {per_deployment} B per MachineDeployment and {per_machine_set} B per MachineSet (bound {GROUP_BOUND} B)"
    );
    assert!(
        per_machine <= MACHINE_BOUND,
        "the cache keeps {per_machine} B per Machine (bound {MACHINE_BOUND} B)"
    );
    assert!(
        per_node <= NODE_BOUND,
        "the cache keeps {per_node} B per Node (bound {NODE_BOUND} B)"
    );
    assert!(
        per_snapshot_machine <= SNAPSHOT_BOUND,
        "the snapshot keeps {per_snapshot_machine} B per Machine (bound {SNAPSHOT_BOUND} B)"
    );
}
