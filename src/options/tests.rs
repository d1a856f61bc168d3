//! Unit tests of `options`.

use super::*;
use crate::capi::Labels;
use std::collections::BTreeMap;

const NS_PER_S: i64 = 1_000_000_000;

#[test]
fn go_durations() {
    let cases: &[(&str, Result<i64, ()>)] = &[
        ("0", Ok(0)),
        ("+0", Ok(0)),
        ("-0", Ok(0)),
        ("5s", Ok(5 * NS_PER_S)),
        ("30s", Ok(30 * NS_PER_S)),
        ("1478s", Ok(1478 * NS_PER_S)),
        ("-5s", Ok(-5 * NS_PER_S)),
        ("+5s", Ok(5 * NS_PER_S)),
        ("-0s", Ok(0)),
        ("+0s", Ok(0)),
        ("5.0s", Ok(5 * NS_PER_S)),
        ("5.6s", Ok(5 * NS_PER_S + 600_000_000)),
        ("5.s", Ok(5 * NS_PER_S)),
        (".5s", Ok(NS_PER_S / 2)),
        ("1.0s", Ok(NS_PER_S)),
        ("1.00s", Ok(NS_PER_S)),
        ("1.004s", Ok(NS_PER_S + 4_000_000)),
        ("1.0040s", Ok(NS_PER_S + 4_000_000)),
        ("100.00100s", Ok(100 * NS_PER_S + 1_000_000)),
        ("10ns", Ok(10)),
        ("11us", Ok(11_000)),
        ("12µs", Ok(12_000)),
        ("12μs", Ok(12_000)),
        ("13ms", Ok(13_000_000)),
        ("14s", Ok(14 * NS_PER_S)),
        ("15m", Ok(15 * 60 * NS_PER_S)),
        ("16h", Ok(16 * 3600 * NS_PER_S)),
        ("3h30m", Ok((3 * 3600 + 30 * 60) * NS_PER_S)),
        ("1h30m", Ok(90 * 60 * NS_PER_S)),
        ("90s", Ok(90 * NS_PER_S)),
        ("1.5h", Ok(90 * 60 * NS_PER_S)),
        ("300ms", Ok(300_000_000)),
        ("2us", Ok(2_000)),
        (
            "10.5s4m",
            Ok(4 * 60 * NS_PER_S + 10 * NS_PER_S + 500_000_000),
        ),
        (
            "-2m3.4s",
            Ok(-(2 * 60 * NS_PER_S + 3 * NS_PER_S + 400_000_000)),
        ),
        (
            "1h2m3s4ms5us6ns",
            Ok(3600 * NS_PER_S + 2 * 60 * NS_PER_S + 3 * NS_PER_S + 4_000_000 + 5_000 + 6),
        ),
        (
            "39h9m14.425s",
            Ok(39 * 3600 * NS_PER_S + 9 * 60 * NS_PER_S + 14 * NS_PER_S + 425_000_000),
        ),
        ("52763797000ns", Ok(52_763_797_000)),
        ("0.3333333333333333333h", Ok(20 * 60 * NS_PER_S)),
        ("9007199254740993ns", Ok(9_007_199_254_740_993)),
        ("9223372036854775807ns", Ok(i64::MAX)),
        ("9223372036854775.807us", Ok(i64::MAX)),
        ("9223372036s854ms775us807ns", Ok(i64::MAX)),
        ("-9223372036854775808ns", Ok(i64::MIN)),
        ("-9223372036854775.808us", Ok(i64::MIN)),
        ("-9223372036s854ms775us808ns", Ok(i64::MIN)),
        ("-2562047h47m16.854775808s", Ok(i64::MIN)),
        ("0.100000000000000000000h", Ok(6 * 60 * NS_PER_S)),
        (
            "0.830103483285477580700h",
            Ok(49 * 60 * NS_PER_S + 48_372_539_827),
        ),
        // errors
        ("", Err(())),
        ("3", Err(())),
        ("-", Err(())),
        ("s", Err(())),
        (".", Err(())),
        ("-.", Err(())),
        (".s", Err(())),
        ("+.s", Err(())),
        ("1d", Err(())),
        ("\u{85}\u{85}", Err(())),
        ("\u{FFFD}", Err(())),
        ("9223372036854775810ns", Err(())),
        ("9223372036854775808ns", Err(())),
        ("-9223372036854775809ns", Err(())),
        ("9223372036854776us", Err(())),
        ("3000000h", Err(())),
        ("9223372036854775.808us", Err(())),
        ("9223372036854ms775us808ns", Err(())),
        ("1h 30m", Err(())),
        (" 1h", Err(())),
        ("1H", Err(())),
    ];
    for (input, want) in cases {
        let got = parse_go_duration(input);
        match want {
            Ok(n) => assert_eq!(got, Ok(*n), "{input:?}"),
            Err(()) => assert!(got.is_err(), "{input:?} parsed as {got:?}"),
        }
    }
}

