//! Unit tests of the removal rules.

use super::*;

#[test]
fn capacity_without_a_machine_is_not_cancelled_while_a_raise_may_still_create_machines() {
    // Within the grace period after the last raise: held until the raise is `grace` old.
    assert_eq!(uncreated_hold(1, Some(1000), 1000, 30), Some(1030));
    assert_eq!(uncreated_hold(2, Some(1000), 1029, 30), Some(1030));
    // The grace period over, never raised, or nothing without a Machine to cancel: allowed.
    assert_eq!(uncreated_hold(1, Some(1000), 1030, 30), None);
    assert_eq!(uncreated_hold(1, None, 1000, 30), None);
    assert_eq!(uncreated_hold(0, Some(1000), 1000, 30), None);
    // A raise dated ahead of our clock holds until grace after it.
    assert_eq!(uncreated_hold(1, Some(1100), 1000, 30), Some(1130));
    // No grace period: never held.
    assert_eq!(uncreated_hold(1, Some(1000), 1000, 0), None);
}

#[test]
fn a_taking_back_record_keeps_only_marks_still_there_and_names_exactly_them() {
    let record = Ledger::parse(Some("a@100,b@200,c@300,id:i-1"));
    // a: still that mark; b: marked again later; c: unmarked (or gone); pool entries dropped.
    let kept = record.still_marked(|m| match m {
        "a" => Some(100),
        "b" => Some(900),
        _ => None,
    });
    assert_eq!(kept.render().as_deref(), Some("a@100"));
    assert!(
        kept.pays("a", Some(&our_mark(100))),
        "the mark being taken back"
    );
    assert!(
        !kept.pays("a", Some(&our_mark(101))),
        "a fresh mark is not that one"
    );
    assert!(!kept.pays("b", Some(&our_mark(900))));
    assert!(
        !kept.pays("a", Some("yes")),
        "another's mark is never ours to pay"
    );
}

fn m<'a>(name: &'a str, deleting: bool, mark: Option<&'a str>) -> MachineState<'a> {
    MachineState {
        name,
        deleting,
        mark,
        registered: true,
        unhealthy: false,
        machineless: false,
    }
}

