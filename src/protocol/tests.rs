//! Unit tests of the protocol core: its records, its accounts and each operation's decisions, fed
//! reads and outcomes by hand. Every interleaving of them is explored by tests/protocol_model.rs.

use super::ledger::{
    Entry, Ledger, Resizes, entry_for, foreign_entry, mark_entry, our_mark, our_mark_stamp,
    pool_node_entry,
};
use super::*;

/// A group at `replicas` (min 0, max 5), observed by Cluster API, with these records.
fn group(replicas: i32, ledger: &str, claims: &str, taking_back: &str) -> GroupRead {
    GroupRead {
        version: "1".into(),
        replicas,
        bounds: Ok((0, 5)),
        ledger: Ledger::parse(Some(ledger)),
        claims: Ledger::parse(Some(claims)),
        taking_back: Ledger::parse(Some(taking_back)),
        resizes: Resizes::default(),
        observed: true,
        held: false,
        hold: None,
    }
}

fn member(name: &str, mark: Option<&str>) -> Member {
    Member {
        name: name.into(),
        version: format!("v-{name}"),
        mark: mark.map(str::to_string),
        deleting: false,
        registered: true,
        unhealthy: false,
        machineless: false,
    }
}

fn deleting(m: Member) -> Member {
    Member {
        deleting: true,
        ..m
    }
}

fn pending(name: &str) -> Member {
    Member {
        registered: false,
        ..member(name, None)
    }
}

fn read(group: GroupRead, members: Vec<Member>) -> Read {
    Read { group, members }
}

fn remove(names: &[&str]) -> Removal {
    Removal::new(
        "md",
        Purpose::DeleteNodes,
        names.iter().map(|s| s.to_string()),
        Vec::<String>::new(),
        100,
    )
}

fn group_write(next: Next) -> GroupWrite {
    match next {
        Next::Write(Write::Group(w)) => w,
        other => panic!("expected a group write, got {other:?}"),
    }
}

// ===== records =====

#[test]
fn marks_carry_their_stamp_and_are_told_from_others() {
    assert_eq!(
        our_mark_stamp(&our_mark(1_700_000_000)),
        Some(1_700_000_000)
    );
    assert!(is_our_mark(&our_mark(5)));
    assert_eq!(our_mark_stamp("yes"), None);
    assert!(!is_our_mark("2024-01-02 15:04:05 +0000 UTC"));
}

#[test]
fn entries_name_exactly_one_mark() {
    let ours = mark_entry("m0", 7);
    let e = Entry::parse(&ours).expect("parses");
    assert!(e.names("m0", &our_mark(7)));
    assert!(
        !e.names("m0", &our_mark(8)),
        "a later mark is another removal"
    );
    assert!(!e.names("m1", &our_mark(7)));
    let foreign = foreign_entry("m0", "yes", 9);
    let f = Entry::parse(&foreign).expect("parses");
    assert!(f.names("m0", "yes"));
    assert!(!f.names("m0", "no"), "another value is another removal");
    assert_eq!(entry_for("m0", &our_mark(3), 99), mark_entry("m0", 3));
    assert_eq!(
        pool_node_entry("aws:///us-east-1a/i-1"),
        pool_node_entry("aws:////i-1"),
        "any spelling of one providerID"
    );
    assert_eq!(Entry::parse("garbage"), None);
}

#[test]
fn a_fresh_stamp_comes_after_every_recorded_one_of_its_machine() {
    let ledger = Ledger::parse(Some("m0@100,m1@500"));
    let back = Ledger::parse(Some("m0@200"));
    assert_eq!(Ledger::fresh_stamp("m0", 150, &[&ledger, &back]), 201);
    assert_eq!(Ledger::fresh_stamp("m2", 150, &[&ledger, &back]), 150);
}

#[test]
fn resize_tokens_keep_the_newest() {
    let mut r = Resizes::default();
    for i in 0..20 {
        r = r.with(&format!("t{i}"));
    }
    assert!(r.contains("t19") && !r.contains("t0"));
    assert_eq!(Resizes::parse(Some(&r.render())), r);
}

// ===== accounts =====