fn keys() -> Keys {
    Keys::default()
}

fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| {
            (
                format!("cluster.x-k8s.io/autoscaling-options-{k}"),
                v.to_string(),
            )
        })
        .collect()
}

const OBJ: &str = "MachineDeployment default/md-0";

#[test]
fn no_option_annotations_is_none() {
    let mut a = BTreeMap::new();
    a.insert(
        "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size".to_string(),
        "3".to_string(),
    );
    a.insert(
        "example.com/autoscaling-options-scaledownunneededtime".to_string(),
        "1m".to_string(),
    );
    let (opts, problems) = parse(&keys(), OBJ, &Labels::from(a.clone()));
    assert_eq!(opts, None);
    assert!(problems.is_empty());
}

#[test]
fn every_option_parses() {
    let a = ann(&[
        ("scaledownutilizationthreshold", "0.6"),
        ("scaledowngpuutilizationthreshold", "1"),
        ("scaledownunneededtime", "1h30m"),
        ("scaledownunreadytime", "90s"),
        ("maxnodeprovisiontime", "1.5h"),
        ("zeroormaxnodescaling", "True"),
        ("ignoredaemonsetsutilization", "false"),
    ]);
    let (opts, problems) = parse(&keys(), OBJ, &Labels::from(a.clone()));
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(
        opts,
        Some(GroupOptions {
            scale_down_utilization_threshold: Some(0.6),
            scale_down_gpu_utilization_threshold: Some(1.0),
            scale_down_unneeded_time: Some(Duration::from_secs(5400)),
            scale_down_unready_time: Some(Duration::from_secs(90)),
            max_node_provision_time: Some(Duration::from_secs(5400)),
            zero_or_max_node_scaling: Some(true),
            ignore_daemonsets_utilization: Some(false),
        })
    );
}

#[test]
fn values_are_lowercased_and_trimmed() {
    let a = ann(&[
        ("scaledownunneededtime", " 10M "),
        ("zeroormaxnodescaling", "TRUE"),
    ]);
    let (opts, problems) = parse(&keys(), OBJ, &Labels::from(a.clone()));
    assert!(problems.is_empty(), "{problems:?}");
    let opts = opts.unwrap_or_default();
    assert_eq!(
        opts.scale_down_unneeded_time,
        Some(Duration::from_secs(600))
    );
    assert_eq!(opts.zero_or_max_node_scaling, Some(true));
}

#[test]
fn bad_values_are_problems_and_stay_default() {
    // (suffix, value, problem message fragment)
    let cases = [
        ("scaledownutilizationthreshold", "abc", "not a number"),
        ("scaledownutilizationthreshold", "1.5", "between 0 and 1"),
        ("scaledownutilizationthreshold", "-0.1", "between 0 and 1"),
        ("scaledownutilizationthreshold", "nan", "finite"),
        ("scaledowngpuutilizationthreshold", "inf", "finite"),
        ("scaledownunneededtime", "10", "missing unit"),
        ("scaledownunneededtime", "-1m", "negative"),
        ("scaledownunneededtime", "1d", "unknown unit"),
        ("maxnodeprovisiontime", "0", "delete every instance"),
        ("maxnodeprovisiontime", "0s", "delete every instance"),
        ("zeroormaxnodescaling", "yes", "not a boolean"),
        ("ignoredaemonsetsutilization", "", "empty value"),
        ("maxnodestartuptime", "10m", "externalgrpc"),
        ("scaledownunneededTime", "10m", "unknown option"),
        ("", "10m", "no option name"),
    ];
    for (suffix, value, fragment) in cases {
        let a = ann(&[(suffix, value), ("scaledownunreadytime", "5m")]);
        let (opts, problems) = parse(&keys(), OBJ, &Labels::from(a.clone()));
        assert_eq!(problems.len(), 1, "{suffix}={value}: {problems:?}");
        let p = &problems[0];
        assert_eq!(p.object, OBJ);
        assert_eq!(
            p.field,
            format!("metadata.annotations[cluster.x-k8s.io/autoscaling-options-{suffix}]")
        );
        assert!(
            p.message.contains(fragment),
            "{suffix}={value}: {}",
            p.message
        );
        // the good option still applies, the bad one stays default
        assert_eq!(
            opts,
            Some(GroupOptions {
                scale_down_unready_time: Some(Duration::from_secs(300)),
                ..GroupOptions::default()
            }),
            "{suffix}={value}"
        );
    }
}

