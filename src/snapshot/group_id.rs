//! A node group's id, as CA knows it: `Kind/namespace/name` of its scalable resource. Formatted
//! here and parsed back here, nowhere else.

use std::fmt;

use crate::capi::{ObjectKey, ScalableKind};

/// The id of the group a scalable resource is, borrowing its namespace and name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId<'a> {
    pub kind: ScalableKind,
    pub namespace: &'a str,
    pub name: &'a str,
}

impl<'a> GroupId<'a> {
    pub fn new(kind: ScalableKind, namespace: &'a str, name: &'a str) -> Self {
        GroupId {
            kind,
            namespace,
            name,
        }
    }

    pub fn of(kind: ScalableKind, key: &'a ObjectKey) -> Self {
        GroupId::new(kind, &key.namespace, &key.name)
    }

    /// The id CA sent back; `None` for anything that is not the id of a scalable kind.
    pub fn parse(id: &'a str) -> Option<Self> {
        let mut parts = id.splitn(3, '/');
        let kind = ScalableKind::from_kind(parts.next()?)?;
        Some(GroupId::new(kind, parts.next()?, parts.next()?))
    }

    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(self.namespace, self.name)
    }

    /// The group's object as problems name it: `Kind namespace/name`.
    pub fn object(&self) -> String {
        format!("{} {}/{}", self.kind, self.namespace, self.name)
    }
}

impl fmt::Display for GroupId<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.kind.as_str(), self.namespace, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_kind_namespace_name_and_parses_back() {
        let key = ObjectKey::new("ns", "md-0");
        let id = GroupId::of(ScalableKind::MachineDeployment, &key).to_string();
        assert_eq!(id, "MachineDeployment/ns/md-0");
        let parsed = GroupId::parse(&id).expect("a group id");
        assert_eq!(parsed.kind, ScalableKind::MachineDeployment);
        assert_eq!(parsed.key(), key);
        assert_eq!(parsed.object(), "MachineDeployment ns/md-0");
        for kind in ScalableKind::ALL {
            let id = GroupId::new(kind, "a", "b").to_string();
            assert_eq!(GroupId::parse(&id).map(|g| g.kind), Some(kind), "{id}");
        }
    }

    #[test]
    fn what_is_not_a_group_id_does_not_parse() {
        assert_eq!(GroupId::parse("Deployment/ns/web"), None);
        assert_eq!(GroupId::parse("MachineDeployment/ns"), None);
        assert_eq!(GroupId::parse("MachineDeployment"), None);
        assert_eq!(GroupId::parse(""), None);
    }
}
