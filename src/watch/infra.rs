//! Infrastructure template kinds: watched once a group references them, looked up again while
//! their kind is not served.

use std::sync::Arc;

use super::Store;
use super::stream::{RESTART_LONGEST, restart_backoff};
use crate::apis::{infra_resource, resource_name};
use crate::cache::writer::Watched;
use crate::cache::{InfraKind, InfraKindState};
use crate::lock;

impl Store {
    pub(super) fn infra_settled(&self) -> bool {
        let index = lock(&self.index);
        index.wanted_infra_kinds().is_empty()
            && lock(&self.infra_started).iter().all(|k| {
                !matches!(
                    index.infra_kind_state(k),
                    Some(InfraKindState::Syncing) | None
                )
            })
    }

    /// Watches the infrastructure template kinds the objects reference and nothing watches yet.
    pub(super) fn start_referenced_infra_watches(self: &Arc<Self>) {
        let wanted = lock(&self.index).wanted_infra_kinds();
        for kind in wanted {
            self.start_infra_watch(kind);
        }
    }

    fn start_infra_watch(self: &Arc<Self>, kind: InfraKind) {
        if !lock(&self.infra_started).insert(kind.clone()) {
            return;
        }
        lock(&self.index).set_infra_kind_state(kind.clone(), InfraKindState::Syncing);
        let store = Arc::clone(self);
        tokio::spawn(async move {
            // The kind may be served later (its CRD installed after the reference): keep looking.
            let mut backoff = restart_backoff();
            let resource = loop {
                match infra_resource(&store.client, &kind).await {
                    Ok(resource) => break resource,
                    Err(reason) => {
                        let delay = backoff.next().unwrap_or(RESTART_LONGEST);
                        tracing::warn!(kind = %kind.kind, group = %kind.api_group, retry_in = ?delay, "infrastructure templates unavailable: {reason}");
                        let changed = lock(&store.index).infra_kind_state(&kind)
                            != Some(&InfraKindState::Unavailable(reason.clone()));
                        if changed {
                            lock(&store.index).set_infra_kind_state(
                                kind.clone(),
                                InfraKindState::Unavailable(reason),
                            );
                            store.wake_rebuild();
                        }
                        tokio::time::sleep(delay).await;
                    }
                }
            };
            let api = store.watch_api(&resource);
            let name = resource_name(&resource);
            store.register_watch(&name, false);
            store.watch(Watched::Infra(kind), api, name).await;
        });
    }
}
