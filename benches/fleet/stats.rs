//! Latency samples and the figures made of them.

use std::collections::BTreeMap;
use std::time::Duration;

/// Samples of one measured thing (seconds), in arrival order.
#[derive(Clone, Debug, Default)]
pub struct Samples(pub Vec<f64>);

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64());
    }

    pub fn extend(&mut self, other: &Samples) {
        self.0.extend_from_slice(&other.0);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn mean(&self) -> Option<f64> {
        (!self.0.is_empty()).then(|| self.0.iter().sum::<f64>() / self.0.len() as f64)
    }

    /// The `q` quantile (nearest rank), `None` without samples.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.0.is_empty() {
            return None;
        }
        let mut sorted = self.0.clone();
        sorted.sort_by(f64::total_cmp);
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        Some(sorted[rank - 1])
    }

    pub fn p50(&self) -> Option<f64> {
        self.quantile(0.5)
    }

    pub fn p99(&self) -> Option<f64> {
        self.quantile(0.99)
    }

    pub fn max(&self) -> Option<f64> {
        self.0.iter().copied().reduce(f64::max)
    }

    pub fn min(&self) -> Option<f64> {
        self.0.iter().copied().reduce(f64::min)
    }
}

/// CPU time (user + system) a process has used so far, seconds (`/proc` counts in USER_HZ, 100 on
/// Linux).
pub fn cpu_of(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: the fields after it are counted from its closing paren.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
    // utime and stime are fields 14 and 15 of stat(5); `rest` starts at field 3.
    Some((ticks(11)? + ticks(12)?) as f64 / 100.0)
}

/// CPU time each process on the machine has used so far, seconds, by pid. (`/proc/stat`'s busy ticks are
/// sampled at the timer tick and miss much of a server's short bursts; a process's own times do not.)
pub fn cpu_by_process() -> BTreeMap<u32, f64> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return BTreeMap::new();
    };
    dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, cpu_of(pid)?)))
        .collect()
}

/// CPU time each process but `except` used between two [`cpu_by_process`] readings, the busiest first
/// (processes alive at both).
pub fn cpu_of_others(
    before: &BTreeMap<u32, f64>,
    after: &BTreeMap<u32, f64>,
    except: &[u32],
) -> Vec<(u32, f64)> {
    let mut used: Vec<(u32, f64)> = after
        .iter()
        .filter(|(pid, _)| !except.contains(pid))
        .filter_map(|(&pid, a)| Some((pid, a - before.get(&pid)?)))
        .collect();
    used.sort_by(|a, b| b.1.total_cmp(&a.1));
    used
}

/// A process's name (`/proc/PID/comm`), or its pid once it has ended.
pub fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| pid.to_string())
}

/// `VmRSS` and `VmHWM` (peak) of a process, in bytes.
pub fn rss_of(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kib| kib * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}