#[test]
fn a_group_balances_when_every_mark_has_its_unit_of_surplus() {
    // 3 Machines, replicas 2, m0's removal settled: balanced.
    let r = read(
        group(2, "m0@5", "", ""),
        vec![
            member("m0", Some(&our_mark(5))),
            member("m1", None),
            member("m2", None),
        ],
    );
    assert_eq!(r.accounts(&Default::default()).balance(), 0);
    // A raise since: the settled mark is beyond what replicas remove (absorbed).
    let raised = read(group(3, "m0@5", "", ""), r.members.clone());
    assert_eq!(raised.accounts(&Default::default()).balance(), -1);
    // Someone else's mark without a decrement: uncovered.
    let foreign = read(
        group(3, "", "", ""),
        vec![
            member("m0", Some("yes")),
            member("m1", None),
            member("m2", None),
        ],
    );
    assert_eq!(foreign.accounts(&Default::default()).balance(), -1);
    // Replicas lowered by hand, Cluster API not acted yet: surplus no mark explains.
    let by_hand = read(
        group(2, "", "", ""),
        vec![member("m0", None), member("m1", None), member("m2", None)],
    );
    assert_eq!(by_hand.accounts(&Default::default()).balance(), 1);
}

#[test]
fn a_claimed_mark_cluster_api_took_is_owed_until_settled() {
    // Finding 1: m1 (settled) and m0 (claimed) marked, replicas 2 of 3; the MachineSet took m0 for
    // m1's decrement. m1 is uncovered now, but m0's settlement is owed: balanced.
    let r = read(
        group(2, "m1@5", "m0@6", ""),
        vec![
            deleting(member("m0", Some(&our_mark(6)))),
            member("m1", Some(&our_mark(5))),
            member("m2", None),
        ],
    );
    let a = r.accounts(&Default::default());
    assert_eq!((a.surplus, a.owed, a.settled), (0, 1, 1));
    assert_eq!(a.balance(), 0);
    // Its Machine gone altogether: still owed, from the claim alone.
    let gone = read(
        group(2, "m1@5", "m0@6", ""),
        vec![member("m1", Some(&our_mark(5))), member("m2", None)],
    );
    assert_eq!(gone.accounts(&Default::default()).owed, 1);
}

// ===== a removal =====

#[test]
fn a_removal_claims_then_marks_then_settles_with_one_decrement() {
    let mut op = remove(&["m1"]);
    let start = read(
        group(3, "", "", ""),
        vec![member("m0", None), member("m1", None), member("m2", None)],
    );
    let claim = group_write(op.read(&start));
    assert_eq!(claim.claims, Some(Ledger::parse(Some("m1@100"))));
    assert_eq!(claim.replicas, None, "nothing lowered before the mark");
    assert_eq!(
        op.wrote(Outcome::Landed),
        Next::Write(Write::Mark {
            machine: "m1".into(),
            version: "v-m1".into(),
            value: our_mark(100),
        }),
        "the claim landed over the version read: the mark as planned, guarded by m1's version read"
    );
    assert_eq!(op.wrote(Outcome::Landed), Next::Read);
    let marked = read(
        group(3, "", "m1@100", ""),
        vec![
            member("m0", None),
            member("m1", Some(&our_mark(100))),
            member("m2", None),
        ],
    );
    let settle = group_write(op.read(&marked));
    assert_eq!(settle.replicas, Some(2));
    assert_eq!(settle.ledger, Some(Ledger::parse(Some("m1@100"))));
    assert_eq!(settle.claims, Some(Ledger::default()));
    assert_eq!(
        op.wrote(Outcome::Landed),
        Next::Done(Ok(())),
        "every claim settled: answered without another read"
    );
}

