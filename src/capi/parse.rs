//! JSON of Cluster API objects (v1beta1 or v1beta2) → the typed views in `capi`.
use std::fmt;

/// A field of an object that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParseError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for ParseError {}