/// A registered Machine Cluster API ranks unhealthy (NodeHealthy or its MachineHealthCheck
/// False).
fn sick(name: &'static str) -> MachineState<'static> {
    MachineState {
        unhealthy: true,
        ..m(name, false, None)
    }
}

/// A MachinePool instance without a Machine.
fn instance(id: &'static str) -> MachineState<'static> {
    MachineState {
        machineless: true,
        ..m(id, false, None)
    }
}

/// A Machine that never got its Node.
fn pending(name: &'static str) -> MachineState<'static> {
    MachineState {
        registered: false,
        ..m(name, false, None)
    }
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

#[test]
fn marks_carry_their_time_and_are_told_from_others() {
    let mark = our_mark(1_700_000_000);
    assert!(is_our_mark(&mark));
    assert_eq!(our_mark_time(&mark), Some(1_700_000_000));
    assert!(!is_our_mark("2024-01-02 15:04:05 +0000 UTC"));
    assert_eq!(our_mark_time("yes"), None);
    assert_eq!(our_mark_time("unix x by capi-autoscaler-provider"), None);
    assert_eq!(
        our_mark_time("unix 99999999999999999999999 by capi-autoscaler-provider"),
        None,
        "an overflowing time is not read"
    );
}

#[test]
fn the_ledger_reads_leniently_and_renders_sorted() {
    let l = Ledger::parse(Some(" b, a,,a , id:i-1"));
    assert_eq!(l.render().as_deref(), Some("a,b,id:i-1"));
    assert_eq!(Ledger::parse(None).render(), None);
    assert_eq!(Ledger::parse(Some(" , ")).render(), None);
    let huge = (0..20_000)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(
        Ledger::parse(Some(&huge))
            .render()
            .map_or(0, |r| r.split(',').count()),
        MAX_LEDGER_ENTRIES
    );
}

#[test]
fn pool_entries_match_any_spelling_of_the_provider_id() {
    assert_eq!(pool_node_entry("aws:///us-east-1a/i-1"), "id:i-1");
    assert_eq!(pool_node_entry("aws:////i-1"), pool_node_entry("i-1"));
}

#[test]
fn a_mark_is_paid_only_by_the_entry_of_that_very_mark() {
    let ledger = Ledger::parse(Some("m0@100,id:i-1"));
    assert!(ledger.pays("m0", Some(&our_mark(100))));
    assert!(
        !ledger.pays("m0", Some(&our_mark(101))),
        "a later mark of the same Machine is a new removal"
    );
    assert!(!ledger.pays("m1", Some(&our_mark(100))), "another Machine");
    assert!(!ledger.pays("m0", Some("yes")), "someone else's mark");
    assert!(!ledger.pays("m0", None));
    assert_eq!(
        parse_mark_entry("id:i-1"),
        None,
        "pool entries are not marks"
    );
    assert_eq!(parse_mark_entry("m0@x"), None);
    assert_eq!(parse_mark_entry("a.b-c@7"), Some(("a.b-c", 7)));
}

#[test]
fn a_fresh_mark_is_dated_after_every_entry_of_its_machine() {
    let ledger = Ledger::parse(Some("m0@100,m0@104,m1@200,id:i-1"));
    assert_eq!(ledger.fresh_mark_time("m0", 104), 105);
    assert_eq!(ledger.fresh_mark_time("m0", 300), 300);
    assert_eq!(ledger.fresh_mark_time("m2", 50), 50);
}

fn proceed(mark: &[&'static str], decrement: usize, pay: &[&'static str]) -> Deletion<'static> {
    Deletion::Proceed {
        mark: mark.to_vec(),
        decrement,
        pay: pay.to_vec(),
    }
}

fn named(names: &[&'static str]) -> BTreeSet<&'static str> {
    names.iter().copied().collect()
}

/// Paid: 3 Machines, replicas 2, m0's mark in the ledger. A retry is done, never paid again;
/// another node is a fresh removal; a Machine being deleted is done.
#[test]
fn a_paid_mark_is_done_and_never_paid_again() {
    let mark = leak(our_mark(100));
    let ledger = Ledger::parse(Some("m0@100"));
    let machines = [
        m("m0", false, Some(mark)),
        m("m1", false, None),
        m("m2", false, None),
    ];
    assert_eq!(
        deletion(&machines, &named(&["m0"]), 2, &ledger),
        proceed(&[], 0, &[])
    );
    assert_eq!(
        deletion(&machines, &named(&["m1"]), 2, &ledger),
        proceed(&["m1"], 1, &["m1"])
    );
    assert_eq!(
        deletion(&machines, &named(&["m0", "m1"]), 2, &ledger),
        proceed(&["m1"], 1, &["m1"]),
        "the paid one stays paid, the other is paid once"
    );
    let deleting = [m("m0", true, Some(mark)), machines[1], machines[2]];
    assert_eq!(
        deletion(&deleting, &named(&["m0"]), 2, &ledger),
        proceed(&[], 0, &[])
    );
}

/// Absorbed: the same, then a raise to 3. The paid mark is refused, never paid again, and a
/// new mark of that Machine (after the repair took the old one back) is a fresh removal.
#[test]
fn a_paid_mark_a_raise_absorbed_is_refused_never_paid_again() {
    let mark = leak(our_mark(100));
    let ledger = Ledger::parse(Some("m0@100"));
    let machines = [
        m("m0", false, Some(mark)),
        m("m1", false, None),
        m("m2", false, None),
    ];
    assert_eq!(
        deletion(&machines, &named(&["m0"]), 3, &ledger),
        Deletion::Absorbed(vec!["m0"])
    );
    assert_eq!(
        deletion(&machines, &named(&["m1"]), 3, &ledger),
        Deletion::OthersMarked(vec!["m0"]),
        "m0's absorbed mark would go before m1"
    );
    let unmarked = [m("m0", false, None), machines[1], machines[2]];
    assert_eq!(
        deletion(&unmarked, &named(&["m0"]), 3, &ledger),
        proceed(&["m0"], 1, &["m0"])
    );
}

/// Legacy and leftover: a mark of ours without an entry that replicas already remove is done
/// (paid by a version before the ledger); one they do not is owed its decrement.
#[test]
fn unledgered_marks_are_paid_only_when_replicas_do_not_remove_them() {
    let mark = leak(our_mark(100));
    let none = Ledger::default();
    let machines = [
        m("m0", false, Some(mark)),
        m("m1", false, None),
        m("m2", false, None),
    ];
    assert_eq!(
        deletion(&machines, &named(&["m0"]), 2, &none),
        proceed(&[], 0, &[])
    );
    assert_eq!(
        deletion(&machines, &named(&["m0"]), 3, &none),
        proceed(&[], 1, &["m0"])
    );
    let counts = Counts::of(3, &none, machines);
    assert_eq!((counts.unledgered, counts.owed()), (1, 1));
}

/// Someone else's mark counts like any: Cluster API deletes it first. A removal of another
/// Machine is refused while replicas do not remove it, and proceeds once they do (or names
/// it itself: the mark stays as its writer left it, and the decrement pays for it).
#[test]
fn a_mark_someone_else_wrote_counts_and_refuses_a_removal_it_would_preempt() {
    let none = Ledger::default();
    let machines = [
        m("a", false, Some("yes")),
        m("b", false, None),
        m("c", false, None),
    ];
    assert_eq!(
        deletion(&machines, &named(&["c"]), 3, &none),
        Deletion::OthersMarked(vec!["a"])
    );
    assert_eq!(
        deletion(&machines, &named(&["c"]), 2, &none),
        proceed(&["c"], 1, &["c"]),
        "replicas remove a already: c is one more"
    );
    assert_eq!(
        deletion(&machines, &named(&["a"]), 3, &none),
        proceed(&[], 1, &["a"]),
        "named itself: kept, paid"
    );
    let counts = Counts::of(3, &none, machines);
    assert_eq!((counts.foreign, counts.owed()), (1, 0));
    // Our leftover beside it: the foreign mark takes the surplus first, ours is owed.
    let ours = leak(our_mark(100));
    let both = [machines[0], m("b", false, Some(ours)), machines[2]];
    let counts = Counts::of(2, &none, both);
    assert_eq!(
        (counts.foreign, counts.unledgered, counts.owed()),
        (1, 1, 1)
    );
}

/// A named Machine carrying someone else's mark keeps it (the Machine goes either way; its
/// writer's record stays): the decrement pays for that very value, so a retry is done, a raise
/// absorbs it like ours, the repair never takes it back, and a new value is a new removal.
#[test]
fn a_foreign_mark_on_a_named_machine_is_kept_and_paid_once() {
    let machines = [
        m("a", false, Some("by hand")),
        m("b", false, None),
        m("c", false, None),
    ];
    let entry = foreign_entry("a", "by hand", 500);
    assert_eq!(payment_entry("a", "by hand", 500), entry);
    assert_eq!(
        payment_entry("a", &our_mark(7), 500),
        "a@7",
        "ours by its time"
    );
    let ledger = Ledger::parse(Some(&entry));
    assert!(ledger.pays("a", Some("by hand")));
    assert!(!ledger.pays("a", Some("by hand, again")), "another value");
    assert!(!ledger.pays("b", Some("by hand")), "another Machine");
    assert_eq!(parse_mark_entry(&entry), None, "not one of our marks");
    let counts = Counts::of(2, &ledger, machines);
    assert_eq!(
        (
            counts.paid,
            counts.foreign,
            counts.owed(),
            counts.absorbed()
        ),
        (1, 0, 0, 0)
    );
    assert_eq!(
        deletion(&machines, &named(&["a"]), 2, &ledger),
        proceed(&[], 0, &[]),
        "a retry is done"
    );
    assert_eq!(
        deletion(&machines, &named(&["c"]), 2, &ledger),
        proceed(&["c"], 1, &["c"])
    );
    assert_eq!(
        deletion(&machines, &named(&["a"]), 3, &ledger),
        Deletion::Absorbed(vec!["a"])
    );
    assert!(
        orphans(
            &machines,
            &ledger,
            &Counts::of(3, &ledger, machines),
            None,
            9_999,
            60
        )
        .is_empty(),
        "someone else's mark is never taken back"
    );
    // Kept while the Machine carries that value; once it does not, until it is old.
    let mark_of = |value: Option<&'static str>| move |_: &str| value.map(str::to_string);
    let none = BTreeSet::new();
    let old = 500 + STALE_ENTRY_SECS;
    assert_eq!(ledger.pruned(&none, mark_of(Some("by hand")), old), ledger);
    assert_eq!(ledger.pruned(&none, mark_of(None), old - 1), ledger);
    assert_eq!(
        ledger.pruned(&none, mark_of(Some("other")), old).render(),
        None
    );
    assert_eq!(ledger.pruned(&none, mark_of(None), old).render(), None);
}

/// A MachinePool's instances without a Machine are members like its Machines: with one beside
/// a paid mark, a retry is done (counting the Machines alone, the paid mark would look
/// absorbed, or owed again); a paid instance still listed takes one Machine beyond replicas.
#[test]
fn machinepool_instances_without_a_machine_count_like_machines() {
    let mark = leak(our_mark(100));
    let ledger = Ledger::parse(Some("m1@100"));
    let pool = [
        m("m1", false, Some(mark)),
        m("m2", false, None),
        instance("i-3"),
        instance("i-4"),
    ];
    assert_eq!(
        deletion(&pool, &named(&["m1"]), 3, &ledger),
        proceed(&[], 0, &[]),
        "4 members, replicas 3: m1's paid mark is the one beyond"
    );
    let machines_only = [pool[0], pool[1]];
    assert_eq!(
        deletion(&machines_only, &named(&["m1"]), 3, &ledger),
        Deletion::Absorbed(vec!["m1"]),
        "(what counting the Machines alone would have made of it)"
    );
    let pool_paid = Ledger::parse(Some("id:i-3"));
    let unmarked = [m("m1", false, None), pool[1], pool[2], pool[3]];
    let counts = Counts::of(3, &pool_paid, unmarked);
    assert_eq!(
        (counts.active, counts.pool_paid, counts.surplus()),
        (4, 1, 1)
    );
    assert_eq!(
        deletion(&unmarked, &named(&["m1"]), 3, &pool_paid),
        proceed(&["m1"], 1, &["m1"]),
        "the pool's paid instance still goes, m1 is one more"
    );
    let foreign = [
        m("m1", false, None),
        m("f", false, Some("yes")),
        pool[2],
        pool[3],
    ];
    assert_eq!(
        deletion(&foreign, &named(&["m1"]), 3, &pool_paid),
        Deletion::OthersMarked(vec!["f", "i-3"]),
        "the one beyond replicas is i-3's: f's mark is not removed yet"
    );
    // A Machine without providerID (but with a Node) is a member like any: the rules see it
    // as a Machine; the actuator lists it with the group's Machines.
    let unlisted = [pool[0], pool[1], m("no-id", false, None)];
    assert_eq!(
        deletion(&unlisted, &named(&["m1"]), 2, &ledger),
        proceed(&[], 0, &[])
    );
}

/// Replicas above the members Cluster API has (Machines not created yet, or to be created
/// again once those being deleted are gone): a decrement would cancel one of those and the
/// named Machine would stay, so a removal is refused; a retry of a paid one is still done.
#[test]
fn a_removal_while_machines_are_not_created_yet_is_refused() {
    let machines = [
        m("a", false, None),
        m("b", false, None),
        m("c", true, Some("yes")),
    ];
    let none = Ledger::default();
    assert_eq!(
        deletion(&machines, &named(&["a"]), 3, &none),
        Deletion::NotCreated {
            replicas: 3,
            members: 2
        }
    );
    assert_eq!(
        deletion(&machines, &named(&["a"]), 2, &none),
        proceed(&["a"], 1, &["a"])
    );
    assert_eq!(
        deletion(&machines, &named(&["c"]), 3, &none),
        proceed(&[], 0, &[]),
        "a named Machine being deleted is done"
    );
    assert_eq!(Counts::of(5, &none, machines).not_created(), 3);
    // DecreaseTargetSize cancels them first.
    assert_eq!(cancellation(&machines, 4, 2), Ok(()));
    assert!(cancellation(&machines, 4, 3).is_err());
}

/// Cluster API ranks a registered Machine with an unhealthy Node (or a failed health check)
/// with those that never got one, ties broken by name: a decrease that would reach it before
/// the pending one is refused; one that reaches only pending ones goes through.
#[test]
fn a_decrease_never_reaches_an_unhealthy_registered_machine() {
    let group = [m("a", false, None), sick("b-sick"), pending("p")];
    assert_eq!(
        cancellation(&group, 3, 1),
        Err(Cancellation::Unhealthy(vec!["b-sick"])),
        "b-sick sorts before p in the unhealthy rank"
    );
    let after = [m("a", false, None), sick("x-sick"), pending("p")];
    assert_eq!(cancellation(&after, 3, 1), Ok(()), "p sorts first");
    assert_eq!(
        cancellation(&after, 3, 2),
        Err(Cancellation::Unhealthy(vec!["x-sick"]))
    );
    assert_eq!(
        cancellation(&[sick("b-sick"), group[0]], 2, 1),
        Err(Cancellation::Unhealthy(vec!["b-sick"])),
        "no pending Machine at all"
    );
    let marked = [m("a", false, Some("yes")), sick("b-sick"), pending("p")];
    assert_eq!(
        cancellation(&marked, 2, 1),
        Err(Cancellation::Unhealthy(vec!["b-sick"])),
        "after the mark the count removes, the unhealthy rank by name"
    );
    // DeleteNodes: marks go before the unhealthy rank, so the named one goes exactly.
    let none = Ledger::default();
    assert_eq!(
        deletion(&group, &named(&["a"]), 3, &none),
        proceed(&["a"], 1, &["a"])
    );
}

/// Replicas lowered (by hand) before the call: what that count removes still goes, the named
/// Machine is one more; a drop during the call (seen on a conflict) takes the named Machine's
/// place, as Cluster API deletes the marked one first for it.
#[test]
fn replicas_lowered_by_someone_else_are_paid_once() {
    let none = Ledger::default();
    let machines = [
        m("a", false, None),
        m("b", false, None),
        m("c", false, None),
    ];
    assert_eq!(
        deletion(&machines, &named(&["c"]), 2, &none),
        proceed(&["c"], 1, &["c"])
    );
    let decided = Ledger::parse(Some("a@1"));
    assert_eq!(still_owed(1, (3, &decided), (3, &decided)), 1);
    assert_eq!(still_owed(1, (3, &decided), (2, &decided)), 0, "by hand");
    let paid_other = Ledger::parse(Some("a@1,b@2"));
    assert_eq!(
        still_owed(1, (3, &decided), (2, &paid_other)),
        1,
        "another removal paid meanwhile explains the drop"
    );
    assert_eq!(still_owed(2, (5, &decided), (4, &decided)), 1);
    assert_eq!(still_owed(1, (5, &decided), (6, &decided)), 1, "a raise");
}

/// The decrement pays the named Machines' marks no entry pays yet, one entry each, never more
/// than is still owed: a retry whose decrement landed owes nothing, a drop by hand pays one.
#[test]
fn a_removal_owes_one_entry_per_unpaid_named_mark_and_no_more_than_still_owed() {
    let marks = |pairs: &[(&str, Option<String>)]| -> Vec<(String, Option<String>)> {
        pairs
            .iter()
            .map(|(n, m)| (n.to_string(), m.clone()))
            .collect()
    };
    let all = marks(&[
        ("a", Some(our_mark(100))),
        ("b", Some(our_mark(101))),
        ("c", Some(our_mark(102))),
    ]);
    let none = Ledger::default();
    let ab = named(&["a", "b"]);
    assert_eq!(
        owed_payments(&ab, &all, 2, (5, &none), (5, &none), 900),
        vec!["a@100".to_string(), "b@101".to_string()],
        "each named mark once; c is not named"
    );
    let landed = Ledger::parse(Some("a@100,b@101"));
    assert!(
        owed_payments(&ab, &all, 2, (5, &none), (3, &landed), 900).is_empty(),
        "a retry over the version its decrement landed in pays nothing twice"
    );
    assert_eq!(
        owed_payments(&ab, &all, 2, (5, &none), (4, &none), 900),
        vec!["a@100".to_string()],
        "replicas lowered by hand since pay for one of them"
    );
    assert_eq!(
        owed_payments(&ab, &all, 2, (5, &none), (6, &none), 900).len(),
        2,
        "a raise since changes nothing owed"
    );
    let half = Ledger::parse(Some("a@100"));
    assert_eq!(
        owed_payments(&ab, &all, 1, (5, &half), (5, &half), 900),
        vec!["b@101".to_string()],
        "a paid mark is never paid again"
    );
    let unmarked = marks(&[("a", None), ("b", Some(our_mark(101)))]);
    assert_eq!(
        owed_payments(&ab, &unmarked, 2, (5, &none), (5, &none), 900),
        vec!["b@101".to_string()],
        "a named Machine without a mark is owed nothing"
    );
    let foreign = marks(&[("a", Some("yes".to_string()))]);
    let paid = owed_payments(&named(&["a"]), &foreign, 1, (5, &none), (5, &none), 900);
    assert_eq!(paid, vec![foreign_entry("a", "yes", 900)]);
    assert!(Ledger::parse(Some(&paid[0])).pays("a", Some("yes")));
}

#[test]
fn pool_nodes_already_in_the_ledger_are_owed_nothing_in_any_spelling() {
    let ledger = Ledger::parse(Some("id:i-1,m0@100"));
    assert_eq!(
        unpaid_pool_nodes(&ledger, ["aws:///us-east-1a/i-1", "aws:///us-east-1a/i-2"]),
        1
    );
    assert_eq!(unpaid_pool_nodes(&ledger, ["i-1"]), 0);
    assert_eq!(unpaid_pool_nodes(&Ledger::default(), ["i-1", "i-2"]), 2);
}

/// The surplus pays for paid marks first (their decrements are certain), what it leaves for
/// unledgered ones; a paid mark the surplus no longer covers refuses removals beside it.
#[test]
fn the_surplus_pays_for_paid_marks_first() {
    let (a, b) = (leak(our_mark(100)), leak(our_mark(110)));
    let ledger = Ledger::parse(Some("paid@100"));
    let machines = [
        m("paid", false, Some(a)),
        m("legacy", false, Some(b)),
        m("plain", false, None),
        m("plain2", false, None),
    ];
    let counts = Counts::of(2, &ledger, machines);
    assert_eq!((counts.absorbed(), counts.owed()), (0, 0));
    assert_eq!(
        deletion(&machines, &named(&["plain"]), 2, &ledger),
        proceed(&["plain"], 1, &["plain"])
    );
    let counts = Counts::of(3, &ledger, machines);
    assert_eq!((counts.absorbed(), counts.owed()), (0, 1));
    assert_eq!(
        deletion(&machines, &named(&["legacy"]), 3, &ledger),
        proceed(&[], 1, &["legacy"])
    );
    assert_eq!(
        deletion(&machines, &named(&["plain"]), 3, &ledger),
        Deletion::OthersMarked(vec!["paid", "legacy"])
    );
}

/// DecreaseTargetSize: only Machines without a Node and without a mark may go for the count
/// written; a mark the replicas do not remove yet goes first.
#[test]
fn a_decrease_cancels_only_pending_unmarked_machines() {
    let group = [m("a", false, None), m("b", false, None), pending("p")];
    assert_eq!(cancellation(&group, 3, 1), Ok(()));
    assert_eq!(
        cancellation(&group, 3, 2),
        Err(Cancellation::Registered {
            removes: 2,
            pending: 1
        })
    );
    let marked = [m("a", false, Some("yes")), group[1], group[2]];
    assert_eq!(
        cancellation(&marked, 3, 1),
        Err(Cancellation::Marked(vec!["a"]))
    );
    assert_eq!(
        cancellation(&marked, 2, 1),
        Ok(()),
        "the mark is removed by the count as it stands; the pending one goes next"
    );
    let deleting = [m("a", true, Some("yes")), group[1], group[2]];
    assert_eq!(cancellation(&deleting, 2, 1), Ok(()));
    assert_eq!(
        cancellation(&group, 5, 3),
        Ok(()),
        "two Machines not created yet are cancelled, then the pending one"
    );
    assert_eq!(
        cancellation(&group, 5, 4),
        Err(Cancellation::Registered {
            removes: 2,
            pending: 1
        })
    );
}

/// After a DecreaseTargetSize, Machines without a Node are beyond replicas, going: a named
/// node is one more, paid, never in their place (the cancelled capacity still goes).
#[test]
fn a_removal_beside_cancelled_capacity_is_paid() {
    let none = Ledger::default();
    let machines = [
        m("a", false, None),
        m("b", false, None),
        pending("p1"),
        pending("p2"),
    ];
    assert_eq!(
        deletion(&machines, &named(&["a"]), 2, &none),
        proceed(&["a"], 1, &["a"])
    );
    assert_eq!(
        deletion(&machines, &named(&["a"]), 1, &none),
        proceed(&["a"], 1, &["a"]),
        "lowered further by hand: that still goes too"
    );
}

#[test]
fn writes_stay_in_bounds_or_move_toward_them() {
    assert!(within_bounds(3, 2, 1, 5));
    assert!(!within_bounds(3, 6, 1, 5));
    assert!(!within_bounds(1, 0, 1, 5));
    assert!(within_bounds(7, 6, 1, 5), "above max, lowered toward it");
    assert!(!within_bounds(7, 8, 1, 5), "above max, raised further");
    assert!(!within_bounds(7, 0, 1, 5), "above max, past min");
    assert!(within_bounds(0, 1, 2, 5), "below min, raised toward it");
    assert!(!within_bounds(1, 0, 2, 5), "below min, lowered further");
}

#[test]
fn entries_are_pruned_once_their_mark_is_gone_and_old() {
    let ledger = Ledger::parse(Some(
        "kept@100,gone@100,remarked@100,young@950,id:i-1,id:i-2",
    ));
    let listed = BTreeSet::from(["id:i-1".to_string()]);
    let mark_of = |name: &str| match name {
        "kept" => Some(our_mark(100)),
        "remarked" => Some(our_mark(900)),
        _ => None,
    };
    let now = 100 + STALE_ENTRY_SECS;
    assert_eq!(
        ledger.pruned(&listed, mark_of, now).render().as_deref(),
        Some("id:i-1,kept@100,young@950"),
        "pool entries go with their listing, as before; a Machine's when its mark is gone \
         and the entry is older than {STALE_ENTRY_SECS}s"
    );
    assert_eq!(
        ledger.pruned(&listed, mark_of, now - 1).render().as_deref(),
        Some("gone@100,id:i-1,kept@100,remarked@100,young@950"),
        "younger entries stay, whatever the cache shows"
    );
}

#[test]
fn the_raise_record_reads_leniently() {
    assert_eq!(raised_at(Some(" 1700 ")), Some(1700));
    assert_eq!(raised_at(Some("soon")), None);
    assert_eq!(raised_at(None), None);
    assert!(raised_within(Some(100), 102, 3));
    assert!(!raised_within(Some(100), 103, 3));
    assert!(
        raised_within(Some(200), 100, 3),
        "a raise dated ahead of our clock"
    );
    assert!(!raised_within(None, 100, 3));
}

#[test]
fn orphans_are_the_absorbed_and_owed_marks_past_the_grace_period_newest_first() {
    let old = our_mark(1_000);
    let older = our_mark(900);
    let fresh = our_mark(1_100);
    let machines = [
        m("older", false, Some(&older)),
        m("old", false, Some(&old)),
        m("fresh", false, Some(&fresh)),
        m("deleting", true, Some(&old)),
        m("foreign", false, Some("yes")),
        m("unmarked", false, None),
    ];
    let none = Ledger::default();
    // 5 active, replicas 3: surplus 2, taken first by the foreign mark; of 3 unledgered
    // marks of ours 1 covered, 2 owed.
    let counts = Counts::of(3, &none, machines);
    assert_eq!(counts.owed(), 2);
    assert_eq!(
        orphans(&machines, &none, &counts, None, 1_120, 60),
        ["old", "older"]
    );
    let paid = Counts::of(1, &none, machines);
    assert!(
        orphans(&machines, &none, &paid, None, 1_120, 60).is_empty(),
        "all paid"
    );
    assert_eq!(
        orphans(&machines, &none, &counts, None, 1_200, 60),
        ["fresh", "old"],
        "past the grace period the newest go first"
    );
    assert!(
        orphans(&machines, &none, &counts, Some(1_150), 1_200, 60).is_empty(),
        "nothing within the grace period after a raise"
    );
    assert_eq!(
        orphans(&machines, &none, &counts, Some(1_100), 1_200, 60),
        ["fresh", "old"]
    );
    // Paid marks: "older" and "old" paid, replicas 5 → no surplus: both absorbed, the
    // unledgered "fresh" owed; "fresh" is too young yet.
    let ledger = Ledger::parse(Some("older@900,old@1000"));
    let counts = Counts::of(5, &ledger, machines);
    assert_eq!((counts.absorbed(), counts.owed()), (2, 1));
    assert_eq!(
        orphans(&machines, &ledger, &counts, Some(1_000), 1_120, 60),
        ["old", "older"]
    );
    // Replicas 4: surplus 1 pays for one paid mark; one absorbed, taken back newest first.
    let counts = Counts::of(4, &ledger, machines);
    assert_eq!((counts.absorbed(), counts.owed()), (1, 1));
    assert_eq!(
        orphans(&machines, &ledger, &counts, None, 1_200, 60),
        ["old", "fresh"]
    );
}

/// A DecreaseTargetSize pins what it cancels: replicas without a Machine are cancelled by the
/// decrement alone, first; then the pending Machines Cluster API ranks first for the count
/// written (by name), each to be marked before the decrement, so a nodeRef arriving before
/// Cluster API acts no longer lets its Random order reach a registered node.
#[test]
fn a_decrease_pins_the_pending_machines_it_cancels_after_uncreated_capacity() {
    let plan = |uncreated, pin: &[&'static str]| {
        Ok(CancellationPlan {
            uncreated,
            pin: pin.to_vec(),
        })
    };
    let group = [m("a", false, None), pending("q"), pending("p")];
    assert_eq!(
        cancellation_plan(&group, 3, 1),
        plan(0, &["p"]),
        "p sorts first"
    );
    assert_eq!(cancellation_plan(&group, 3, 2), plan(0, &["p", "q"]));
    assert_eq!(
        cancellation_plan(&group, 5, 1),
        plan(1, &[]),
        "capacity not created is cancelled first, no Machine is touched"
    );
    assert_eq!(cancellation_plan(&group, 5, 3), plan(2, &["p"]));
    assert_eq!(cancellation_plan(&group, 5, 4), plan(2, &["p", "q"]));
    assert!(
        cancellation_plan(&group, 5, 5).is_err(),
        "a registers: never a registered node"
    );
    // Machines being deleted are neither counted nor pinned.
    let deleting = [m("a", false, None), m("gone", true, None), pending("p")];
    assert_eq!(cancellation_plan(&deleting, 2, 1), plan(0, &["p"]));
    // A paid mark the count removes already goes first, as it stands; so does an unmarked
    // surplus (replicas lowered by hand): this call pins the next pending ones.
    let marked = [m("a", false, Some("yes")), pending("p"), pending("q")];
    assert_eq!(cancellation_plan(&marked, 2, 1), plan(0, &["p"]));
    let lowered = [m("a", false, None), pending("p"), pending("q")];
    assert_eq!(
        cancellation_plan(&lowered, 2, 1),
        plan(0, &["q"]),
        "p is the surplus the count removes already"
    );
    // Every refusal of `cancellation` stands.
    assert_eq!(
        cancellation_plan(&[sick("b-sick"), pending("p")], 2, 1),
        Err(Cancellation::Unhealthy(vec!["b-sick"]))
    );
    assert_eq!(
        cancellation_plan(&[m("a", false, Some("yes")), pending("p")], 2, 1),
        Err(Cancellation::Marked(vec!["a"]))
    );
    assert_eq!(
        cancellation_plan(&[m("a", false, None), pending("p")], 2, 2),
        Err(Cancellation::Registered {
            removes: 2,
            pending: 1
        })
    );
}