/// The mark follows the claim with the Machine's version the claim was decided from: someone
/// marked m1 in between, so the mark conflicts, and the removal decides again from a fresh read
/// (m1 claimed with the mark it carries, kept as it is) instead of writing over it.
#[test]
fn a_machine_marked_between_the_claim_and_its_mark_is_decided_again_from_a_fresh_read() {
    let mut op = remove(&["m1"]);
    let start = read(
        group(3, "", "", ""),
        vec![member("m0", None), member("m1", None), member("m2", None)],
    );
    group_write(op.read(&start));
    assert!(matches!(
        op.wrote(Outcome::Landed),
        Next::Write(Write::Mark { ref version, .. }) if version == "v-m1"
    ));
    assert_eq!(op.wrote(Outcome::Conflict), Next::Read, "decided again");
    let theirs = Member {
        version: "v-m1-marked".into(),
        ..member("m1", Some("yes"))
    };
    let fresh = read(
        group(3, "", "m1@100", ""),
        vec![member("m0", None), theirs, member("m2", None)],
    );
    let next = op.read(&fresh);
    assert!(
        !matches!(next, Next::Write(Write::Mark { .. })),
        "someone else's mark is kept: {next:?}"
    );
    let claim = group_write(next);
    let claims = claim
        .claims
        .expect("m1 claimed again, with the mark it carries");
    assert!(
        claims.contains(&foreign_entry("m1", "yes", 100)),
        "{claims:?}"
    );
    assert_eq!(op.wrote(Outcome::Landed), Next::Read, "no mark to write");
    let claimed = read(
        GroupRead {
            claims: claims.clone(),
            ..group(3, "", "", "")
        },
        fresh.members.clone(),
    );
    let settle = group_write(op.read(&claimed));
    assert_eq!(
        settle.replicas,
        Some(2),
        "one decrement for m1, marked as it is"
    );
    assert_eq!(op.wrote(Outcome::Landed), Next::Done(Ok(())));
}

/// A settle write that settles only some of the claims (Cluster API took m2; m1 waits, as
/// someone else's mark leaves the group short) does not answer: the claim left waits for a read.
#[test]
fn a_settle_that_leaves_a_claim_pending_reads_again() {
    let mut op = remove(&["m1", "m2"]);
    let members = vec![member("m0", None), member("m1", None), member("m2", None)];
    let claim = group_write(op.read(&read(group(3, "", "", ""), members)));
    assert_eq!(claim.claims, Some(Ledger::parse(Some("m1@100,m2@100"))));
    for _ in 0..2 {
        assert!(matches!(
            op.wrote(Outcome::Landed),
            Next::Write(Write::Mark { .. })
        ));
    }
    assert_eq!(op.wrote(Outcome::Landed), Next::Read);
    let short = read(
        group(3, "", "m1@100,m2@100", ""),
        vec![
            member("m0", Some("yes")),
            member("m1", Some(&our_mark(100))),
            deleting(member("m2", Some(&our_mark(100)))),
        ],
    );
    let settle = group_write(op.read(&short));
    assert_eq!(
        settle.ledger,
        Some(Ledger::parse(Some("m2@100"))),
        "only what Cluster API acted on"
    );
    assert_eq!(op.wrote(Outcome::Landed), Next::Read);
}

#[test]
fn a_pool_node_without_a_machine_is_claimed_then_settled_with_one_decrement() {
    let node = pool_node_entry("test:///pool-1");
    let mut op = Removal::new(
        "pool",
        Purpose::DeleteNodes,
        [node.clone()],
        Vec::<String>::new(),
        100,
    );
    let pool_member = Member {
        machineless: true,
        ..member(&node, None)
    };
    let start = read(group(1, "", "", ""), vec![pool_member.clone()]);
    let claim = group_write(op.read(&start));
    assert_eq!(claim.claims, Some(Ledger::parse(Some(&node))));
    assert_eq!(op.wrote(Outcome::Landed), Next::Read);
    // Its own claim is not someone else's reserved decrement: lowering to min 0 is in bounds.
    let claimed = read(group(1, "", &node, ""), vec![pool_member]);
    let settle = group_write(op.read(&claimed));
    assert_eq!(settle.replicas, Some(0));
    assert_eq!(settle.ledger, Some(Ledger::parse(Some(&node))));
    assert_eq!(settle.claims, Some(Ledger::default()));
}

/// A mark taken back, then the same Machine removed again as a fresh removal (a later stamp) and
/// deleted by Cluster API: the old taking-back entry is owed nothing; it neither weighs on the
/// next removal nor is settled, and the repair drops it.
#[test]
fn a_taken_back_entry_a_later_removal_replaced_is_owed_nothing_and_dropped() {
    let members = vec![member("m0", None), member("m1", None), member("m2", None)];
    // m3 was taken back (stamp 100), removed again (stamp 200, settled) and deleted.
    let after = read(group(3, "", "", "m3@100"), members.clone());
    let mut op = remove(&["m1"]);
    let claim = group_write(op.read(&read(
        GroupRead {
            ledger: Ledger::parse(Some("m3@200")),
            ..after.group.clone()
        },
        members,
    )));
    assert_eq!(
        claim.claims,
        Some(Ledger::parse(Some("m1@100"))),
        "the next removal proceeds: nothing is owed for m3@100"
    );
    let superseded = read(
        GroupRead {
            ledger: Ledger::parse(Some("m3@200")),
            ..after.group
        },
        after.members,
    );
    assert!(superseded.gone_claims().is_empty());
    let mut repair = Repair::new(Ripe::All);
    let cleaned = group_write(repair.read(&superseded));
    assert_eq!(cleaned.replicas, None, "nothing settled for it");
    assert_eq!(cleaned.taking_back, Some(Ledger::default()));
}

