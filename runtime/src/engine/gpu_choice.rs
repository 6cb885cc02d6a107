//! Which GPU a rank uses: [`rank_gpu`], a pure function of the rank's local rank, the value
//! of `CUDA_VISIBLE_DEVICES` and a probe of how many devices the driver shows, so that tests
//! drive it with fake probes and no GPU.
//!
//! `CUDA_VISIBLE_DEVICES` (NVIDIA's CUDA and MPS documentation; PyTorch's parser of it
//! follows the driver) is a comma-separated list of device indices or UUIDs (`GPU-...`,
//! `MIG-...`; a unique prefix is enough). Only the listed devices are visible, enumerated in
//! list order from 0; unset, every device is. The driver stops at the first entry that is
//! neither an index nor a UUID (so `-1` hides everything), and shows no device at all when an
//! entry is repeated. The process's ordinal `i` is therefore the `i`-th listed device,
//! whichever form the list takes: with `CUDA_VISIBLE_DEVICES=2,3`, local rank 0 opens
//! ordinal 0, which is GPU 2, and ordinal 2 does not exist.
//!
//! Invariants (cited by the tests):
//! - VIS-1: a rank's ordinal is its local rank, the position of its device among the
//!   visible ones, for lists of indices and of UUIDs alike (and for no list), once the probe
//!   shows a device at that position.
//! - VIS-2: a value the driver would cut short or empty (an entry that is neither an index
//!   nor a UUID, a repeated entry, an empty list) is an error naming the value and the entry,
//!   never silently fewer devices.
//! - VIS-3: a local rank with no visible device at its position is an error naming the local
//!   rank and how many devices are visible (and the list, when set): two ranks never share a
//!   GPU by accident.

use thiserror::Error;

/// Why a rank has no GPU of its own.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum GpuChoiceError {
    /// `CUDA_VISIBLE_DEVICES` is not a list the driver takes whole (VIS-2).
    #[error("CUDA_VISIBLE_DEVICES={value:?} is malformed: {why}")]
    Malformed {
        /// The variable's value.
        value: String,
        /// Which entry, and what is wrong with it.
        why: String,
    },
    /// Fewer devices are visible than the local rank needs (VIS-3).
    #[error(
        "local rank {local_rank} (LOCAL_RANK) has no GPU of its own: {visible} visible{}; \
         start at most one rank per visible GPU on each node",
        match listed { Some(v) => format!(" (CUDA_VISIBLE_DEVICES={v:?})"), None => String::new() }
    )]
    TooFewDevices {
        /// The rank's index among the ranks of its node.
        local_rank: usize,
        /// Devices visible to this process.
        visible: usize,
        /// `CUDA_VISIBLE_DEVICES`, when set.
        listed: Option<String>,
    },
    /// The driver could not be asked how many devices it shows.
    #[error("cannot count the CUDA devices: {0}")]
    Probe(String),
}

/// The ordinal of the GPU of the rank with `local_rank` on its node (VIS-1..VIS-3), given
/// `CUDA_VISIBLE_DEVICES` (`None` when unset) and `probe`, which returns how many devices
/// the driver shows this process (it applies the variable itself). The probe is not called
/// when the list alone says there is no device for the rank.
pub fn rank_gpu(
    local_rank: usize,
    visible_devices: Option<&str>,
    probe: impl FnOnce() -> Result<usize, String>,
) -> Result<usize, GpuChoiceError> {
    let too_few = |visible| GpuChoiceError::TooFewDevices {
        local_rank,
        visible,
        listed: visible_devices.map(str::to_owned),
    };
    let listed = visible_devices.map(parse_visible).transpose()?;
    if let Some(n) = listed {
        if local_rank >= n {
            return Err(too_few(n));
        }
    }
    let shown = probe().map_err(GpuChoiceError::Probe)?;
    // A listed index past the last device ends the driver's list early: the driver's count
    // is then below the list's length, and only the devices it shows can be opened.
    let visible = listed.map_or(shown, |n| n.min(shown));
    if local_rank >= visible {
        return Err(too_few(visible));
    }
    Ok(local_rank)
}

