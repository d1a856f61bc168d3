//! Whether each watch is in sync: what readiness, `/readyz`, `check` and refused writes go by.

use std::time::{Duration, Instant};

use super::Store;
use crate::apis::resource_name;
use crate::capi::ScalableKind;
use crate::lock;

/// The state of one watch.
#[derive(Debug)]
pub(super) struct WatchHealth {
    /// Readiness and writes depend on it (not the optional Cluster and infrastructure watches).
    required: bool,
    started: Instant,
    /// Listed completely at least once.
    listed: bool,
    /// Failing since its last complete list.
    failure: Option<WatchFailure>,
}

#[derive(Debug, Clone)]
pub(super) struct WatchFailure {
    since: Instant,
    message: String,
    /// Forbidden (403) or not found (404): nothing gets better by waiting.
    fatal: bool,
}

/// A watch that is not in sync: what readiness, `/readyz`, `check` and refused writes say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchProblem {
    /// e.g. `machines.cluster.x-k8s.io`, `nodes`.
    pub resource: String,
    /// Forbidden (403) or not found (404).
    pub fatal: bool,
    pub message: String,
}

impl std::fmt::Display for WatchProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "watch of {}: {}", self.resource, self.message)
    }
}

/// What a watch problem says: why it is out of sync, since when.
fn describe(health: &WatchHealth, now: Instant, stale_after: Duration) -> Option<(bool, String)> {
    let secs = |since: Instant| now.saturating_duration_since(since).as_secs();
    match (&health.failure, health.listed) {
        (None, true) => None,
        (None, false) => Some((
            false,
            format!("has not listed yet (waiting {}s)", secs(health.started)),
        )),
        (Some(f), listed) => {
            let stale = f.fatal || now.saturating_duration_since(f.since) >= stale_after;
            if listed && !stale {
                return None;
            }
            let what = if listed {
                "out of sync"
            } else {
                "has not listed yet"
            };
            let hint = if f.fatal {
                " (not transient: fix the RBAC rules or serve the resource; retried meanwhile)"
            } else {
                ""
            };
            Some((
                f.fatal,
                format!(
                    "{what}, failing for {}s: {}{hint}",
                    secs(f.since),
                    f.message
                ),
            ))
        }
    }
}

impl Store {
    /// Every required watch has listed once.
    pub(super) fn required_watches_listed(&self) -> bool {
        lock(&self.health).values().all(|h| h.listed || !h.required)
    }

    /// The required watches that have not listed yet or are stale (failing for longer than the
    /// stale bound, or forbidden / not found at all).
    pub fn watch_problems(&self) -> Vec<WatchProblem> {
        let now = Instant::now();
        let stale_after = self.watch_settings.stale_after;
        lock(&self.health)
            .iter()
            .filter(|(_, h)| h.required)
            .filter_map(|(name, h)| {
                describe(h, now, stale_after).map(|(fatal, message)| WatchProblem {
                    resource: name.clone(),
                    fatal,
                    message,
                })
            })
            .collect()
    }

    /// The stale watches a write to a group of `kind` depends on: its own kind, MachineSets (a
    /// MachineDeployment's rollout), Machines (which nodes are whose, which are marked).
    pub fn stale_for_write(&self, kind: ScalableKind) -> Vec<WatchProblem> {
        let mut needed: Vec<String> = vec![resource_name(&self.apis.machine)];
        for k in [kind, ScalableKind::MachineSet] {
            if let Some(resource) = self.apis.scalable.get(&k) {
                needed.push(resource_name(resource));
            }
        }
        self.watch_problems()
            .into_iter()
            .filter(|p| needed.contains(&p.resource))
            .collect()
    }

    /// Resolves at the next failure or recovery of a watch.
    pub async fn health_changed(&self) {
        self.health_changed.notified().await;
    }