#[test]
fn all_bad_is_none_with_problems() {
    let a = ann(&[("scaledownunneededtime", "soon"), ("frobnicate", "1")]);
    let (opts, problems) = parse(&keys(), OBJ, &Labels::from(a.clone()));
    assert_eq!(opts, None);
    assert_eq!(problems.len(), 2);
}

#[test]
fn custom_group_prefix() {
    let keys = Keys::new("test.k8s.io");
    let mut a = BTreeMap::new();
    a.insert(
        "test.k8s.io/autoscaling-options-scaledownunneededtime".to_string(),
        "2m".to_string(),
    );
    a.insert(
        "cluster.x-k8s.io/autoscaling-options-scaledownunreadytime".to_string(),
        "3m".to_string(),
    );
    let (opts, problems) = parse(&keys, OBJ, &Labels::from(a.clone()));
    assert!(problems.is_empty());
    assert_eq!(
        opts,
        Some(GroupOptions {
            scale_down_unneeded_time: Some(Duration::from_secs(120)),
            ..GroupOptions::default()
        })
    );
}

#[test]
fn merged_overrides_and_echoes() {
    let defaults = Defaults {
        scale_down_utilization_threshold: 0.5,
        scale_down_gpu_utilization_threshold: 0.5,
        scale_down_unneeded_time: Duration::from_secs(600),
        scale_down_unready_time: Duration::from_secs(1200),
        max_node_provision_time: Duration::from_secs(900),
        zero_or_max_node_scaling: false,
        ignore_daemonsets_utilization: true,
    };
    assert_eq!(GroupOptions::default().merged(&defaults), defaults);
    let opts = GroupOptions {
        scale_down_gpu_utilization_threshold: Some(0.2),
        max_node_provision_time: Some(Duration::from_secs(60)),
        zero_or_max_node_scaling: Some(true),
        ignore_daemonsets_utilization: Some(false),
        ..GroupOptions::default()
    };
    assert_eq!(
        opts.merged(&defaults),
        Defaults {
            scale_down_gpu_utilization_threshold: 0.2,
            max_node_provision_time: Duration::from_secs(60),
            zero_or_max_node_scaling: true,
            ignore_daemonsets_utilization: false,
            ..defaults.clone()
        }
    );
}

#[test]
fn durations_that_overflow_are_errors_not_panics() {
    for input in [
        "9223372036854775808ns9223372036854775808ns",
        "9223372036854775807ns1ns",
        "2562047h48m",
        "18446744073709551615ns",
        ".99999999999999999999999h9223372036854775807ns",
    ] {
        assert!(parse_go_duration(input).is_err(), "{input}");
    }
    assert_eq!(parse_go_duration("9223372036854775807ns"), Ok(i64::MAX));
}

/// Go's own messages, quoting the input: problems and flag errors show them as they are.
#[test]
fn duration_errors_read_as_gos() {
    let message = |s: &str| parse_go_duration(s).unwrap_err().to_string();
    assert_eq!(message("x"), r#"invalid duration "x""#);
    assert_eq!(message("10"), r#"missing unit in duration "10""#);
    assert_eq!(message("1d"), r#"unknown unit "d" in duration "1d""#);
}

#[test]
fn a_threshold_that_is_no_number_keeps_why_it_did_not_parse() {
    let error = parse_threshold("abc").unwrap_err();
    assert_eq!(error.to_string(), "not a number");
    let source = std::error::Error::source(&error)
        .and_then(|e| e.downcast_ref::<std::num::ParseFloatError>());
    assert!(source.is_some(), "{error:?}");
}
