//! Where kubelet puts a pod's cgroup (cgroup v2), and its level in the hierarchy.
//!
//! kubelet makes one cgroup per pod under its QoS class's, and one child per container
//! (made later, by the container runtime):
//! - systemd driver: `kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice`
//!   (the uid's `-` written `_`), Guaranteed pods as `kubepods.slice/kubepods-pod<uid>.slice`;
//! - cgroupfs driver: `kubepods/<qos>/pod<uid>`, Guaranteed pods as `kubepods/pod<uid>`.

use std::{
    io,
    path::{Path, PathBuf},
};

/// The directories a pod with `uid` may have under `root` (the node's cgroup root), in
/// the order they are tried.
pub fn candidates(root: &Path, uid: &str) -> Vec<PathBuf> {
    let u = uid.replace('-', "_");
    let systemd = root.join("kubepods.slice");
    let cgroupfs = root.join("kubepods");
    let mut all = Vec::with_capacity(6);
    for qos in ["burstable", "besteffort"] {
        all.push(
            systemd
                .join(format!("kubepods-{qos}.slice"))
                .join(format!("kubepods-{qos}-pod{u}.slice")),
        );
    }
    all.push(systemd.join(format!("kubepods-pod{u}.slice")));
    for qos in ["burstable", "besteffort"] {
        all.push(cgroupfs.join(qos).join(format!("pod{uid}")));
    }
    all.push(cgroupfs.join(format!("pod{uid}")));
    all
}

/// The pod's cgroup directory, if kubelet has made it.
pub fn find(root: &Path, uid: &str) -> Option<PathBuf> {
    candidates(root, uid).into_iter().find(|p| p.is_dir())
}

/// The level of the cgroup v2 directory `dir` (the hierarchy's root is level 0): what
/// `bpf_get_current_ancestor_cgroup_id` takes. Counted up to the top of the cgroup2
/// mount `dir` is in, which must show the hierarchy's root: the host's cgroup2 root, as
/// the DaemonSet mounts it at `/host/sys/fs/cgroup` (a container's own `/sys/fs/cgroup`
/// is its cgroup namespace, whose root is not level 0; the agent never reads that one).
pub fn level(dir: &Path) -> io::Result<u32> {
    crate::cgroup::check_cgroup2_dir(dir)?;
    let mut level = 0;
    let mut d = dir;
    while let Some(parent) = d.parent() {
        if crate::cgroup::check_cgroup2_dir(parent).is_err() {
            break;
        }
        level += 1;
        d = parent;
    }
    Ok(level)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_layouts_for_both_drivers_and_every_qos() {
        let root = Path::new("/sys/fs/cgroup");
        let c = candidates(root, "0f1e-2d");
        let names: Vec<String> = c
            .iter()
            .map(|p| {
                p.strip_prefix(root)
                    .expect("under root")
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(
            names,
            [
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f1e_2d.slice",
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f1e_2d.slice",
                "kubepods.slice/kubepods-pod0f1e_2d.slice",
                "kubepods/burstable/pod0f1e-2d",
                "kubepods/besteffort/pod0f1e-2d",
                "kubepods/pod0f1e-2d",
            ]
        );
    }

    #[test]
    fn levels_count_from_the_cgroup2_mount() {
        let mount = crate::cgroup::cgroup2_mount().expect("a cgroup2 mount");
        assert_eq!(level(&mount).expect("level"), 0);
        assert!(level(Path::new("/")).is_err(), "not a cgroup");
    }
}
