//! Go durations (`time.ParseDuration`): the `autoscaling-options-*` duration annotations and the duration
//! flags.
//!
//! Contract: no panic and no overflow (checked arithmetic, built with overflow checks); Go's own spelling
//! of any `i64` parses back to it; an accepted text `s` gives `-s` → its negation, `+s` → the same, and
//! `s` + `1ns` → one more nanosecond; an error quotes the input.
#![no_main]

use capi_autoscaler_provider::options::parse_go_duration;
use capi_autoscaler_provider_fuzz::go_duration_string;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Any i64 (the first 8 bytes), spelled by Go, parses back to itself.
    let mut word = [0u8; 8];
    let n = data.len().min(8);
    word[..n].copy_from_slice(&data[..n]);
    let d = i64::from_le_bytes(word);
    let spelled = go_duration_string(d);
    assert_eq!(parse_go_duration(&spelled), Ok(d), "{spelled:?}");

    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    match parse_go_duration(s) {
        Ok(v) => {
            assert_eq!(parse_go_duration(&go_duration_string(v)), Ok(v), "{s:?}");
            if !s.starts_with(['-', '+']) {
                assert!(v >= 0, "{s:?} gave {v}");
                assert_eq!(parse_go_duration(&format!("-{s}")), Ok(-v), "-{s:?}");
                assert_eq!(parse_go_duration(&format!("+{s}")), Ok(v), "+{s:?}");
                let more = format!("{s}1ns");
                match v.checked_add(1) {
                    Some(w) => assert_eq!(parse_go_duration(&more), Ok(w), "{more:?}"),
                    None => assert!(parse_go_duration(&more).is_err(), "{more:?}"),
                }
            }
        }
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains(&format!("{s:?}")), "{e:?} does not quote {s:?}");
        }
    }
});
