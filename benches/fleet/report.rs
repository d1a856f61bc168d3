//! The table (Markdown) and the JSON of a run, and the goals it is judged by.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use crate::replay::{KINDS, LoopRun};
use crate::stats::Samples;
use crate::{ServerFigures, SizeResult};

/// The machine the run was made on.
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub kernel: String,
}

impl Machine {
    pub fn describe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown CPU".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_gib = meminfo
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map(|kib| kib / 1024.0 / 1024.0)
            .unwrap_or(0.0);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        Machine {
            cpu,
            cores: std::thread::available_parallelism()
                .map(usize::from)
                .unwrap_or(0),
            memory_gib,
            kernel,
        }
    }

    pub fn text(&self) -> String {
        format!(
            "{} cores ({}), {:.0} GiB memory, Linux {}",
            self.cores, self.cpu, self.memory_gib, self.kernel
        )
    }
}

pub fn mib(bytes: Option<u64>) -> String {
    bytes
        .map(|b| format!("{:.0} MiB", b as f64 / 1024.0 / 1024.0))
        .unwrap_or_else(|| "—".into())
}

pub fn ms(seconds: Option<f64>) -> String {
    seconds
        .map(|s| format!("{:.3} ms", s * 1000.0))
        .unwrap_or_else(|| "—".into())
}

/// A figure in one unit, for a cell and for ratios.
#[derive(Clone, Copy)]
enum Unit {
    Seconds,
    Millis,
    MiB,
    Count,
}

fn cell(v: Option<f64>, unit: Unit) -> String {
    match v {
        None => "—".into(),
        Some(v) => match unit {
            Unit::Seconds => format!("{v:.2} s"),
            Unit::Millis => format!("{:.3} ms", v * 1000.0),
            Unit::MiB => format!("{:.0} MiB", v / 1024.0 / 1024.0),
            Unit::Count => format!("{v:.1}"),
        },
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => {
            let r = a / b;
            if r >= 100.0 {
                format!("{r:.0}×")
            } else if r >= 0.01 {
                format!("{r:.2}×")
            } else if a > 0.0 {
                format!("1/{:.0}", b / a)
            } else {
                // Nothing measured against something (a process idle through the loop).
                "0×".into()
            }
        }
        _ => "—".into(),
    }
}

/// One row: the figure of each column (ours, W, A, floor).
struct Row {
    figure: String,
    unit: Unit,
    ours: Option<f64>,
    w: Option<f64>,
    a: Option<f64>,
    floor: Option<f64>,
    note: String,
    /// The A figure is a lower bound (A did not get that far within its budget).
    a_at_least: bool,
}

/// The median of what `pick` reads of each of `loops` that has it.
fn median<'a>(
    loops: impl Iterator<Item = &'a LoopRun>,
    pick: fn(&LoopRun) -> Option<f64>,
) -> Option<f64> {
    Samples(loops.filter_map(pick).collect()).p50()
}

