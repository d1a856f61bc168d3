//! A problem found in the objects the provider reads: which object, which field, what is wrong.
//! Problems never stop the provider; they are logged, counted, recorded as Events and shown by `check`.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};

use crate::capi::rollout::REVISION_ANNOTATION;
use crate::capi::{ObjectKey, PRICE_ANNOTATION};
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Problem {
    /// e.g. `MachineDeployment default/md-0`.
    pub object: Subject,
    /// e.g. `metadata.annotations[cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size]`.
    pub field: String,
    pub message: String,
    /// What the problem is about: the `kind` label of the `problems` metric, so an alert or a
    /// dashboard can tell a typo in a capacity annotation from a group of another Cluster.
    pub kind: ProblemKind,
}

/// What a problem names: a Kubernetes object, on which an Event can be recorded, or something
/// else said in words (a flag of the provider). Shown as `Kind namespace/name` or as its words;
/// compared, ordered and hashed as shown, so problems sort and deduplicate as their text does.
#[derive(Clone, Debug)]
pub enum Subject {
    /// Boxed, so a `Problem` stays small enough to be the error of a `Result`.
    Object(Box<ObjectRef>),
    Other(String),
}

/// A namespaced Kubernetes object: its kind (`MachineDeployment`, `Machine`, `Cluster`, an
/// infrastructure template's kind), namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectRef {
    pub kind: String,
    pub key: ObjectKey,
}

impl Subject {
    /// The object of `kind` at `key`.
    pub fn object(kind: impl fmt::Display, key: &ObjectKey) -> Subject {
        Subject::Object(Box::new(ObjectRef {
            kind: kind.to_string(),
            key: key.clone(),
        }))
    }

    /// The Kubernetes object named, if it is one.
    pub fn object_ref(&self) -> Option<&ObjectRef> {
        match self {
            Subject::Object(object) => Some(object),
            Subject::Other(_) => None,
        }
    }

    /// The pieces of the text shown, in order: compared without building the text.
    fn shown(&self) -> [&str; 5] {
        match self {
            Subject::Object(o) => [&o.kind, " ", &o.key.namespace, "/", &o.key.name],
            Subject::Other(text) => [text, "", "", "", ""],
        }
    }

    fn shown_bytes(&self) -> impl Iterator<Item = u8> + '_ {
        self.shown().into_iter().flat_map(str::bytes)
    }
}

impl fmt::Display for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.shown().iter().try_for_each(|piece| f.write_str(piece))
    }
}

impl PartialEq for Subject {
    fn eq(&self, other: &Self) -> bool {
        self.shown_bytes().eq(other.shown_bytes())
    }
}

impl Eq for Subject {}

impl PartialOrd for Subject {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Subject {
    fn cmp(&self, other: &Self) -> Ordering {
        self.shown_bytes().cmp(other.shown_bytes())
    }
}

impl Hash for Subject {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `str` hashes, so equal text hashes equal whichever way it is held.
        self.shown_bytes().for_each(|b| state.write_u8(b));
        state.write_u8(0xff);
    }
}

impl PartialEq<str> for Subject {
    fn eq(&self, other: &str) -> bool {
        self.shown_bytes().eq(other.bytes())
    }
}

impl PartialEq<&str> for Subject {
    fn eq(&self, other: &&str) -> bool {
        *self == **other
    }
}

impl PartialEq<String> for Subject {
    fn eq(&self, other: &String) -> bool {
        *self == *other.as_str()
    }
}

impl serde::Serialize for Subject {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl From<ObjectRef> for Subject {
    fn from(object: ObjectRef) -> Self {
        Subject::Object(Box::new(object))
    }
}

impl From<&Subject> for Subject {
    fn from(subject: &Subject) -> Self {
        subject.clone()
    }
}

/// Words only: no Event can be recorded on what they name.
impl From<&str> for Subject {
    fn from(text: &str) -> Self {
        Subject::Other(text.to_string())
    }
}

/// What a problem is about: a small fixed set, so it can label a metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProblemKind {
    /// The min/max size annotations.
    Bounds,
    /// `spec.replicas` unset, or set by the Cluster's managed topology too.
    Replicas,
    /// The group or its Cluster is paused.
    Paused,
    /// The group is of another Cluster than the one served, or discovery names another Cluster.
    Scope,
    /// `autoscaling-options-*` annotations.
    Options,
    /// Scale-from-zero capacity: the capacity annotations, the template's `status.capacity`.
    Capacity,
    /// The node template otherwise: infrastructure reference, taints, default architecture.
    Template,
    /// The hourly price annotation.
    Price,
    /// A MachineSet's revision, which a rollout is judged by.
    Rollout,
    /// An instance claimed by two groups.
    Instance,
    /// An object that could not be read at all.
    Malformed,
    Other,
}

