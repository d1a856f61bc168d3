//! A problem found in the objects the provider reads: which object, which field, what is wrong.
//! Problems never stop the provider; they are logged, counted, recorded as Events and shown by `check`.

use std::fmt;

use crate::capi::PRICE_ANNOTATION;
use crate::capi::rollout::REVISION_ANNOTATION;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Problem {
    /// e.g. `MachineDeployment default/md-0`.
    pub object: String,
    /// e.g. `metadata.annotations[cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size]`.
    pub field: String,
    pub message: String,
    /// What the problem is about: the `kind` label of the `problems` metric, so an alert or a
    /// dashboard can tell a typo in a capacity annotation from a group of another Cluster.
    pub kind: ProblemKind,
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
        object: impl Into<String>,
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
}
