//! `cargo bench --bench heap`: where the provider's bytes are at a fleet's size, by object kind. A heap
//! profile (dhat) of the objects of a `make bench` fleet (`tests/support/listed.rs`, as the API server
//! lists them) taken into the cache through the watches' own path (decode, parse, a list's reset),
//! kind by kind, then the snapshot built from it and a second full build while the first is served
//! (what a rebuild holds at its peak).
//!
//! Prints the bytes each kind keeps (in total and per object), the snapshot's, the peak, and the
//! allocation sites holding the most at that peak; writes `target/bench/dhat-heap.json` (open it in
//! dhat's viewer, `dh_view.html` of valgrind's DHAT) for the rest. Bytes are those asked of the
//! allocator; resident memory adds the allocator's own overhead and the process's code, stacks and
//! buffers (`make bench` measures RSS).
//!
//! Environment (optional): `HEAP_MACHINES` (100000), `HEAP_GROUPS` (10000).

#[allow(dead_code)]
#[path = "../tests/support/listed.rs"]
mod listed;

use std::time::Instant;

use capi_autoscaler_provider::cache::Index;
use capi_autoscaler_provider::capi::{ObjectKey, ScalableKind};
use capi_autoscaler_provider::snapshot::{Settings, Snapshot};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

fn live() -> u64 {
    dhat::HeapStats::get().curr_bytes as u64
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// One row: what a step added to the live heap.
struct Row {
    what: String,
    objects: usize,
    bytes: u64,
    took: f64,
}

fn main() {
    let machines = env_or("HEAP_MACHINES", 100_000);
    let groups = env_or("HEAP_GROUPS", 10_000);
    let listed = listed::fleet("bench", machines, groups);
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&out).unwrap_or_else(|e| panic!("create {}: {e}", out.display()));
    let file = out.join("dhat-heap.json");
    let profiler = dhat::Profiler::builder().file_name(&file).build();

    let settings = Settings::default();
    let mut index = Index::default();
    let mut rows = Vec::new();
    for (name, what, objects) in listed.kinds() {
        let before = live();
        let started = Instant::now();
        listed::take(&mut index, &what, objects);
        rows.push(Row {
            what: format!("cache: {name}"),
            objects: objects.len(),
            bytes: live().saturating_sub(before),
            took: started.elapsed().as_secs_f64(),
        });
    }
    let cache = rows.iter().map(|r| r.bytes).sum::<u64>();

    let before = live();
    let started = Instant::now();
    let first = index.snapshot_reusing(&settings, &Snapshot::default());
    rows.push(Row {
        what: format!("snapshot: {} groups", first.groups.len()),
        objects: machines,
        bytes: live().saturating_sub(before),
        took: started.elapsed().as_secs_f64(),
    });
    // A change that is not local to a group: the next build is a full one, made while the first is
    // still served.
    let touched = ObjectKey::new("bench", "md-00000");
    if let Some(md) = index.resource(ScalableKind::MachineDeployment, &touched) {
        let mut md = md.as_ref().clone();
        md.annotations.insert("bench/touch".into(), "1".into());
        md.resource_version.push('1');
        index.apply_resource(ScalableKind::MachineDeployment, touched, Ok(md.into()));
    }
    let before = live();
    let started = Instant::now();
    let second = index.snapshot_reusing(&settings, &first);
    rows.push(Row {
        what: "second snapshot, built while the first is served".into(),
        objects: machines,
        bytes: live().saturating_sub(before),
        took: started.elapsed().as_secs_f64(),
    });
    drop(first);
    let stats = dhat::HeapStats::get();
    drop(second);
    drop(index);
    drop(profiler);

    println!(
        "Heap at {machines} Machines / {groups} groups ({} Nodes), bytes asked of the allocator:\n",
        listed.nodes.len()
    );
    println!("| what | objects | bytes | per object | took |");
    println!("|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} B | {:.2} s |",
            r.what,
            r.objects,
            mib(r.bytes),
            r.bytes / r.objects.max(1) as u64,
            r.took
        );
    }
    println!(
        "| cache, all kinds | {machines} Machines | {} | {} B per Machine | |",
        mib(cache),
        cache / machines.max(1) as u64
    );
    println!(
        "| peak (max live) | | {} | {} B per Machine | |",
        mib(stats.max_bytes as u64),
        stats.max_bytes as u64 / machines.max(1) as u64
    );
    println!();
    print_sites(&file);
    eprintln!("wrote {}", file.display());
}

/// The allocation sites holding the most at the peak, from dhat's file: each by the first frame on
/// its stack that is a function of this crate (the rest of the stack is in the file).
fn print_sites(file: &std::path::Path) {
    let Ok(text) = std::fs::read(file) else {
        return;
    };
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(&text) else {
        return;
    };
    let frames: Vec<&str> = json["ftbl"]
        .as_array()
        .map(|a| a.iter().map(|f| f.as_str().unwrap_or_default()).collect())
        .unwrap_or_default();
    let mut sites: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    for pp in json["pps"].as_array().into_iter().flatten() {
        let at_peak = pp["gb"].as_u64().unwrap_or(0);
        let ours = pp["fs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| frames.get(i.as_u64()? as usize))
            .map(|f| f.split_once(": ").map_or(*f, |(_, rest)| rest))
            .find(|f| {
                let f = f.trim_start_matches('<');
                f.starts_with("capi_autoscaler_provider::") && !f.contains("::text::")
            })
            .map(short_frame)
            .unwrap_or_else(|| "(outside the crate)".to_string());
        *sites.entry(ours).or_default() += at_peak;
    }
    let mut sites: Vec<(String, u64)> = sites.into_iter().collect();
    sites.sort_by_key(|site| std::cmp::Reverse(site.1));
    println!("Allocation sites at the peak (first function of the crate on the stack):\n");
    println!("| site | bytes at the peak |");
    println!("|---|---|");
    for (site, bytes) in sites.iter().take(20) {
        println!("| `{site}` | {} |", mib(*bytes));
    }
}

/// `capi_autoscaler_provider::capi::parse::f<T> (src/capi/parse.rs:301:9)` → `capi::parse::f
/// (src/capi/parse.rs:301:9)`: generic arguments and closures left out.
fn short_frame(frame: &str) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for c in frame.replace("capi_autoscaler_provider::", "").chars() {
        match c {
            '<' if !out.is_empty() => depth += 1,
            '>' if depth > 0 => depth -= 1,
            '<' | '>' => {}
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out.replace("::{{closure}}", "")
}