/// The infrastructure picks which pool instance a decrement removes: one named after it removed
/// it for another decrement is still one decrement (unless its removal is recorded).
#[test]
fn a_pool_node_the_infrastructure_already_removed_is_still_one_decrement() {
    let gone = pool_node_entry("test:///pool-7");
    let listed = Member {
        machineless: true,
        ..member(&pool_node_entry("test:///pool-5"), None)
    };
    let mut op = Removal::new(
        "pool",
        Purpose::DeleteNodes,
        [gone.clone()],
        Vec::<String>::new(),
        100,
    );
    let claim = group_write(op.read(&read(group(2, "", "", ""), vec![listed.clone()])));
    assert_eq!(claim.claims, Some(Ledger::parse(Some(&gone))));
    assert_eq!(op.wrote(Outcome::Landed), Next::Read);
    let settle = group_write(op.read(&read(group(2, "", &gone, ""), vec![listed.clone()])));
    assert_eq!(settle.replicas, Some(1));
    // Recorded already (CA's retry): nothing more.
    let mut retry = Removal::new(
        "pool",
        Purpose::DeleteNodes,
        [gone.clone()],
        Vec::<String>::new(),
        200,
    );
    assert_eq!(
        retry.read(&read(group(1, &gone, "", ""), vec![listed])),
        Next::Done(Ok(()))
    );
}

/// A mark taken back (its record still there, the unmark landed), then the node removed again:
/// the fresh claim drops the old record, so none is left to be taken for owed once Cluster API
/// deletes the Machine for the new removal (and the ledger entry of that one is pruned).
#[test]
fn a_fresh_claim_drops_the_records_of_its_machines_earlier_removals_taken_back() {
    let members = vec![member("m0", None), member("m1", None), member("m2", None)];
    let mut op = remove(&["m1"]);
    let claim = group_write(op.read(&read(group(3, "", "", "m1@50"), members)));
    assert_eq!(claim.claims, Some(Ledger::parse(Some("m1@100"))));
    assert_eq!(claim.taking_back, Some(Ledger::default()));
}

#[test]
fn a_removal_waits_while_another_mark_is_uncovered_and_writes_nothing() {
    let mut op = remove(&["m1"]);
    let r = read(
        group(3, "", "", ""),
        vec![
            member("m0", Some("yes")),
            member("m1", None),
            member("m2", None),
        ],
    );
    match op.read(&r) {
        Next::Wait(Refusal::Precondition(m)) => assert!(m.contains("other Machines"), "{m}"),
        other => panic!("expected a wait, got {other:?}"),
    }
    assert!(
        matches!(op.expired(), Next::Done(Err(Refusal::Precondition(_)))),
        "nothing written: refused at once when the time is up"
    );
}

#[test]
fn a_mark_cluster_api_took_for_another_decrement_is_settled_so_that_one_goes_too() {
    // Finding 1: this removal's m0 was taken for m1's decrement before it settled.
    let mut op = remove(&["m0"]);
    let claimed = read(
        group(2, "m1@5", "", ""),
        vec![
            member("m0", None),
            member("m1", Some(&our_mark(5))),
            member("m2", None),
        ],
    );
    let _ = group_write(op.read(&claimed));
    op.wrote(Outcome::Landed);
    let _ = op.read(&read(
        group(2, "m1@5", "m0@100", ""),
        claimed.members.clone(),
    ));
    op.wrote(Outcome::Landed);
    let taken = read(
        group(2, "m1@5", "m0@100", ""),
        vec![
            deleting(member("m0", Some(&our_mark(100)))),
            member("m1", Some(&our_mark(5))),
            member("m2", None),
        ],
    );
    let settle = group_write(op.read(&taken));
    assert_eq!(
        settle.replicas,
        Some(1),
        "settled with its decrement: m1 goes as well"
    );
    assert!(settle.ledger.is_some_and(|l| l.contains("m0@100")));
}