fn rows(r: &SizeResult) -> Vec<Row> {
    let none = ServerFigures::default();
    let ours = r.servers.get("ours").unwrap_or(&none);
    let w = r.servers.get("W");
    let floor = r.servers.get("floor");
    let mut rows = Vec::new();
    let mut push = |figure: &str, unit, ours, w, a, floor, note: String| {
        rows.push(Row {
            figure: figure.to_string(),
            unit,
            ours,
            w,
            a,
            floor,
            note,
            a_at_least: false,
        })
    };
    let w_estimated = w.is_some_and(ServerFigures::estimated);
    push(
        "replay: loop wall time (median)",
        Unit::Seconds,
        ours.loop_times().p50(),
        w.and_then(|w| w.loop_times().p50()),
        None,
        floor.and_then(|f| f.loop_times().p50()),
        if w_estimated {
            "W: estimated from samples (calls per loop × mean sampled latency)".into()
        } else {
            String::new()
        },
    );
    let quiet = |f: &ServerFigures, pick| median(f.quiet_loops(), pick);
    let quiet_count = |f: Option<&ServerFigures>| f.map_or(0, |f| f.quiet_loops().count());
    push(
        "replay: loop wall time, quiet loops (median)",
        Unit::Seconds,
        ours.quiet_loop_times().p50(),
        None,
        None,
        floor.and_then(|f| f.quiet_loop_times().p50()),
        format!(
            "n = {} / {}: loops in which every other process used under a tenth of a core",
            quiet_count(Some(ours)),
            quiet_count(floor)
        ),
    );
    push(
        "replay: the server's CPU per quiet loop (median)",
        Unit::Seconds,
        quiet(ours, |l| l.server_cpu),
        None,
        None,
        floor.and_then(|f| quiet(f, |l| l.server_cpu)),
        String::new(),
    );
    for kind in KINDS {
        for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
            let of = |f: &ServerFigures| f.latency(kind).quantile(q);
            let n = |f: Option<&ServerFigures>| f.map(|f| f.latency(kind).len()).unwrap_or(0);
            push(
                &format!("replay: {kind} {name}"),
                Unit::Millis,
                of(ours),
                w.and_then(of),
                None,
                floor.and_then(of),
                if q == 0.5 {
                    format!("n = {} / {} / {}", n(Some(ours)), n(w), n(floor))
                } else {
                    String::new()
                },
            );
        }
    }
    for kind in KINDS {
        let of = |f: &ServerFigures| f.quiet_latency(kind).p50();
        let n = |f: Option<&ServerFigures>| f.map_or(0, |f| f.quiet_latency(kind).len());
        push(
            &format!("replay: {kind} p50, quiet loops"),
            Unit::Millis,
            of(ours),
            None,
            None,
            floor.and_then(of),
            format!("n = {} / {}", n(Some(ours)), n(floor)),
        );
    }
    let cpu_per_loop = |f: &ServerFigures, pick| median(f.whole_loops(), pick);
    push(
        "replay: the server's CPU per loop (median)",
        Unit::Seconds,
        cpu_per_loop(ours, |l| l.server_cpu),
        None,
        None,
        floor.and_then(|f| cpu_per_loop(f, |l| l.server_cpu)),
        String::new(),
    );
    push(
        "replay: the rest of the machine's CPU per loop (median)",
        Unit::Seconds,
        cpu_per_loop(ours, |l| l.others_cpu),
        None,
        None,
        floor.and_then(|f| cpu_per_loop(f, |l| l.others_cpu)),
        "every other process: the API server, etcd, the idle servers".into(),
    );
    push(
        "apiserver requests per replay loop (max)",
        Unit::Count,
        ours.requests.max(),
        w.and_then(|w| w.requests.max()),
        None,
        None,
        "non-watch requests of each server's identities (APF flow schemas)".into(),
    );
    let each = |pick: fn(&(f64, Option<f64>)) -> Option<f64>| {
        ours.starts
            .iter()
            .map(|s| pick(s).map_or("—".into(), |v| format!("{v:.2}")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    push(
        "start → first complete NodeGroups answer",
        Unit::Seconds,
        ours.ready_after,
        w.and_then(|w| w.ready_after),
        None,
        floor.and_then(|f| f.ready_after),
        if ours.starts.len() > 1 {
            format!(
                "ours: median of {} starts: {} s",
                ours.starts.len(),
                each(|s| Some(s.0))
            )
        } else {
            String::new()
        },
    );
    let cpu = Samples(ours.starts.iter().filter_map(|s| s.1).collect()).p50();
    push(
        "CPU used from start to ready (median)",
        Unit::Seconds,
        cpu,
        None,
        None,
        None,
        format!("each start: {} s", each(|s| s.1)),
    );
    let rss = |f: &ServerFigures| f.rss_ready.map(|r| r.0 as f64);
    push(
        "RSS after sync",
        Unit::MiB,
        rss(ours),
        w.and_then(rss),
        None,
        floor.and_then(rss),
        String::new(),
    );
    let steady = |f: &ServerFigures| f.rss_steady.map(|r| r.0 as f64);
    let peak = |f: &ServerFigures| f.rss_steady.or(f.rss_ready).map(|r| r.1 as f64);
    push(
        "RSS after the replay loops",
        Unit::MiB,
        steady(ours),
        w.and_then(steady),
        None,
        floor.and_then(steady),
        String::new(),
    );
    push(
        "peak RSS (VmHWM)",
        Unit::MiB,
        peak(ours),
        w.and_then(peak),
        None,
        floor.and_then(peak),
        String::new(),
    );
    push(
        "snapshot build, whole fleet (mean)",
        Unit::Millis,
        ours.snapshot_build.map(|b| b.0),
        None,
        None,
        None,
        ours.snapshot_build
            .map(|b| format!("{:.0} builds", b.1))
            .unwrap_or_default(),
    );
    let ca_ours = r.ca.get("ours");
    let ca_a = r.ca.get("A");
    // The floor column of CA's rows: the same CA against the floor server.
    let ca_floor = r.ca.get("floor");
    if ca_ours.is_some() || ca_a.is_some() {
        push(
            "CA: main loop (mean)",
            Unit::Seconds,
            ca_ours.and_then(|c| c.loop_mean),
            None,
            ca_a.and_then(|c| c.loop_mean.or(c.loop_at_least)),
            ca_floor.and_then(|c| c.loop_mean),
            format!(
                "loops measured: {} / {} / {}; floor: CA against the floor server",
                ca_ours.map(|c| c.loops).unwrap_or(0),
                ca_a.map(|c| c.loops).unwrap_or(0),
                ca_floor.map(|c| c.loops).unwrap_or(0)
            ),
        );
        let phases: BTreeSet<&String> = ca_ours
            .iter()
            .chain(ca_a.iter())
            .chain(ca_floor.iter())
            .flat_map(|c| c.phases.keys())
            .filter(|k| k.as_str() != "main")
            .collect();
        for phase in phases {
            let of = |c: &crate::ca::CaRun| c.phases.get(phase).copied();
            push(
                &format!("CA: {phase} per loop"),
                Unit::Seconds,
                ca_ours.and_then(of),
                None,
                ca_a.and_then(of),
                ca_floor.and_then(of),
                String::new(),
            );
        }
        push(
            "CA: apiserver requests per loop",
            Unit::Count,
            ca_ours.and_then(|c| c.requests_per_loop),
            None,
            ca_a.and_then(|c| c.requests_per_loop.or(c.requests_at_least)),
            ca_floor.and_then(|c| c.requests_per_loop),
            "CA and its provider, non-watch".into(),
        );
        if let Some(c) = ca_ours.filter(|c| !c.provider_calls.is_empty()) {
            let mut by_method: Vec<(&String, &f64)> = c.provider_calls.iter().collect();
            by_method.sort_by(|a, b| b.1.total_cmp(a.1));
            push(
                "CA: calls to this provider per loop",
                Unit::Count,
                Some(c.provider_calls.values().sum()),
                None,
                None,
                None,
                by_method
                    .iter()
                    .map(|(m, n)| format!("{m} {n:.0}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            );
            push(
                "CA: time this provider spent answering, per loop",
                Unit::Seconds,
                c.provider_seconds,
                None,
                None,
                None,
                "sum of its call durations, server side".into(),
            );
        }
        let raised =
            |c: &crate::ca::CaRun| Samples(c.pods.iter().filter_map(|p| p.raised_after).collect());
        let margin =
            |c: &crate::ca::CaRun| Samples(c.pods.iter().filter_map(|p| p.margin()).collect());
        let first = |c: &crate::ca::CaRun| {
            Samples(c.pods.iter().filter_map(|p| p.next_loop_after).collect())
        };
        let pods = |c: Option<&crate::ca::CaRun>| {
            c.map(|c| {
                format!(
                    "{}/{}",
                    c.pods.iter().filter(|p| p.raised_after.is_some()).count(),
                    c.pods.len()
                )
            })
            .unwrap_or_else(|| "0".into())
        };
        push(
            "CA: pending pod → replicas raised (median)",
            Unit::Seconds,
            ca_ours.and_then(|c| raised(c).p50()),
            None,
            ca_a.and_then(|c| raised(c).p50()),
            None,
            format!("pods raised: {} / {}", pods(ca_ours), pods(ca_a)),
        );
        push(
            "CA: pending pod → replicas raised (max)",
            Unit::Seconds,
            ca_ours.and_then(|c| raised(c).max()),
            None,
            ca_a.and_then(|c| raised(c).max()),
            None,
            String::new(),
        );
        push(
            "CA: pending pod → start of the loop that scaled for it (median)",
            Unit::Seconds,
            ca_ours.and_then(|c| first(c).p50()),
            None,
            ca_a.and_then(|c| first(c).p50()),
            None,
            "CA leaves pods younger than 2 s to the loop after".into(),
        );
        push(
            "CA: replicas raised − start of CA's next loop (max)",
            Unit::Seconds,
            ca_ours.and_then(|c| margin(c).max()),
            None,
            ca_a.and_then(|c| margin(c).max()),
            None,
            String::new(),
        );
    }
    let write = |f: &ServerFigures, which: &str, q: f64| {
        f.writes.as_ref().and_then(|w| match which {
            "increase" => w.increase.quantile(q),
            _ => w.delete.quantile(q),
        })
    };
    for (which, name) in [("increase", "IncreaseSize"), ("delete", "DeleteNodes")] {
        for (q, qn) in [(0.5, "p50"), (0.99, "p99")] {
            let n = |f: Option<&ServerFigures>| {
                f.and_then(|f| f.writes.as_ref())
                    .map(|w| match which {
                        "increase" => w.increase.len(),
                        _ => w.delete.len(),
                    })
                    .unwrap_or(0)
            };
            push(
                &format!("write: {name} → visible in the API {qn}"),
                Unit::Millis,
                write(ours, which, q),
                w.and_then(|w| write(w, which, q)),
                None,
                None,
                if q == 0.5 {
                    format!("n = {} / {}", n(Some(ours)), n(w))
                } else {
                    String::new()
                },
            );
        }
    }
    let a_bound =
        r.ca.get("A")
            .is_some_and(|c| c.loop_mean.is_none() && c.loop_at_least.is_some());
    if a_bound {
        for row in rows.iter_mut().filter(|r| {
            r.figure == "CA: main loop (mean)" || r.figure == "CA: apiserver requests per loop"
        }) {
            row.a_at_least = true;
        }
    }
    rows
}

/// A goal and whether the run met it.
pub struct Goal {
    pub text: String,
    /// `None`: not measured in this run.
    pub met: Option<bool>,
    pub measured: String,
}

pub fn goals(results: &[SizeResult]) -> Vec<Goal> {
    let mut goals = Vec::new();
    let label = |r: &SizeResult| format!("{}/{}", r.machines, r.groups);
    let mut loops = Vec::new();
    let mut requests = Vec::new();
    for r in results {
        let Some(ours) = r.servers.get("ours") else {
            continue;
        };
        let floor = r.servers.get("floor");
        let (o, f) = (
            ours.loop_times().p50(),
            floor.and_then(|f| f.loop_times().p50()),
        );
        if let (Some(o), Some(f)) = (o, f) {
            loops.push((label(r), o / f));
        }
        requests.push((label(r), ours.requests.max().unwrap_or(0.0)));
    }
    goals.push(Goal {
        text: "replay loop ≤ 1.2× floor at every size".into(),
        met: (!loops.is_empty()).then(|| loops.iter().all(|(_, r)| *r <= 1.2)),
        measured: loops
            .iter()
            .map(|(l, r)| format!("{l}: {r:.2}×"))
            .collect::<Vec<_>>()
            .join(", "),
    });
    goals.push(Goal {
        text: "0 apiserver requests per steady-state loop".into(),
        met: (!requests.is_empty()).then(|| requests.iter().all(|(_, n)| *n == 0.0)),
        measured: requests
            .iter()
            .map(|(l, n)| format!("{l}: {n:.0}"))
            .collect::<Vec<_>>()
            .join(", "),
    });
    let big = results.iter().find(|r| r.machines >= 100_000);
    let ours_big = big.and_then(|r| r.servers.get("ours"));
    let rss = ours_big.and_then(|o| {
        [o.rss_ready, o.rss_steady]
            .iter()
            .flatten()
            .map(|r| r.0)
            .max()
    });
    goals.push(Goal {
        text: "100,000 Machines: RSS ≤ 1 GiB".into(),
        met: rss.map(|b| b <= 1 << 30),
        measured: mib(rss),
    });
    let ready = ours_big.and_then(|o| o.ready_after);
    goals.push(Goal {
        text: "100,000 Machines: start → ready ≤ 30 s".into(),
        met: ready.map(|s| s <= 30.0),
        measured: cell(ready, Unit::Seconds),
    });
    let build = ours_big.and_then(|o| o.snapshot_build.map(|b| b.0));
    goals.push(Goal {
        text: "100,000 Machines: snapshot build ≤ 1 s".into(),
        met: build.map(|s| s <= 1.0),
        measured: cell(build, Unit::Millis),
    });
    let p99 = ours_big.and_then(|o| o.latency("NodeGroupForNode").p99());
    goals.push(Goal {
        text: "100,000 Machines: NodeGroupForNode p99 ≤ 1 ms".into(),
        met: p99.map(|s| s <= 0.001),
        measured: cell(p99, Unit::Millis),
    });
    let ten = results.iter().find(|r| r.machines == 10_000);
    let ca = ten.and_then(|r| {
        let a = r.ca.get("A")?;
        let (a_loop, bound) = match (a.loop_mean, a.loop_at_least) {
            (Some(m), _) => (m, ""),
            (None, Some(b)) => (b, "≥ "),
            _ => return None,
        };
        Some((r.ca.get("ours")?.loop_mean?, a_loop, bound))
    });
    goals.push(Goal {
        text: "10,000 Machines: CA loop with this provider ≤ ½ of CA with A".into(),
        met: ca.map(|(o, a, _)| o <= a / 2.0),
        measured: ca
            .map(|(o, a, bound)| {
                format!(
                    "{o:.2} s vs {bound}{a:.0} s ({}{:.4}×)",
                    if bound.is_empty() { "" } else { "≤ " },
                    o / a
                )
            })
            .unwrap_or_else(|| "—".into()),
    });
    let mut margins = Vec::new();
    let mut all_raised = true;
    for r in results {
        if let Some(c) = r.ca.get("ours") {
            all_raised &= c.pods.iter().all(|p| p.raised_after.is_some());
            if let Some(m) = Samples(c.pods.iter().filter_map(|p| p.margin()).collect()).max() {
                // CA scales up only after updateClusterState: against the floor, that phase is
                // the least any provider can leave it.
                let floor =
                    r.ca.get("floor")
                        .and_then(|f| f.phases.get("updateClusterState"))
                        .map(|s| {
                            format!(" (CA against the floor: updateClusterState {s:.2} s per loop)")
                        })
                        .unwrap_or_default();
                margins.push((label(r), m, floor));
            }
        }
    }
    goals.push(Goal {
        text: "pending pod → replicas raised ≤ (time to CA's next loop) + 1 s".into(),
        met: (!margins.is_empty()).then(|| all_raised && margins.iter().all(|(_, m, _)| *m <= 1.0)),
        measured: margins
            .iter()
            .map(|(l, m, floor)| format!("{l}: worst {m:.2} s after the loop start{floor}"))
            .collect::<Vec<_>>()
            .join(", "),
    });
    let mut writes = Vec::new();
    for r in results {
        if let Some(w) = r.servers.get("ours").and_then(|o| o.writes.as_ref()) {
            for (name, s) in [("IncreaseSize", &w.increase), ("DeleteNodes", &w.delete)] {
                if let Some(p) = s.p99() {
                    writes.push((format!("{} {name}", label(r)), p));
                }
            }
        }
    }
    goals.push(Goal {
        text: "write visible p99 ≤ 50 ms".into(),
        met: (!writes.is_empty()).then(|| writes.iter().all(|(_, p)| *p <= 0.05)),
        measured: writes
            .iter()
            .map(|(l, p)| format!("{l} {:.1} ms", p * 1000.0))
            .collect::<Vec<_>>()
            .join(", "),
    });
    goals
}

/// The Markdown table of a run, its setting and its goals.
pub fn table(results: &[SizeResult], options: &str, machine: &Machine) -> String {
    let mut out = String::new();
    out.push_str(&format!("Machine: {}. Run: {options}.\n\n", machine.text()));
    out.push_str(
        "| size | figure | ours | W | A | floor | ours/W | ours/A | ours/floor | note |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for r in results {
        let size = format!("{}/{}", r.machines, r.groups);
        out.push_str(&format!(
            "| {size} | fleet: {} Machines in {} groups ({} at zero), {} Nodes; {} objects created in {:.1} s | | | | | | | | |\n",
            r.machines, r.groups, r.zero_groups, r.nodes, r.objects, r.fleet_seconds
        ));
        for row in rows(r) {
            if [row.ours, row.w, row.a, row.floor]
                .iter()
                .all(Option::is_none)
            {
                continue;
            }
            let (a, ours_a) = if row.a_at_least && row.a.is_some() {
                (
                    format!("≥ {}", cell(row.a, row.unit)),
                    format!("≤ {}", ratio(row.ours, row.a)),
                )
            } else {
                (cell(row.a, row.unit), ratio(row.ours, row.a))
            };
            out.push_str(&format!(
                "| {size} | {} | {} | {} | {a} | {} | {} | {ours_a} | {} | {} |\n",
                row.figure,
                cell(row.ours, row.unit),
                cell(row.w, row.unit),
                cell(row.floor, row.unit),
                ratio(row.ours, row.w),
                ratio(row.ours, row.floor),
                row.note
            ));
        }
        for note in r
            .notes
            .iter()
            .cloned()
            .chain(
                r.ca.values()
                    .flat_map(|c| c.notes.iter().map(|n| format!("{}: {n}", c.label))),
            )
            .chain(r.servers.iter().filter_map(|(name, f)| {
                let errors = f.errors();
                (!errors.is_empty()).then(|| format!("{name}: calls not answered OK: {errors:?}"))
            }))
            .chain(r.servers.iter().filter_map(|(name, f)| {
                let w = f.writes.as_ref()?;
                (!w.failures.is_empty())
                    .then(|| format!("{name}: write failures: {:?}", w.failures))
            }))
        {
            out.push_str(&format!("| {size} | note: {note} | | | | | | | | |\n"));
        }
    }
    out.push_str("\nGoals:\n\n");
    for goal in goals(results) {
        let mark = match goal.met {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "not measured",
        };
        out.push_str(&format!(
            "- {}: **{mark}** ({})\n",
            goal.text, goal.measured
        ));
    }
    out
}

fn figure_json(v: Option<f64>) -> Value {
    v.map(Value::from).unwrap_or(Value::Null)
}

fn samples_json(s: &Samples) -> Value {
    json!({"n": s.len(), "p50": figure_json(s.p50()), "p99": figure_json(s.p99()),
           "mean": figure_json(s.mean()), "max": figure_json(s.max())})
}

fn server_json(f: &ServerFigures) -> Value {
    let latency = |of: &dyn Fn(&str) -> Samples| -> serde_json::Map<String, Value> {
        KINDS
            .iter()
            .map(|k| (k.to_string(), samples_json(&of(k))))
            .collect()
    };
    json!({
        "replay_loop_seconds": samples_json(&f.loop_times()),
        "replay_quiet_loop_seconds": samples_json(&f.quiet_loop_times()),
        "replay_loop_estimated": f.estimated(),
        "rpc_seconds": latency(&|k| f.latency(k)),
        "rpc_seconds_quiet_loops": latency(&|k| f.quiet_latency(k)),
        "rpc_errors": f.errors(),
        "apiserver_requests_per_loop": f.requests.0,
        "apiserver_watches_during_replay": f.watches,
        "ready_seconds": figure_json(f.ready_after),
        "starts": f.starts.iter().map(|(ready, cpu)| json!({"ready_seconds": figure_json(Some(*ready)), "cpu_seconds": cpu})).collect::<Vec<_>>(),
        "rss_after_sync_bytes": f.rss_ready.map(|r| r.0),
        "rss_after_replay_bytes": f.rss_steady.map(|r| r.0),
        "rss_peak_bytes": f.rss_steady.or(f.rss_ready).map(|r| r.1),
        "snapshot_build_seconds_mean": f.snapshot_build.map(|b| b.0),
        "writes": f.writes.as_ref().map(|w| json!({
            "increase_size_visible_seconds": samples_json(&w.increase),
            "delete_nodes_visible_seconds": samples_json(&w.delete),
            "increase_size_samples": w.increase.0,
            "delete_nodes_samples": w.delete.0,
            "failures": w.failures,
        })),
    })
}

/// The JSON of a run: every figure, the goals, the machine.
pub fn json(results: &[SizeResult], options: &str, machine: &Machine) -> Value {
    let sizes: Vec<Value> = results
        .iter()
        .map(|r| {
            let servers: serde_json::Map<String, Value> = r
                .servers
                .iter()
                .map(|(name, f)| (name.to_string(), server_json(f)))
                .collect();
            let ca: serde_json::Map<String, Value> =
                r.ca.iter()
                    .map(|(name, c)| {
                        (
                            name.to_string(),
                            json!({
                                "label": c.label,
                                "loops": c.loops,
                                "loop_seconds_mean": c.loop_mean,
                                "first_loop_seconds": c.first_loop,
                                "phases_seconds_per_loop": c.phases,
                                "apiserver_requests_per_loop": c.requests_per_loop,
                                "provider_calls_per_loop": c.provider_calls,
                                "provider_seconds_per_loop": c.provider_seconds,
                                "rss_bytes": c.rss,
                                "pods": c.pods.iter().map(|p| json!({
                                    "group": p.group,
                                    "created_seconds_into_interval": p.offset,
                                    "raised_after_seconds": p.raised_after,
                                    "next_loop_after_seconds": p.next_loop_after,
                                })).collect::<Vec<_>>(),
                                "notes": c.notes,
                            }),
                        )
                    })
                    .collect();
            json!({
                "machines": r.machines,
                "groups": r.groups,
                "zero_groups": r.zero_groups,
                "nodes": r.nodes,
                "fleet_objects": r.objects,
                "fleet_seconds": r.fleet_seconds,
                "servers": servers,
                "cluster_autoscaler": ca,
                "notes": r.notes,
            })
        })
        .collect();
    let goals: Vec<Value> = goals(results)
        .into_iter()
        .map(|g| json!({"goal": g.text, "met": g.met, "measured": g.measured}))
        .collect();
    json!({
        "machine": {"cpu": machine.cpu, "cores": machine.cores, "memory_gib": machine.memory_gib, "kernel": machine.kernel},
        "options": options,
        "sizes": sizes,
        "goals": goals,
    })
}
