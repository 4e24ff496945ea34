//! Which GPUs the CUDA driver shows a rank. The driver's start (`cuInit`) costs about 0.2 s
//! per visible GPU: 0.85-1.0 s with four H200s visible against 0.18 s with one. A rank that
//! drives fewer GPUs than the node has is shown only its own, through `CUDA_VISIBLE_DEVICES`,
//! before the driver starts; the GPUs are counted without starting it.

use std::sync::OnceLock;

/// The node's GPUs as `CUDA_VISIBLE_DEVICES` names them, counted without starting the
/// driver: the entries of `CUDA_VISIBLE_DEVICES` when it is set, else the driver's list of
/// GPUs (`/proc/driver/nvidia/gpus`, one folder per GPU). `None` when that is not known for
/// sure (an entry the driver would not take, no such list): the driver then counts.
pub(super) fn node_gpus(
    cuda_visible: Option<&str>,
    proc_gpus: Option<usize>,
) -> Option<Vec<String>> {
    let Some(list) = cuda_visible else {
        return proc_gpus
            .filter(|&n| n > 0)
            .map(|n| (0..n).map(|i| i.to_string()).collect());
    };
    let entries: Vec<String> = list.split(',').map(|e| e.trim().to_string()).collect();
    let valid = |e: &String| match e.parse::<usize>() {
        Ok(i) => proc_gpus.is_some_and(|n| i < n),
        Err(_) => e.starts_with("GPU-") || e.starts_with("MIG-"),
    };
    entries.iter().all(valid).then_some(entries)
}

/// Whether the node has a GPU for sure ([`node_gpus`] finds one), known without starting
/// the driver.
pub fn node_has_gpus() -> bool {
    let listed = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    node_gpus(listed.as_deref(), proc_gpus()).is_some_and(|g| !g.is_empty())
}

/// The number of folders in the NVIDIA driver's list of GPUs, if it has one.
pub(super) fn proc_gpus() -> Option<usize> {
    std::fs::read_dir("/proc/driver/nvidia/gpus")
        .ok()
        .map(|entries| entries.count())
}

/// The node's GPU indices of this process's ordinals once [`narrow`] has run, for the log.
static NODE_INDEX: OnceLock<Vec<usize>> = OnceLock::new();

/// Shows the driver only `devices` (indices into `gpus`) and returns their ordinals as it
/// will number them (0, 1, ...). Runs before the driver starts, once per process.
pub(super) fn narrow(gpus: &[String], devices: &[usize]) -> Vec<usize> {
    let list: Vec<&str> = devices.iter().map(|&d| gpus[d].as_str()).collect();
    tracing::debug!(
        "CUDA_VISIBLE_DEVICES={} (the rank's GPUs of {})",
        list.join(","),
        gpus.len()
    );
    // The variable is read by the driver when it starts, which no thread has done yet.
    std::env::set_var("CUDA_VISIBLE_DEVICES", list.join(","));
    let _ = NODE_INDEX.set(devices.to_vec());
    (0..devices.len()).collect()
}

/// The node's index of the GPU this process calls `ordinal`.
pub(super) fn node_index(ordinal: usize) -> usize {
    NODE_INDEX
        .get()
        .and_then(|m| m.get(ordinal).copied())
        .unwrap_or(ordinal)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Option<Vec<String>> {
        Some(v.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn gpus_come_from_the_variable_or_the_driver_list() {
        assert_eq!(node_gpus(None, Some(4)), names(&["0", "1", "2", "3"]));
        assert_eq!(node_gpus(None, Some(0)), None);
        assert_eq!(node_gpus(None, None), None);
        assert_eq!(node_gpus(Some("2,3"), Some(4)), names(&["2", "3"]));
        assert_eq!(node_gpus(Some(" 1 , 0"), Some(2)), names(&["1", "0"]));
        let uuids = "GPU-8d7a1c2e-0000-1111-2222-333344445555,MIG-1f2e";
        assert_eq!(node_gpus(Some(uuids), None).map(|v| v.len()), Some(2));
    }

    #[test]
    fn a_variable_the_driver_might_read_otherwise_is_left_to_it() {
        // An index past the node's GPUs, an empty entry (no GPU), a negative index (none),
        // an index without the driver's list to check it against.
        assert_eq!(node_gpus(Some("0,4"), Some(4)), None);
        assert_eq!(node_gpus(Some(""), Some(4)), None);
        assert_eq!(node_gpus(Some("-1"), Some(4)), None);
        assert_eq!(node_gpus(Some("0"), None), None);
    }
}
