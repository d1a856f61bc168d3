//! The repair loop: every interval, a round of the protocol's repair (`crate::protocol::Repair`) on
//! each group whose cached objects show something to settle, take back or clean; confirmed from
//! the API by the round's own fresh read. Records of a removal (a claim, an unrecorded mark, a
//! taking-back entry on a Machine without its mark) are left alone until they are
//! `--mark-grace-period` old on the API server's clock (`crate::server_clock`; a record's stamp is
//! its removal's start on it): longer than a removal may still mark in (the shell marks only
//! within `--request-timeout` of the call), so a removal in flight on another provider is never
//! taken back under it, and a provider that just started ages records as one that saw them
//! written. This duration is one the protocol counts on: a claim dropped under a removal that then
//! marks lets Cluster API delete that Machine for another removal's decrement (the model checker
//! finds it when a repair may take back what an operation holds). A MachinePool instance's entry
//! carries no stamp: it waits the grace period from when this provider first saw it unlisted.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Actuator;
use super::execute::Caller;
use crate::lock;
use crate::protocol::ledger::{CLAIMS_ANNOTATION, LEDGER_ANNOTATION, TAKING_BACK_ANNOTATION};
use crate::protocol::{Next, Operation, Repair, RepairAction, Ripe, has_stamp, repair_has_work};
use crate::server_clock::whole_secs;

/// When each waiting record with no stamp was first seen, by group and entry.
pub(super) type Waiting = HashMap<(String, String), Instant>;

impl Actuator {
    /// One round over every group with records or marks ([`repair_has_work`]: the others have
    /// nothing a round could write); the number of marks taken back and removals settled.
    pub async fn repair(&self, grace: Duration) -> usize {
        self.store.refresh();
        let snapshot = self.store.snapshot();
        let mut repaired = 0;
        for (id, served) in snapshot.groups.iter() {
            let records = [LEDGER_ANNOTATION, CLAIMS_ANNOTATION, TAKING_BACK_ANNOTATION]
                .map(|key| served.resource.annotations.get(key));
            if !repair_has_work(records, served.marked) {
                // Nothing waits on it any more.
                self.saw(id, &BTreeSet::new());
                continue;
            }
            // Between two groups looked at, CA's calls waiting for this worker thread go first.
            tokio::task::yield_now().await;
            let group_lock = self.group_lock(&snapshot, id);
            let guard = group_lock.lock().await;
            // Fresh after taking the lock: an operation that just finished has recorded its writes.
            self.store.refresh();
            let current = self.store.snapshot();
            let Some(group) = current.group(id).cloned() else {
                continue;
            };
            let ripe = self.ripe(id, grace);
            // The cache first: no API call for a group with nothing to do.
            let Ok(cached) = self.cached_read(id, &group) else {
                continue;
            };
            let mut look = Repair::new(ripe.clone());
            let would_write = matches!(look.read(&cached), Next::Write(_));
            self.saw(id, look.seen());
            if !would_write {
                continue;
            }
            // The repair decides again from its own fresh read, under the lock again.
            drop(guard);
            let mut op = Operation::Repair(Repair::new(ripe));
            if let Err(e) = self
                .execute(
                    id,
                    &group,
                    Caller::Repair,
                    &mut op,
                    &group_lock,
                    Instant::now(),
                )
                .await
            {
                tracing::debug!(group = %id, "repair postponed: {e}");
            }
            let Operation::Repair(done) = &op else {
                continue;
            };
            self.saw(id, done.seen());
            repaired += self.report(&group, done.actions());
        }
        repaired
    }

    /// Records of `id` at least `grace` old: by their stamps on the API server's clock; those
    /// with none, by how long this provider has seen them waiting.
    fn ripe(&self, id: &str, grace: Duration) -> Ripe {
        let waiting = lock(&self.waiting);
        let unstamped = waiting
            .iter()
            .filter(|((group, _), since)| group == id && since.elapsed() >= grace)
            .map(|((_, entry), _)| entry.clone())
            .collect();
        Ripe::Aged {
            now: self.store.server_clock().now(),
            grace: whole_secs(grace),
            unstamped,
        }
    }

    /// Starts the clock of records with no stamp seen waiting for the first time; stops it for
    /// those no longer.
    fn saw(&self, id: &str, seen: &BTreeSet<String>) {
        let mut waiting = lock(&self.waiting);
        waiting.retain(|(group, entry), _| group != id || seen.contains(entry));
        for entry in seen.iter().filter(|e| !has_stamp(e)) {
            waiting
                .entry((id.to_string(), entry.clone()))
                .or_insert_with(Instant::now);
        }
    }

    /// Logs, counts and records as Events what a round did; how many marks it took back or
    /// removals it settled.
    fn report(&self, group: &crate::snapshot::NodeGroup, actions: &[RepairAction]) -> usize {
        let mut count = 0;
        for action in actions {
            let note = match action {
                RepairAction::Settled(entries) => {
                    count += entries.len();
                    format!(
                        "{}: removals Cluster API already carried out settled: {}",
                        group.id,
                        entries.join(", ")
                    )
                }
                RepairAction::Recorded(entries) => format!(
                    "{}: delete marks being taken back (a removal that stopped part-way, or a raise absorbed its decrement): {}",
                    group.id,
                    entries.join(", ")
                ),
                RepairAction::Unmarked(machine) => {
                    count += 1;
                    self.metrics.mark_repaired();
                    let key = super::read::machine_key(group, machine);
                    let note = format!(
                        "{}: delete mark taken back: the replicas of {} do not pay for it (a removal that stopped part-way, or a raise absorbed its decrement); the node stays",
                        group.id, group.resource.key
                    );
                    self.store
                        .machine_event(&key, "DeleteMarkRepaired", note.clone());
                    note
                }
                RepairAction::DroppedStale(entries) => format!(
                    "{}: claims of removals that stopped before marking dropped: {}",
                    group.id,
                    entries.join(", ")
                ),
                RepairAction::Cleaned => continue,
            };
            tracing::warn!(group = %group.id, "{note}");
        }
        count
    }

    /// Runs [`Actuator::repair`] now and then every `interval`.
    pub fn spawn_repair(self: &Arc<Self>, interval: Duration, grace: Duration) {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                if me.store.is_ready() {
                    me.repair(grace).await;
                }
                tokio::time::sleep(interval).await;
            }
        });
    }
}