impl ProblemKind {
    pub const ALL: [ProblemKind; 12] = [
        ProblemKind::Bounds,
        ProblemKind::Replicas,
        ProblemKind::Paused,
        ProblemKind::Scope,
        ProblemKind::Options,
        ProblemKind::Capacity,
        ProblemKind::Template,
        ProblemKind::Price,
        ProblemKind::Rollout,
        ProblemKind::Instance,
        ProblemKind::Malformed,
        ProblemKind::Other,
    ];

    pub fn label(self) -> &'static str {
        match self {
            ProblemKind::Bounds => "bounds",
            ProblemKind::Replicas => "replicas",
            ProblemKind::Paused => "paused",
            ProblemKind::Scope => "scope",
            ProblemKind::Options => "options",
            ProblemKind::Capacity => "capacity",
            ProblemKind::Template => "template",
            ProblemKind::Price => "price",
            ProblemKind::Rollout => "rollout",
            ProblemKind::Instance => "instance",
            ProblemKind::Malformed => "malformed",
            ProblemKind::Other => "other",
        }
    }

    /// The kind of a problem with `field`, for the fields whose meaning is one kind (an annotation,
    /// a spec field); [`Problem::with_kind`] says it where one field serves several (a Cluster
    /// named by `spec.clusterName` may be another one, or paused).
    pub fn of_field(field: &str) -> ProblemKind {
        if let Some(key) = field
            .strip_prefix("metadata.annotations[")
            .and_then(|k| k.strip_suffix(']'))
        {
            return if key.ends_with("-node-group-min-size") || key.ends_with("-node-group-max-size")
            {
                ProblemKind::Bounds
            } else if key.contains("/autoscaling-options-") {
                ProblemKind::Options
            } else if key.starts_with("capacity.cluster-autoscaler.kubernetes.io/") {
                ProblemKind::Capacity
            } else if key == PRICE_ANNOTATION {
                ProblemKind::Price
            } else if key == REVISION_ANNOTATION {
                ProblemKind::Rollout
            } else if key.ends_with("/paused") {
                ProblemKind::Paused
            } else {
                ProblemKind::Other
            };
        }
        let head = field.split(['[', '.', ':']).collect::<Vec<_>>();
        match head.as_slice() {
            ["spec", "replicas", ..] | ["spec", "topology", ..] => ProblemKind::Replicas,
            ["spec", "clusterName", ..] | ["clusterName", ..] => ProblemKind::Scope,
            ["status", "capacity", ..] => ProblemKind::Capacity,
            ["spec", "template", ..] | ["CAPI_SCALE_ZERO_DEFAULT_ARCH", ..] => {
                ProblemKind::Template
            }
            ["spec", "providerID", ..] => ProblemKind::Instance,
            _ => ProblemKind::Other,
        }
    }
}

impl Problem {
    pub fn new(
        object: impl Into<Subject>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        let field = field.into();
        Problem {
            object: object.into(),
            kind: ProblemKind::of_field(&field),
            field,
            message: message.into(),
        }
    }

    /// The same problem, of `kind` (where its field alone does not say).
    pub fn with_kind(mut self, kind: ProblemKind) -> Self {
        self.kind = kind;
        self
    }

    /// The field path of an annotation.
    pub fn annotation_field(key: &str) -> String {
        format!("metadata.annotations[{key}]")
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.object, self.field, self.message)
    }
}

