//! The writer fed watch events as the store receives them: what each does to the index and its
//! journal, without a cluster.
