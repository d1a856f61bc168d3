//! Kubernetes Events on the objects the store caches: configuration problems, scale-ups held by
//! preflight checks, and what the actuator records on Machines and groups.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::ApiResource;

use super::Store;
use crate::capi::{ObjectKey, ScalableKind};
use crate::lock;
use crate::problem::{ObjectRef, Problem};
use crate::snapshot::Snapshot;

impl Store {
    /// Records the snapshot's problems and held scale-ups as Events on their objects, each once
    /// while it lasts.
    pub(super) fn report_to_objects(&self, snapshot: &Snapshot) {
        self.events
            .report(&snapshot.problems, |p| self.event_reference(p));
        self.events
            .report_holds(&held_scale_ups(snapshot), |id| self.group_reference(id));
    }

    /// Records a Warning Event on a cached Machine (no-op for read-only uses).
    pub fn machine_event(&self, key: &ObjectKey, reason: &str, note: String) {
        let Some(uid) = lock(&self.index).machine(key).map(|m| m.uid.clone()) else {
            return;
        };
        let reference = object_reference(&self.apis.machine, key.clone(), uid);
        self.events
            .warn(reference, reason, reason.to_string(), &note);
    }

    /// Records a Normal Event on a cached group object (no-op for read-only uses).
    pub fn group_event(
        &self,
        kind: ScalableKind,
        key: &ObjectKey,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let Some(uid) = lock(&self.index).resource(kind, key).map(|r| r.uid.clone()) else {
            return;
        };
        let Some(resource) = self.apis.scalable.get(&kind) else {
            return;
        };
        let reference = object_reference(resource, key.clone(), uid);
        self.events
            .normal(reference, reason, action.to_string(), &note);
    }

    /// The object of group `id` (`Kind/namespace/name`), for an Event.
    fn group_reference(&self, id: &str) -> Option<ObjectReference> {
        let group = crate::snapshot::GroupId::parse(id)?;
        let key = group.key();
        let uid = lock(&self.index).resource(group.kind, &key)?.uid.clone();
        Some(object_reference(
            self.apis.scalable.get(&group.kind)?,
            key,
            uid,
        ))
    }

    /// The object a problem is about, when it is one the provider watches.
    fn event_reference(&self, problem: &Problem) -> Option<ObjectReference> {
        let ObjectRef { kind, key } = problem.object.object_ref()?;
        let index = lock(&self.index);
        let (uid, resource) = if let Some(kind) = ScalableKind::from_kind(kind) {
            let r = index.resource(kind, key)?;
            (r.uid.clone(), self.apis.scalable.get(&kind)?)
        } else if kind == "Machine" {
            (index.machine(key)?.uid.clone(), &self.apis.machine)
        } else {
            return None;
        };
        Some(object_reference(resource, key.clone(), uid))
    }
}

/// The groups whose scale-up Cluster API's preflight checks hold back (with instances reported as
/// failed to create), with what their Event says.
fn held_scale_ups(snapshot: &Snapshot) -> Vec<(String, String)> {
    snapshot
        .groups
        .values()
        .filter_map(|g| {
            let hold = g.preflight.as_ref()?;
            let held = g
                .instances
                .iter()
                .filter(|i| crate::capi::preflight::is_held_id(&i.id))
                .count();
            (held > 0).then(|| {
                (
                    g.id.clone(),
                    format!(
                        "{held} replica(s) reported to the cluster-autoscaler as failed to create: {}",
                        hold.message
                    ),
                )
            })
        })
        .collect()
}

fn object_reference(resource: &ApiResource, key: ObjectKey, uid: String) -> ObjectReference {
    ObjectReference {
        api_version: Some(resource.api_version.clone()),
        kind: Some(resource.kind.clone()),
        name: Some(key.name.into()),
        namespace: Some(key.namespace.into()),
        uid: Some(uid),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{md, unwatched_store};
    use super::*;
    use crate::cache::writer::{self as index, Watched};
    use crate::problem::Subject;

    #[tokio::test]
    async fn a_problem_is_recorded_on_the_cached_object_it_names() {
        let store = unwatched_store();
        let keys = store.settings.keys.clone();
        let scalable = Watched::Scalable(ScalableKind::MachineDeployment);
        index::apply(&mut lock(&store.index), &keys, &scalable, md(2, "10"));
        let problem = |object: Subject| Problem::new(object, "spec.replicas", "not set");
        let md_key = ObjectKey::new("ns", "md");
        let expected = ObjectReference {
            api_version: Some("cluster.x-k8s.io/v1beta2".into()),
            kind: Some("MachineDeployment".into()),
            namespace: Some("ns".into()),
            name: Some("md".into()),
            uid: Some("uid-md".into()),
            ..Default::default()
        };
        assert_eq!(
            store.event_reference(&problem(Subject::object("MachineDeployment", &md_key))),
            Some(expected.clone())
        );
        assert_eq!(
            store.group_reference("MachineDeployment/ns/md"),
            Some(expected)
        );
        // Not cached, of a kind no Event is recorded on, or not an object: nothing to record on.
        for object in [
            Subject::object("MachineDeployment", &ObjectKey::new("ns", "gone")),
            Subject::object("Cluster", &md_key),
            Subject::Other("MachineDeployment ns/md".into()),
        ] {
            assert_eq!(
                store.event_reference(&problem(object.clone())),
                None,
                "{object}"
            );
        }
    }
}
