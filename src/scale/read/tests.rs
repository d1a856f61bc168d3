use super::*;
use crate::capi::test_fixtures::{machine as resource_machine, resource};
use crate::protocol::our_mark;

fn md(replicas: i32, generation: i64, observed: i64) -> ScalableResource {
    let keys = Keys::default();
    let mut r = resource(ScalableKind::MachineDeployment, "md");
    r.replicas = Some(replicas);
    r.generation = Some(generation);
    r.observed_generation = Some(observed);
    r.annotations.insert(keys.min_size.clone(), "1".into());
    r.annotations.insert(keys.max_size.clone(), "5".into());
    r
}

fn ms(replicas: i32, generation: i64, observed: i64) -> Arc<ScalableResource> {
    let mut r = resource(ScalableKind::MachineSet, "md-1");
    r.replicas = Some(replicas);
    r.generation = Some(generation);
    r.observed_generation = Some(observed);
    Arc::new(r)
}

#[test]
fn cluster_api_has_observed_a_deployment_once_it_and_its_machine_sets_caught_up() {
    let keys = Keys::default();
    let read = |d: &ScalableResource, sets: &[Arc<ScalableResource>]| {
        group_read(&keys, d, sets, None).observed
    };
    assert!(read(&md(3, 4, 4), &[ms(3, 2, 2)]));
    assert!(
        !read(&md(3, 5, 4), &[ms(3, 2, 2)]),
        "its own generation not observed"
    );
    assert!(
        !read(&md(3, 4, 4), &[ms(2, 2, 2)]),
        "replicas not copied to its MachineSet yet"
    );
    assert!(
        !read(&md(3, 4, 4), &[ms(3, 3, 2)]),
        "its MachineSet has not acted on its replicas"
    );
}

#[test]
fn machine_sets_are_read_one_by_one_only_at_the_observed_generation_they_were_listed_at() {
    let mut since = Since::default();
    assert_eq!(since.sets_to_get(Some(4)), None, "never listed: listed");
    since.sets_read(Some(4), vec!["md-1".to_string(), "md-2".to_string()]);
    assert_eq!(
        since.sets_to_get(Some(4)),
        Some(vec!["md-1".to_string(), "md-2".to_string()])
    );
    assert_eq!(since.sets_to_get(Some(5)), None, "a new generation: listed");
    assert_eq!(since.sets_to_get(None), None, "not observed now: listed");
    since.sets_read(None, vec!["md-1".to_string()]);
    assert_eq!(
        since.sets_to_get(Some(4)),
        None,
        "listed while not observed: listed"
    );
}

#[test]
fn lists_are_not_older_than_the_newest_revision_seen_unless_a_write_is_not_known() {
    let mut since = Since::default();
    assert_eq!(since.floor(), None, "nothing seen: the newest there is");
    since.saw(Some("12"));
    since.saw(Some("9"));
    since.saw(Some("not a number"));
    assert_eq!(since.floor(), Some(12));
    let mut kept = 20;
    since.carry(&mut kept);
    assert_eq!((since.floor(), kept), (Some(20), 20), "carried both ways");
    since.lost_track();
    assert_eq!(
        since.floor(),
        None,
        "a write not known: the newest there is"
    );
}

#[test]
fn a_read_waits_for_the_machines_watch_only_right_after_a_write_of_its_own_to_a_machine() {
    let mut since = Since::default();
    assert_eq!(since.watch_wait(), Duration::ZERO, "nothing written");
    since.wrote("12", false);
    assert_eq!(since.watch_wait(), Duration::ZERO, "the group written");
    since.wrote("13", true);
    assert_eq!(
        (since.floor(), since.watch_wait()),
        (Some(13), WATCH_CATCH_UP)
    );
    since.saw(Some("13"));
    assert_eq!(since.watch_wait(), WATCH_CATCH_UP, "read at the mark");
    since.saw(Some("14"));
    assert_eq!(since.watch_wait(), Duration::ZERO, "something newer read");
    since.wrote("15", true);
    let mut kept = 16;
    since.carry(&mut kept);
    assert_eq!(
        since.watch_wait(),
        Duration::ZERO,
        "another operation of this process went further"
    );
}

#[test]
fn the_group_read_carries_its_records_and_bounds_of_that_version() {
    let keys = Keys::default();
    let mut d = md(3, 1, 1);
    d.annotations
        .insert(LEDGER_ANNOTATION.into(), "m0@5".into());
    d.annotations
        .insert(CLAIMS_ANNOTATION.into(), "m1@6".into());
    let read = group_read(&keys, &d, &[ms(3, 1, 1)], None);
    assert_eq!(read.bounds, Ok((1, 5)));
    assert!(read.ledger.contains("m0@5") && read.claims.contains("m1@6"));
    d.replicas = None;
    assert!(
        group_read(&keys, &d, &[], None).bounds.is_err(),
        "no target size, no write"
    );
}

#[test]
fn members_carry_their_mark_version_and_node_and_pool_instances_have_entries() {
    let keys = Keys::default();
    let mut machine = resource_machine("m0");
    machine.resource_version = "7".into();
    machine
        .annotations
        .insert(keys.delete_machine.clone(), our_mark(9));
    let members = members(&keys, &[Arc::new(machine)], &["aws:///i-1"]);
    assert_eq!(members[0].mark.as_deref(), Some(our_mark(9).as_str()));
    assert_eq!(members[0].version, "7");
    assert!(!members[0].registered && members[0].ranks_unhealthy());
    assert!(members[1].machineless && members[1].name == pool_node_entry("aws:///i-1"));
}
