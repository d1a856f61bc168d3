//! The views' strings, kept small: a [`Name`] is shared by every copy of it (a Machine's key in the
//! cache, in its instance, its location and the lookups is one allocation), the strings that repeat
//! across objects (namespaces, label keys and values, owner names) are interned, and a few labels are
//! a sorted slice ([`Labels`]) rather than a tree. At 100,000 Machines this is most of the memory
//! the provider saves (docs/benchmarks.md, where the bytes are).

use std::borrow::Borrow;
use std::collections::HashSet;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, OnceLock};

/// An immutable string whose clones share one allocation. Compares, orders and hashes as its text,
/// so a map keyed by names is looked up with a `&str`.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(Arc<str>);

impl Name {
    /// The one shared copy of `text`: for strings many objects carry (namespaces, label keys and
    /// values, owner names). Unique strings (an object's own name, its providerID) are better made
    /// with `Name::from`, which costs no entry in the table.
    pub fn interned(text: &str) -> Name {
        let mut table = table().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = table.names.get(text) {
            return Name(Arc::clone(found));
        }
        let name: Arc<str> = Arc::from(text);
        table.names.insert(Arc::clone(&name));
        // Names no object holds any more (a deleted group's) leave the table when it has doubled
        // since it was last swept: amortised, the table stays within twice what is in use.
        if table.names.len() >= 2 * table.swept_at.max(1024) {
            table.names.retain(|n| Arc::strong_count(n) > 1);
            table.swept_at = table.names.len();
        }
        Name(name)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

struct Table {
    names: HashSet<Arc<str>>,
    /// The table's size after its last sweep.
    swept_at: usize,
}

fn table() -> &'static Mutex<Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE.get_or_init(|| {
        Mutex::new(Table {
            names: HashSet::new(),
            swept_at: 0,
        })
    })
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// As a `String` shows: quoted.
impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl From<&str> for Name {
    fn from(text: &str) -> Self {
        Name(Arc::from(text))
    }
}

impl From<String> for Name {
    fn from(text: String) -> Self {
        Name(Arc::from(text))
    }
}

impl From<&String> for Name {
    fn from(text: &String) -> Self {
        Name(Arc::from(text.as_str()))
    }
}

impl From<&Name> for Name {
    fn from(name: &Name) -> Self {
        name.clone()
    }
}

impl From<Name> for String {
    fn from(name: Name) -> Self {
        name.0.to_string()
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        &*self.0 == other.as_str()
    }
}

impl PartialEq<Name> for str {
    fn eq(&self, other: &Name) -> bool {
        self == &*other.0
    }
}

impl PartialEq<Name> for &str {
    fn eq(&self, other: &Name) -> bool {
        *self == &*other.0
    }
}

impl PartialEq<Name> for String {
    fn eq(&self, other: &Name) -> bool {
        self.as_str() == &*other.0
    }
}

/// A few labels (or annotations) of a view: sorted by key, each key once, keys and values interned.
/// A tree map would allocate a node of eleven entries for the three labels a Machine keeps.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Labels(Box<[(Name, Name)]>);

impl Labels {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .ok()
            .map(|at| self.0[at].1.as_str())
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// In key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Sets `key` to `value` (a copy of the list with it: for the few changes a view sees).
    pub fn insert(&mut self, key: String, value: String) {
        let mut pairs: Vec<(Name, Name)> = self.0.to_vec();
        pairs.push((Name::interned(&key), Name::interned(&value)));
        *self = pairs.into_iter().collect();
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: &str) {
        self.0 = self
            .0
            .iter()
            .filter(|(k, _)| k.as_str() != key)
            .cloned()
            .collect();
    }
}

impl From<std::collections::BTreeMap<String, String>> for Labels {
    fn from(map: std::collections::BTreeMap<String, String>) -> Self {
        map.into_iter().collect()
    }
}

impl<'a> IntoIterator for &'a Labels {
    type Item = (&'a str, &'a str);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (Name, Name)>,
        fn(&'a (Name, Name)) -> (&'a str, &'a str),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// As a map: where a key comes twice, the last one holds.
impl<K: AsRef<str>, V: AsRef<str>> FromIterator<(K, V)> for Labels {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        let mut list: Vec<(Name, Name)> = pairs
            .into_iter()
            .map(|(k, v)| (Name::interned(k.as_ref()), Name::interned(v.as_ref())))
            .collect();
        // Stable: equal keys stay in their order, and the last of each is kept.
        list.sort_by(|a, b| a.0.cmp(&b.0));
        list.reverse();
        list.dedup_by(|later, earlier| later.0 == earlier.0);
        list.reverse();
        Labels(list.into_boxed_slice())
    }
}

impl fmt::Debug for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_its_text_wherever_it_is_compared_or_looked_up() {
        let name = Name::from("md-0");
        assert_eq!(name, "md-0");
        assert_eq!(name, *"md-0");
        assert_eq!(name, "md-0".to_string());
        assert_eq!(name.to_string(), "md-0");
        assert_eq!(format!("{name:?}"), "\"md-0\"");
        let map: std::collections::HashMap<Name, u32> = [(name.clone(), 1)].into();
        assert_eq!(map.get("md-0"), Some(&1));
        let (a, b) = (Name::from("a"), Name::from("b"));
        assert!(a < b, "ordered as its text");
    }

    #[test]
    fn interned_names_share_one_allocation_and_unused_ones_are_swept() {
        let a = Name::interned("cluster.x-k8s.io/deployment-name");
        let b = Name::interned("cluster.x-k8s.io/deployment-name");
        assert!(Arc::ptr_eq(&a.0, &b.0));
        // Enough names nobody keeps to pass a sweep: the table does not grow with them.
        for i in 0..5000 {
            Name::interned(&format!("gone-{i}"));
        }
        let left = table()
            .lock()
            .map(|t| t.names.iter().filter(|n| n.starts_with("gone-")).count())
            .unwrap_or(usize::MAX);
        assert!(left < 5000, "{left} unused names kept");
        assert!(Arc::ptr_eq(
            &a.0,
            &Name::interned("cluster.x-k8s.io/deployment-name").0
        ));
    }

    #[test]
    fn labels_are_a_map_whose_last_value_of_a_key_holds() {
        let labels: Labels = [("b", "2"), ("a", "1"), ("b", "3")].into_iter().collect();
        assert_eq!(labels.len(), 2);
        assert_eq!(labels.get("a"), Some("1"));
        assert_eq!(labels.get("b"), Some("3"));
        assert_eq!(labels.get("c"), None);
        assert!(labels.contains_key("a"));
        assert_eq!(labels.iter().collect::<Vec<_>>(), [("a", "1"), ("b", "3")]);
        assert_eq!(format!("{labels:?}"), r#"{"a": "1", "b": "3"}"#);
        assert!(Labels::default().is_empty());
    }
}