    /// Sets `watch_stale_seconds` of every watch to now.
    pub fn publish_watch_metrics(&self) {
        self.metrics.ready(self.not_ready_reasons().is_empty());
        let now = Instant::now();
        for (name, h) in lock(&self.health).iter() {
            let since = match (&h.failure, h.listed) {
                (Some(f), _) => Some(f.since),
                (None, false) => Some(h.started),
                (None, true) => None,
            };
            let seconds = since.map_or(0.0, |s| now.saturating_duration_since(s).as_secs_f64());
            self.metrics.watch_stale(name, seconds);
        }
    }

    pub(super) fn register_watch(&self, name: &str, required: bool) {
        lock(&self.health)
            .entry(name.to_string())
            .or_insert_with(|| WatchHealth {
                required,
                started: Instant::now(),
                listed: false,
                failure: None,
            });
    }

    /// A complete list arrived: the watch is in sync again.
    pub(super) fn watch_synced(&self, name: &str) {
        let recovered = {
            let mut health = lock(&self.health);
            let Some(h) = health.get_mut(name) else {
                return;
            };
            h.listed = true;
            h.failure.take()
        };
        if let Some(f) = recovered {
            tracing::info!(watch = name, after = ?f.since.elapsed(), "watch in sync again (was failing: {})", f.message);
            self.health_changed.notify_waiters();
        }
    }

    /// The watch failed; it is started again after a pause. Logged when the failure starts or
    /// changes, at error level when it is forbidden or not found.
    pub(super) fn watch_failed(&self, name: &str, message: String, fatal: bool) {
        let changed = {
            let mut health = lock(&self.health);
            let Some(h) = health.get_mut(name) else {
                return;
            };
            match &mut h.failure {
                Some(f) if f.message == message => false,
                Some(f) => {
                    f.message = message.clone();
                    f.fatal = fatal;
                    true
                }
                None => {
                    h.failure = Some(WatchFailure {
                        since: Instant::now(),
                        message: message.clone(),
                        fatal,
                    });
                    true
                }
            }
        };
        if changed {
            if fatal {
                tracing::error!(
                    watch = name,
                    "watch failed, not a transient error: {message}; the provider is not ready until it is fixed"
                );
            } else {
                tracing::warn!(watch = name, "watch failed: {message}; retrying");
            }
            self.health_changed.notify_waiters();
        } else {
            tracing::debug!(watch = name, "watch failed again: {message}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(listed: bool, failure: Option<(u64, &str, bool)>, now: Instant) -> WatchHealth {
        WatchHealth {
            required: true,
            started: now - Duration::from_secs(100),
            listed,
            failure: failure.map(|(ago, message, fatal)| WatchFailure {
                since: now - Duration::from_secs(ago),
                message: message.to_string(),
                fatal,
            }),
        }
    }

    /// A store with no watches, over a client that is never called.
    #[test]
    fn a_watch_is_stale_after_the_bound_or_at_once_when_forbidden() {
        let now = Instant::now();
        let bound = Duration::from_secs(60);
        // In sync.
        assert_eq!(describe(&health(true, None, now), now, bound), None);
        // A transient error within the bound: still in sync as far as readiness goes.
        assert_eq!(
            describe(
                &health(true, Some((59, "connection refused", false)), now),
                now,
                bound
            ),
            None
        );
        // Past the bound: stale, with how long and why.
        let (fatal, text) = describe(
            &health(true, Some((61, "connection refused", false)), now),
            now,
            bound,
        )
        .unwrap();
        assert!(!fatal);
        assert!(
            text.contains("failing for 61s: connection refused"),
            "{text}"
        );
        // Forbidden: at once.
        let (fatal, text) = describe(
            &health(true, Some((0, "machines is forbidden (403)", true)), now),
            now,
            bound,
        )
        .unwrap();
        assert!(fatal);
        assert!(text.contains("machines is forbidden (403)"), "{text}");
        // Never listed: a problem whatever the error, saying so.
        let (_, text) = describe(&health(false, None, now), now, bound).unwrap();
        assert!(text.contains("has not listed yet"), "{text}");
        let (_, text) =
            describe(&health(false, Some((1, "timeout", false)), now), now, bound).unwrap();
        assert!(
            text.contains("has not listed yet, failing for 1s: timeout"),
            "{text}"
        );
    }
}