#[test]
fn a_removal_taken_by_someone_elses_decrement_is_credited_not_paid_again() {
    // Finding 3's other half: replicas lowered by hand while m1 was claimed and marked; Cluster
    // API deleted m1 for it. Paying again would delete an unmarked Machine.
    let mut op = remove(&["m1"]);
    let start = read(
        group(3, "", "", ""),
        vec![member("m0", None), member("m1", None), member("m2", None)],
    );
    let _ = op.read(&start);
    op.wrote(Outcome::Landed);
    let _ = op.read(&read(group(3, "", "m1@100", ""), start.members.clone()));
    op.wrote(Outcome::Landed);
    let by_hand = read(
        group(2, "", "m1@100", ""),
        vec![
            member("m0", None),
            deleting(member("m1", Some(&our_mark(100)))),
            member("m2", None),
        ],
    );
    let settle = group_write(op.read(&by_hand));
    assert_eq!(settle.replicas, None, "credited: no decrement");
    assert!(settle.ledger.is_some_and(|l| l.contains("m1@100")));
}

#[test]
fn a_removal_whose_mark_a_raise_absorbed_is_refused_not_paid_again() {
    let mut op = remove(&["m1"]);
    let r = read(
        group(3, "m1@5", "", ""),
        vec![
            member("m0", None),
            member("m1", Some(&our_mark(5))),
            member("m2", None),
        ],
    );
    match op.read(&r) {
        Next::Wait(Refusal::Precondition(m)) => assert!(m.contains("absorbed"), "{m}"),
        other => panic!("expected a wait, got {other:?}"),
    }
}

#[test]
fn a_removal_that_runs_out_of_time_takes_its_mark_back_through_the_record() {
    let mut op = remove(&["m1"]);
    let start = read(
        group(3, "", "", ""),
        vec![member("m0", None), member("m1", None), member("m2", None)],
    );
    let _ = op.read(&start);
    op.wrote(Outcome::Landed);
    let _ = op.read(&read(group(3, "", "m1@100", ""), start.members.clone()));
    op.wrote(Outcome::Landed);
    // A raise landed meanwhile: the group no longer balances for the new mark.
    let raised = read(
        group(4, "", "m1@100", ""),
        vec![
            member("m0", None),
            member("m1", Some(&our_mark(100))),
            member("m2", None),
        ],
    );
    assert!(matches!(op.read(&raised), Next::Wait(_)));
    assert_eq!(op.expired(), Next::Read);
    let record = group_write(op.read(&raised));
    assert_eq!(record.claims, Some(Ledger::default()));
    assert_eq!(record.taking_back, Some(Ledger::parse(Some("m1@100"))));
    assert_eq!(record.replicas, None);
    assert_eq!(op.wrote(Outcome::Landed), Next::Read);
    let recorded = read(group(4, "", "", "m1@100"), raised.members.clone());
    assert_eq!(
        op.read(&recorded),
        Next::Write(Write::Unmark {
            machine: "m1".into(),
            version: "v-m1".into()
        })
    );
    assert_eq!(op.wrote(Outcome::Landed), Next::Read);
    let unmarked = read(
        group(4, "", "", "m1@100"),
        vec![member("m0", None), member("m1", None), member("m2", None)],
    );
    assert!(matches!(op.read(&unmarked), Next::Done(Err(_))));
}

#[test]
fn a_pinned_machine_that_got_its_node_is_never_settled() {
    let mut op = Removal::new(
        "md",
        Purpose::Pin,
        ["p0".to_string()],
        ["p0".to_string()],
        100,
    );
    let start = read(
        group(3, "", "", ""),
        vec![member("m0", None), member("m1", None), pending("p0")],
    );
    let _ = op.read(&start);
    op.wrote(Outcome::Landed);
    let _ = op.read(&read(group(3, "", "p0@100", ""), start.members.clone()));
    op.wrote(Outcome::Landed);
    let registered = read(
        group(3, "", "p0@100", ""),
        vec![
            member("m0", None),
            member("m1", None),
            member("p0", Some(&our_mark(100))),
        ],
    );
    let record = group_write(op.read(&registered));
    assert_eq!(record.replicas, None, "taken back, never settled");
    assert_eq!(record.taking_back, Some(Ledger::parse(Some("p0@100"))));
}