/// The longest prefix of `text` of at most `max` bytes that ends at a character boundary: how
/// messages are cut to fit an Event note or a status message.
pub fn cut(text: &str, max: usize) -> &str {
    let mut end = max.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kind_follows_the_field() {
        for (field, kind) in [
            (
                "metadata.annotations[cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size]",
                ProblemKind::Bounds,
            ),
            (
                "metadata.annotations[cluster.example.dev/cluster-api-autoscaler-node-group-min-size]",
                ProblemKind::Bounds,
            ),
            (
                "metadata.annotations[cluster.x-k8s.io/autoscaling-options-scaledownunneededtime]",
                ProblemKind::Options,
            ),
            (
                "metadata.annotations[capacity.cluster-autoscaler.kubernetes.io/memory]",
                ProblemKind::Capacity,
            ),
            ("status.capacity[cpu]", ProblemKind::Capacity),
            (
                "metadata.annotations[capi-autoscaler-provider/hourly-price]",
                ProblemKind::Price,
            ),
            (
                "metadata.annotations[machinedeployment.clusters.x-k8s.io/revision]",
                ProblemKind::Rollout,
            ),
            (
                "metadata.annotations[cluster.x-k8s.io/paused]",
                ProblemKind::Paused,
            ),
            ("spec.replicas", ProblemKind::Replicas),
            (
                "spec.topology.workers.machineDeployments[0].replicas",
                ProblemKind::Replicas,
            ),
            ("spec.clusterName", ProblemKind::Scope),
            ("clusterName", ProblemKind::Scope),
            (
                "spec.template.spec.infrastructureRef: kind",
                ProblemKind::Template,
            ),
            ("spec.template.spec.taints[2]", ProblemKind::Template),
            ("CAPI_SCALE_ZERO_DEFAULT_ARCH", ProblemKind::Template),
            ("spec.providerID", ProblemKind::Instance),
            ("metadata.annotations[example.com/else]", ProblemKind::Other),
            ("spec.selector", ProblemKind::Other),
        ] {
            assert_eq!(Problem::new("o", field, "m").kind, kind, "{field}");
        }
    }

    #[test]
    fn kind_labels_are_distinct_and_listed() {
        let labels: std::collections::BTreeSet<&str> =
            ProblemKind::ALL.iter().map(|k| k.label()).collect();
        assert_eq!(labels.len(), ProblemKind::ALL.len());
        assert_eq!(
            Problem::new("o", "spec.clusterName", "m")
                .with_kind(ProblemKind::Paused)
                .kind,
            ProblemKind::Paused
        );
    }

    fn object(kind: &str, namespace: &str, name: &str) -> Subject {
        Subject::object(kind, &ObjectKey::new(namespace, name))
    }

    #[test]
    fn an_object_is_shown_as_kind_namespace_and_name_and_referenced_as_such() {
        let md = object("MachineDeployment", "ns", "md-0");
        assert_eq!(md.to_string(), "MachineDeployment ns/md-0");
        assert_eq!(
            md.object_ref(),
            Some(&ObjectRef {
                kind: "MachineDeployment".into(),
                key: ObjectKey::new("ns", "md-0"),
            })
        );
        let flag = Subject::Other("--node-group-auto-discovery clusterapi:".into());
        assert_eq!(flag.to_string(), "--node-group-auto-discovery clusterapi:");
        assert_eq!(flag.object_ref(), None);
        assert_eq!(
            serde_json::to_value(Problem::new(md, "spec.replicas", "not set")).unwrap()["object"],
            "MachineDeployment ns/md-0"
        );
    }

    #[test]
    fn subjects_compare_order_and_hash_as_their_text() {
        use std::collections::hash_map::DefaultHasher;
        let hash = |s: &Subject| {
            let mut h = DefaultHasher::new();
            s.hash(&mut h);
            h.finish()
        };
        let md = object("MachineDeployment", "ns", "md");
        let words = Subject::Other("MachineDeployment ns/md".into());
        assert_eq!(md, words);
        assert_eq!(hash(&md), hash(&words));
        assert_eq!(md, "MachineDeployment ns/md");
        assert_ne!(md, object("MachineDeployment", "ns", "md2"));
        // `/` sorts after `-`: the text's order, not the fields' (where `a` < `a-b`).
        let subjects = [
            object("Machine", "a", "m"),
            object("Machine", "a-b", "m"),
            object("MachineDeployment", "a", "m"),
            object("MachineSet", "a", "m"),
            Subject::Other("--node-group-auto-discovery x".into()),
        ];
        let mut sorted = subjects.to_vec();
        sorted.sort();
        let mut texts: Vec<String> = subjects.iter().map(ToString::to_string).collect();
        texts.sort();
        assert_eq!(
            sorted.iter().map(ToString::to_string).collect::<Vec<_>>(),
            texts
        );
    }
}
