//! A problem found in the objects the provider reads: which object, which field, what is wrong.
//! Problems never stop the provider; they are logged, counted, recorded as Events and shown by `check`.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Problem {
    /// e.g. `MachineDeployment default/md-0`.
    pub object: String,
    /// e.g. `metadata.annotations[cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size]`.
    pub field: String,
    pub message: String,
}

impl Problem {
    pub fn new(
        object: impl Into<String>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Problem {
            object: object.into(),
            field: field.into(),
            message: message.into(),
        }
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