#[test]
fn a_retry_of_a_settled_removal_writes_nothing() {
    let mut op = remove(&["m1"]);
    let r = read(
        group(2, "m1@5", "", ""),
        vec![
            member("m0", None),
            member("m1", Some(&our_mark(5))),
            member("m2", None),
        ],
    );
    assert_eq!(op.read(&r), Next::Done(Ok(())));
}

#[test]
fn a_removal_beyond_min_counting_the_other_claims_is_refused_before_anything_is_written() {
    let mut op = remove(&["m1"]);
    let mut g = group(3, "", "m0@7", "");
    g.bounds = Ok((2, 5));
    let r = read(
        g,
        vec![
            member("m0", Some(&our_mark(7))),
            member("m1", None),
            member("m2", None),
        ],
    );
    assert!(matches!(
        op.read(&r),
        Next::Done(Err(Refusal::OutOfBounds { desired: 2, .. }))
    ));
}

#[test]
fn a_removal_is_refused_while_the_group_is_held() {
    for hold in [
        Hold::RollingOut("MachineDeployment ns/md".into()),
        Hold::Paused("paused".into()),
        Hold::Topology("replicas set by the topology".into()),
    ] {
        let mut g = group(3, "", "", "");
        g.hold = Some(hold);
        let r = read(
            g,
            vec![member("m0", None), member("m1", None), member("m2", None)],
        );
        assert!(matches!(
            remove(&["m1"]).read(&r),
            Next::Done(Err(Refusal::Precondition(_)))
        ));
    }
}

// ===== size changes =====

#[test]
fn a_raise_is_written_once_even_when_its_answer_is_lost() {
    let mut op = Raise::new("md", 2, "t1");
    let w = group_write(op.read(&read(group(1, "", "", ""), vec![])));
    assert_eq!(w.replicas, Some(3));
    assert_eq!(op.wrote(Outcome::Unknown), Next::Read);
    let mut landed = group(3, "", "", "");
    landed.resizes = Resizes::default().with("t1");
    assert_eq!(op.read(&read(landed, vec![])), Next::Done(Ok(())));
    assert!(matches!(
        Raise::new("md", 5, "t2").read(&read(group(1, "", "", ""), vec![])),
        Next::Done(Err(Refusal::OutOfBounds { desired: 6, .. }))
    ));
}

/// The shell lists neither MachineSets nor Machines for a raise: whatever its members, what Cluster
/// API observed and a rollout, a raise decides the same; every other operation (each reads marks,
/// registrations and what Cluster API observed) asks for them.
#[test]
fn a_raise_decides_from_the_group_and_its_cluster_alone_and_only_a_raise_skips_the_lists() {
    let members = vec![
        member("m0", None),
        member("m1", Some(&our_mark(7))),
        member("m2", Some("yes")),
    ];
    let rolling_out = Some(Hold::RollingOut("new MachineSet".into()));
    for replicas in [1, 2, 3, 4] {
        let g = group(replicas, "", "", "");
        let with = Raise::new("md", 2, "t").read(&read(g.clone(), members.clone()));
        let mut stale = g.clone();
        stale.observed = false;
        stale.hold = rolling_out.clone();
        let without = Raise::new("md", 2, "t").read(&read(stale, vec![]));
        assert_eq!(with, without, "replicas {replicas}");
    }
    assert!(!Operation::Raise(Raise::new("md", 1, "t")).reads_members());
    assert!(Operation::Cancel(Cancel::new("md", 1, "t", 1)).reads_members());
    assert!(Operation::Remove(remove(&["m1"])).reads_members());
    assert!(Operation::Repair(Repair::new(Ripe::All)).reads_members());
}

