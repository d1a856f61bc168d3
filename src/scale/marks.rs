//! The delete-machine mark on a Machine: written guarded by the version decided from, taken back
//! restoring what the Machine carried before.

use std::time::Instant;

use kube::api::Patch;
use serde_json::json;

use super::api::{ApiFailure, call, write_params};
use super::{Actuator, now_unix};
use crate::backend::ActuatorError;
use crate::capi::ObjectKey;
use crate::removal::{Ledger, our_mark};

impl Actuator {
    /// Writes our mark on Machine `key`, dated after every ledger entry of it, guarded by the
    /// version the decision saw: two providers removing one node at once would otherwise both
    /// mark it, each with its own time, and both pay. `false`: the Machine changed since (nothing
    /// written).
    pub(super) async fn mark(
        &self,
        key: &ObjectKey,
        delete_key: &str,
        ledger: &Ledger,
    ) -> Result<bool, ActuatorError> {
        let api = self.machine_api(&key.namespace);
        let what = format!("marking Machine {key} for deletion");
        let mark_time = ledger.fresh_mark_time(&key.name, now_unix());
        let mut patch = json!({"metadata": {"annotations": {delete_key: our_mark(mark_time)}}});
        if let Some(machine) = self.store.cached_machine(key) {
            patch["metadata"]["resourceVersion"] = json!(machine.resource_version);
        }
        match self
            .patch_counted(&api, &key.name, &patch, &what, "mark-machine")
            .await
        {
            Ok(marked) => {
                self.store.record(None, marked);
                Ok(true)
            }
            Err(ApiFailure::Conflict) => Ok(false),
            Err(ApiFailure::Other(e)) => Err(e),
        }
    }

    /// Marks each Machine `mark` of `namespace` in turn ([`Actuator::mark`]), adding to `written`
    /// each one marked with the value it carried before (`marks`). `Some(key)`: Machine `key`
    /// changed since the decision (nothing written to it, the rest not marked); an error leaves
    /// `written` for the caller to take back.
    pub(super) async fn mark_each(
        &self,
        namespace: &str,
        mark: &[String],
        marks: &[(String, Option<String>)],
        delete_key: &str,
        ledger: &Ledger,
        written: &mut Vec<(ObjectKey, Option<String>)>,
    ) -> Result<Option<ObjectKey>, ActuatorError> {
        for name in mark {
            let key = ObjectKey::new(namespace, name.as_str());
            let previous = marks
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, v)| v.clone());
            if !self.mark(&key, delete_key, ledger).await? {
                return Ok(Some(key));
            }
            if !written.iter().any(|(k, _)| *k == key) {
                written.push((key, previous));
            }
        }
        Ok(None)
    }

    /// Takes back the marks this call wrote, each restoring what the Machine carried before.
    pub(super) async fn take_back(
        &self,
        written: &[(ObjectKey, Option<String>)],
        delete_key: &str,
    ) {
        for (key, previous) in written {
            self.unmark(key, delete_key, previous.as_deref(), None)
                .await;
        }
    }

    /// Takes our mark back (restoring `previous`). With `resource_version`, only from that version of
    /// the Machine, so a mark set again meanwhile is left alone.
    pub(super) async fn unmark(
        &self,
        key: &ObjectKey,
        delete_key: &str,
        previous: Option<&str>,
        resource_version: Option<&str>,
    ) -> bool {
        let api = self.machine_api(&key.namespace);
        let what = format!("taking back the delete mark of Machine {key}");
        let mut unmark = json!({"metadata": {"annotations": {delete_key: previous}}});
        if let Some(rv) = resource_version {
            unmark["metadata"]["resourceVersion"] = json!(rv);
        }
        let started = Instant::now();
        match call(
            &what,
            api.patch(&key.name, &write_params(), &Patch::Merge(&unmark)),
        )
        .await
        {
            Ok(obj) => {
                self.metrics
                    .api_write("unmark-machine", "ok", started.elapsed());
                self.store.record(None, obj);
                true
            }
            Err(ApiFailure::Other(ActuatorError::NotFound(_))) => true,
            Err(e) => {
                self.metrics
                    .api_write("unmark-machine", "error", started.elapsed());
                tracing::warn!(machine = %key, "{what} failed: {e:?}; the repair retries it");
                false
            }
        }
    }
}
