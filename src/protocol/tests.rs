//! Unit tests of the protocol core.