#[test]
fn capacity_without_a_machine_is_cancelled_only_once_cluster_api_has_acted() {
    let members = vec![member("m0", None), member("m1", None)];
    let mut not_observed = group(3, "", "", "");
    not_observed.observed = false;
    assert!(matches!(
        Cancel::new("md", 1, "t", 1).read(&read(not_observed, members.clone())),
        Next::Wait(_)
    ));
    // Observed, but its MachineSet is still creating the third Machine: its Machine is pinned later.
    assert!(matches!(
        Cancel::new("md", 1, "t", 1).read(&read(group(3, "", "", ""), members.clone())),
        Next::Wait(_)
    ));
    // A preflight check holds the creation: nothing will come, cancelled by a decrement.
    let mut held = group(3, "", "", "");
    held.held = true;
    let w = group_write(Cancel::new("md", 1, "t", 1).read(&read(held, members)));
    assert_eq!(w.replicas, Some(2));
}

/// A Machine being deleted still counts toward its MachineSet's replicas, but once it is gone the
/// MachineSet creates its replacement: a decrement decided while it is deleting races that
/// replacement, which may register before the MachineSet acts on the decrement (Cluster API then
/// deletes a registered Machine, unmarked: seen with the real manager). So the cancellation waits
/// for the replacement and pins it.
#[test]
fn the_replacement_of_a_machine_being_deleted_is_pinned_not_raced_by_a_decrement() {
    let mut members = vec![
        member("m0", None),
        member("m1", None),
        deleting(member("m2", None)),
    ];
    assert!(
        matches!(
            Cancel::new("md", 1, "t", 100).read(&read(group(3, "", "", ""), members.clone())),
            Next::Wait(_)
        ),
        "no decrement while the MachineSet has a replacement to create"
    );
    // m2 gone, its replacement p0 created: pinned (claimed and marked) before the decrement.
    members.pop();
    members.push(pending("p0"));
    let claim =
        group_write(Cancel::new("md", 1, "t", 100).read(&read(group(3, "", "", ""), members)));
    assert_eq!(claim.replicas, None);
    assert_eq!(claim.claims, Some(Ledger::parse(Some("p0@100"))));
}

#[test]
fn a_decrease_pins_pending_machines_and_never_reaches_a_registered_one() {
    let members = vec![member("m0", None), member("m1", None), pending("p0")];
    let claim = group_write(
        Cancel::new("md", 1, "t", 100).read(&read(group(3, "", "", ""), members.clone())),
    );
    assert_eq!(
        claim.claims,
        Some(Ledger::parse(Some("p0@100"))),
        "p0 pinned first"
    );
    assert!(matches!(
        Cancel::new("md", 2, "t", 100).read(&read(group(3, "", "", ""), members)),
        Next::Done(Err(Refusal::Precondition(m))) if m.contains("attempt to delete existing nodes")
    ));
}

#[test]
fn cancellation_follows_cluster_apis_order() {
    let sick = Member {
        unhealthy: true,
        ..member("a-sick", None)
    };
    let members = vec![sick, pending("p0"), member("m1", None)];
    assert!(
        matches!(
            cancellation(&members, 3, 1),
            Err(Cancellation::Unhealthy(names)) if names == ["a-sick"]
        ),
        "a registered unhealthy Machine sorting first goes before the pending one"
    );
    let members = [pending("p0"), member("m1", None)];
    let plan = cancellation_plan(&members, 3, 2).expect("allowed");
    assert_eq!((plan.uncreated, plan.pin), (1, vec!["p0"]));
}

#[test]
fn writes_stay_in_bounds_or_move_toward_them() {
    assert!(within_bounds(2, 3, 1, 5));
    assert!(!within_bounds(2, 6, 1, 5));
    assert!(within_bounds(7, 6, 1, 5), "from above max, down toward it");
    assert!(!within_bounds(7, 8, 1, 5));
    assert!(within_bounds(0, 1, 1, 5), "from below min, up toward it");
    assert!(!within_bounds(0, 0, 1, 5) || within_bounds(0, 0, 0, 5));
}

// ===== the repair =====

#[test]
fn the_repair_settles_what_cluster_api_acted_on_first() {
    let r = read(
        group(2, "m1@5", "m0@6", ""),
        vec![member("m1", Some(&our_mark(5))), member("m2", None)],
    );
    let w = group_write(Repair::new(Ripe::Only(Default::default())).read(&r));
    assert_eq!(
        w.replicas,
        Some(1),
        "m0 went for m1's decrement: settled, so m1 goes too"
    );
    assert!(w.ledger.is_some_and(|l| l.contains("m0@6")));
}