/// How many devices a `CUDA_VISIBLE_DEVICES` value lists, each entry a device index or a
/// `GPU-`/`MIG-` UUID (or a prefix of one), surrounding spaces ignored (VIS-2).
fn parse_visible(value: &str) -> Result<usize, GpuChoiceError> {
    let malformed = |why: String| GpuChoiceError::Malformed { value: value.to_owned(), why };
    if value.trim().is_empty() {
        return Err(malformed("it lists no device, so the driver shows none".into()));
    }
    let mut seen: Vec<&str> = Vec::new();
    for (i, entry) in value.split(',').map(str::trim).enumerate() {
        let index = !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit());
        let uuid = ["GPU-", "MIG-"].iter().any(|p| entry.len() > p.len() && entry.starts_with(p));
        if !index && !uuid {
            return Err(malformed(format!(
                "entry {i} ({entry:?}) is neither a device index nor a GPU-/MIG- UUID, and the \
                 driver hides it and every device after it"
            )));
        }
        // `01` and `1` name one device.
        let key = if index { entry.trim_start_matches('0') } else { entry };
        if seen.contains(&key) {
            return Err(malformed(format!(
                "entry {i} ({entry:?}) repeats an earlier one, and the driver then shows no device"
            )));
        }
        seen.push(key);
    }
    Ok(seen.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(n: usize) -> impl FnOnce() -> Result<usize, String> {
        move || Ok(n)
    }

    fn never() -> impl FnOnce() -> Result<usize, String> {
        || panic!("the list alone decides: the probe must not be called")
    }

    #[test]
    fn each_local_rank_opens_its_position_among_the_visible_devices_vis_1() {
        // No list: every device the driver shows, in its order.
        for r in 0..4 {
            assert_eq!(rank_gpu(r, None, probe(4)), Ok(r));
        }
        // Indices: the position in the list, not the index listed (the driver renumbers).
        assert_eq!(rank_gpu(0, Some("2,3"), probe(2)), Ok(0));
        assert_eq!(rank_gpu(1, Some("2,3"), probe(2)), Ok(1));
        assert_eq!(rank_gpu(1, Some(" 3 , 1 "), probe(2)), Ok(1));
        // UUIDs (and prefixes of them, and MIG instances) alike.
        let uuids = "GPU-9e8d35e3-aaaa-bbbb-cccc-0123456789ab,GPU-1f2e,MIG-4c5d6e7f";
        for r in 0..3 {
            assert_eq!(rank_gpu(r, Some(uuids), probe(3)), Ok(r));
        }
    }

    #[test]
    fn malformed_lists_are_errors_naming_the_value_vis_2() {
        for (value, entry) in [
            ("0,gpu1", "\"gpu1\""),
            ("-1", "\"-1\""),
            ("0,,1", "\"\""),
            ("0,1,0", "repeats"),
            ("1,01", "repeats"),
            ("GPU-", "\"GPU-\""),
            // The driver's prefixes are upper case; a multi-byte character is no panic.
            ("gpu-9e8d35e3", "\"gpu-9e8d35e3\""),
            ("GP€1", "\"GP€1\""),
            ("GPU-ab,GPU-ab", "repeats"),
            ("", "no device"),
            ("  ", "no device"),
        ] {
            let e = rank_gpu(0, Some(value), never()).unwrap_err();
            assert!(matches!(e, GpuChoiceError::Malformed { .. }), "{value:?}: {e:?}");
            let text = e.to_string();
            assert!(text.contains(&format!("CUDA_VISIBLE_DEVICES={value:?}")), "{text}");
            assert!(text.contains(entry), "{value:?}: {text}");
        }
    }

    #[test]
    fn a_local_rank_past_the_visible_devices_names_both_vis_3() {
        // The list is too short: decided without the driver.
        let e = rank_gpu(2, Some("0,1"), never()).unwrap_err();
        assert_eq!(
            e,
            GpuChoiceError::TooFewDevices { local_rank: 2, visible: 2, listed: Some("0,1".into()) }
        );
        let text = e.to_string();
        assert!(text.contains("local rank 2") && text.contains("2 visible"), "{text}");
        assert!(text.contains("CUDA_VISIBLE_DEVICES=\"0,1\""), "{text}");
        // No list, one device: the second rank gets none (it never shares GPU 0).
        let e = rank_gpu(1, None, probe(1)).unwrap_err();
        assert_eq!(e, GpuChoiceError::TooFewDevices { local_rank: 1, visible: 1, listed: None });
        assert!(e.to_string().contains("local rank 1") && e.to_string().contains("1 visible"));
        // The list is long enough but names a device the driver does not have (it shows 1).
        let e = rank_gpu(1, Some("0,7"), probe(1)).unwrap_err();
        assert!(matches!(e, GpuChoiceError::TooFewDevices { visible: 1, .. }), "{e:?}");
        assert_eq!(rank_gpu(0, Some("0,7"), probe(1)), Ok(0));
        // No device at all, and a driver that cannot be asked.
        assert!(matches!(rank_gpu(0, None, probe(0)), Err(GpuChoiceError::TooFewDevices { .. })));
        let e = rank_gpu(0, None, || Err("libcuda.so not found".into())).unwrap_err();
        assert_eq!(e, GpuChoiceError::Probe("libcuda.so not found".into()));
    }
}
