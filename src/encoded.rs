//! A value's wire encoding, made the first time an answer needs it and shared by every later answer.
//!
//! Snapshot parts (a group, a template) are shared by every snapshot they did not change in, so each
//! is encoded once per change rather than once per call. The bytes are made from the value they are
//! kept in, by the gRPC layer, which alone knows the wire.

use std::sync::OnceLock;

use prost::bytes::Bytes;

/// The encoding of the value this is a field of, once made. A clone starts empty: a cloned value
/// may be changed before it is answered, and its encoding is then another.
#[derive(Default)]
pub struct Encoded(OnceLock<Bytes>);

impl Encoded {
    /// The bytes `encode` makes, made on the first call only; every later call shares them.
    pub fn get_or_encode(&self, encode: impl FnOnce() -> Vec<u8>) -> Bytes {
        self.0.get_or_init(|| encode().into()).clone()
    }

    /// Whether the bytes were made.
    #[cfg(test)]
    pub fn is_encoded(&self) -> bool {
        self.0.get().is_some()
    }
}

impl Clone for Encoded {
    fn clone(&self) -> Self {
        Encoded::default()
    }
}

impl std::fmt::Debug for Encoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.get() {
            Some(bytes) => write!(f, "Encoded({} bytes)", bytes.len()),
            None => f.write_str("Encoded(not yet)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bytes_are_made_once_and_shared() {
        let cell = Encoded::default();
        let mut calls = 0;
        let first = cell.get_or_encode(|| {
            calls += 1;
            vec![1, 2, 3]
        });
        let second = cell.get_or_encode(|| {
            calls += 1;
            vec![9]
        });
        assert_eq!(calls, 1);
        assert_eq!(first, second);
        assert_eq!(
            first.as_ptr(),
            second.as_ptr(),
            "the bytes are shared, not copied"
        );
    }

    #[test]
    fn a_clone_starts_empty_so_a_changed_copy_is_encoded_anew() {
        let cell = Encoded::default();
        cell.get_or_encode(|| vec![1]);
        let copy = cell.clone();
        assert!(cell.is_encoded());
        assert!(!copy.is_encoded());
        assert_eq!(copy.get_or_encode(|| vec![2]), Bytes::from_static(&[2]));
    }
}