/// A group with no records and no mark on any member (pending, running or being deleted): a round
/// has nothing to write whatever is ripe, so the repair loop skips it unread. Each record alone,
/// and a mark alone, anyone's, is work.
#[test]
fn the_repair_has_work_only_where_records_or_marks_are() {
    let plain = read(
        group(3, "", "", ""),
        vec![
            member("m0", None),
            deleting(member("m1", None)),
            pending("m2"),
        ],
    );
    for ripe in [Ripe::All, Ripe::Only(Default::default())] {
        assert_eq!(Repair::new(ripe).read(&plain), Next::Done(Ok(())));
    }
    assert!(!repair_has_work([None, Some(""), Some(" , ")], false));
    for records in [
        [Some("m1@5"), None, None],
        [None, Some("m1@5"), None],
        [None, None, Some("m1@5")],
    ] {
        assert!(repair_has_work(records, false), "{records:?}");
    }
    assert!(repair_has_work([None; 3], true));
    let unrecorded = read(
        group(3, "", "", ""),
        vec![
            member("m0", Some(&our_mark(5))),
            member("m1", None),
            member("m2", None),
        ],
    );
    assert!(
        matches!(Repair::new(Ripe::All).read(&unrecorded), Next::Write(_)),
        "a mark with no record is taken back: a group the loop counts as work"
    );
}

/// Three Machines, m1 marked by a removal stamped `stamp` that claimed it and stopped there.
fn claimed_m1(stamp: u64) -> Read {
    read(
        group(3, "", &format!("m1@{stamp}"), ""),
        vec![
            member("m0", None),
            member("m1", Some(&our_mark(stamp))),
            member("m2", None),
        ],
    )
}

/// A stamped record is ripe once the API server's clock is the grace period past its stamp, not
/// a second before; an unstamped one (a MachinePool instance's) only when the caller has seen it
/// wait that long.
#[test]
fn records_ripen_by_their_stamp_on_the_servers_clock_and_unstamped_ones_by_the_callers_sight() {
    let claimed = claimed_m1(100);
    let aged = |now| Ripe::Aged {
        now,
        grace: 30,
        unstamped: Default::default(),
    };
    assert_eq!(
        Repair::new(aged(129)).read(&claimed),
        Next::Done(Ok(())),
        "29 s old on the server's clock: a removal may be in flight"
    );
    let w = group_write(Repair::new(aged(130)).read(&claimed));
    assert_eq!(w.taking_back, Some(Ledger::parse(Some("m1@100"))));

    let unlisted = pool_node_entry("aws:///a/i-1");
    let pool = read(group(3, &unlisted, "", ""), vec![member("m0", None)]);
    let mut fresh = Repair::new(aged(u64::MAX));
    assert_eq!(
        fresh.read(&pool),
        Next::Done(Ok(())),
        "no stamp: no age from the server's clock"
    );
    assert!(fresh.seen().contains(&unlisted));
    let waited = Ripe::Aged {
        now: 0,
        grace: 30,
        unstamped: [unlisted.clone()].into(),
    };
    let w = group_write(Repair::new(waited).read(&pool));
    assert!(w.ledger.is_none_or(|l| !l.contains(&unlisted)));
}

#[test]
fn the_repair_takes_back_only_ripe_records_and_absorbed_marks_once_observed() {
    let claimed = claimed_m1(6);
    let mut young = Repair::new(Ripe::Only(Default::default()));
    assert_eq!(
        young.read(&claimed),
        Next::Done(Ok(())),
        "a removal may be in flight"
    );
    assert!(young.seen().contains("m1@6"));
    let ripe = group_write(Repair::new(Ripe::Only(["m1@6".to_string()].into())).read(&claimed));
    assert_eq!(ripe.taking_back, Some(Ledger::parse(Some("m1@6"))));
    let absorbed = read(
        group(3, "m1@5", "", ""),
        vec![
            member("m0", None),
            member("m1", Some(&our_mark(5))),
            member("m2", None),
        ],
    );
    let w = group_write(Repair::new(Ripe::Only(Default::default())).read(&absorbed));
    assert_eq!(w.taking_back, Some(Ledger::parse(Some("m1@5"))));
    let mut not_observed = absorbed.clone();
    not_observed.group.observed = false;
    assert_eq!(
        Repair::new(Ripe::Only(Default::default())).read(&not_observed),
        Next::Done(Ok(())),
        "Cluster API may still delete it for the count before the raise"
    );
}
