//! Kubernetes names for a container memtrace found by its cgroup (a pod
//! uid, a container id): the pod's name and namespace and the container's
//! name, read from what the kubelet and the container runtimes leave on the
//! node, with no API access. Sources, the most precise first:
//!
//! 1. the kubelet's log links, `/var/log/containers/<pod>_<namespace>_<container>-<id>.log`
//!    (every runtime; the link points into the pod's log directory, which
//!    names the pod uid, checked against the cgroup's);
//! 2. the runtime's OCI bundle of the container, whose annotations name the
//!    pod: containerd's `/run/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/config.json`
//!    (`io.kubernetes.cri.sandbox-name`, `-namespace`, `-uid`,
//!    `io.kubernetes.cri.container-name`) and CRI-O's
//!    `/run/containers/storage/overlay-containers/<id>/userdata/config.json`
//!    (`io.kubernetes.pod.name`, `.namespace`, `.uid`, `io.kubernetes.container.name`);
//! 3. the kubelet's pod log directories, `/var/log/pods/<namespace>_<pod>_<uid>`,
//!    by pod uid (no container name).
//!
//! A plain container (Docker, Podman; no pod) gets its name from the
//! runtime's state ([`container_name_in`]).
//!
//! Pod names are DNS subdomains and namespaces and container names DNS
//! labels: none holds a `_`, so the names split without ambiguity.
//!
//! The files are looked for under the host's root: `MEMTRACE_HOST_ROOT`
//! where set (the host's `/` mounted into memtrace's container, as
//! node agents mount it at `/host`), then, where memtrace runs in a mount
//! namespace of its own (a DaemonSet's container with `hostPID`),
//! `/proc/1/root` (readable with `CAP_SYS_PTRACE`), then `/`.

use std::path::{Path, PathBuf};

/// The names a pod's files gave.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodNames {
    pub pod_name: String,
    pub pod_namespace: String,
    /// The container's name in the pod spec, where the source names it.
    pub container_name: Option<String>,
}

/// Where the host's files are seen from this process: `MEMTRACE_HOST_ROOT`
/// where set, `/proc/1/root` when memtrace's mount namespace is not pid 1's,
/// then `/`.
pub fn host_roots() -> Vec<PathBuf> {
    let own = std::fs::read_link("/proc/self/ns/mnt").ok();
    let init = std::fs::read_link("/proc/1/ns/mnt").ok();
    let mut roots: Vec<PathBuf> = std::env::var_os("MEMTRACE_HOST_ROOT")
        .filter(|root| !root.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .collect();
    if init.is_some() && own != init {
        roots.push(PathBuf::from("/proc/1/root"));
    }
    roots.push(PathBuf::from("/"));
    roots
}

/// The names of the container `container_id` of pod `pod_uid`, looked up
/// under each of `roots` in turn; `None` when no source names it.
pub fn names_in(
    roots: &[PathBuf],
    pod_uid: Option<&str>,
    container_id: Option<&str>,
) -> Option<PodNames> {
    roots
        .iter()
        .find_map(|root| names_under(root, pod_uid, container_id))
}

fn names_under(root: &Path, pod_uid: Option<&str>, container_id: Option<&str>) -> Option<PodNames> {
    if let Some(id) = container_id {
        if let Some(names) = from_log_links(root, pod_uid, id) {
            return Some(names);
        }
        for bundle in [
            "run/containerd/io.containerd.runtime.v2.task/k8s.io",
            "run/containers/storage/overlay-containers",
        ] {
            let dir = root.join(bundle).join(id);
            let config = ["config.json", "userdata/config.json"]
                .iter()
                .find_map(|name| std::fs::read_to_string(dir.join(name)).ok());
            if let Some(names) = config.and_then(|text| from_oci_config(&text, pod_uid)) {
                return Some(names);
            }
        }
    }
    let uid = pod_uid?;
    let pods = std::fs::read_dir(root.join("var/log/pods")).ok()?;
    pods.filter_map(Result::ok).find_map(|entry| {
        let name = entry.file_name();
        let (namespace, pod, found) = pod_log_dir(name.to_str()?)?;
        (found == uid).then(|| PodNames {
            pod_name: pod.to_string(),
            pod_namespace: namespace.to_string(),
            container_name: None,
        })
    })
}

/// The kubelet's log link of container `id`, if any, read into names; a
/// link into another pod's directory than `pod_uid`'s (a stale link of a
/// reused id) is not taken.
fn from_log_links(root: &Path, pod_uid: Option<&str>, id: &str) -> Option<PodNames> {
    let dir = root.join("var/log/containers");
    let suffix = format!("-{id}.log");
    let entry = std::fs::read_dir(&dir)
        .ok()?
        .filter_map(Result::ok)
        .find(|entry| {
            entry
                .file_name()
                .to_str()
                .is_some_and(|name| name.ends_with(&suffix))
        })?;
    let name = entry.file_name();
    let (pod, namespace, container, _) = container_log_link(name.to_str()?)?;
    if let (Some(uid), Ok(target)) = (pod_uid, std::fs::read_link(entry.path())) {
        let linked_uid = target
            .iter()
            .filter_map(|part| pod_log_dir(part.to_str()?))
            .map(|(_, _, uid)| uid.to_string())
            .next();
        if linked_uid.is_some_and(|linked| linked != uid) {
            return None;
        }
    }
    Some(PodNames {
        pod_name: pod.to_string(),
        pod_namespace: namespace.to_string(),
        container_name: Some(container.to_string()),
    })
}

/// Splits a pod log directory's name, `<namespace>_<pod>_<uid>`, into
/// (namespace, pod, uid).
pub fn pod_log_dir(name: &str) -> Option<(&str, &str, &str)> {
    let mut parts = name.split('_');
    let (namespace, pod, uid) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !is_uid(uid) || !is_dns(namespace) || !is_dns(pod) {
        return None;
    }
    Some((namespace, pod, uid))
}

/// Splits a container log link's name, `<pod>_<namespace>_<container>-<id>.log`,
/// into (pod, namespace, container, id).
pub fn container_log_link(name: &str) -> Option<(&str, &str, &str, &str)> {
    let stem = name.strip_suffix(".log")?;
    let (rest, id) = stem.rsplit_once('-')?;
    if id.len() != 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut parts = rest.split('_');
    let (pod, namespace, container) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !is_dns(pod) || !is_dns(namespace) || !is_dns(container) {
        return None;
    }
    Some((pod, namespace, container, id))
}

/// The pod named by an OCI runtime spec's annotations (containerd's CRI
/// plugin or CRI-O); a spec naming another pod uid than `pod_uid` is not
/// taken. A sandbox (pause) container has no container name.
pub fn from_oci_config(text: &str, pod_uid: Option<&str>) -> Option<PodNames> {
    let spec: serde_json::Value = serde_json::from_str(text).ok()?;
    let annotations = spec.get("annotations")?.as_object()?;
    let get = |keys: &[&str]| {
        keys.iter()
            .find_map(|key| annotations.get(*key)?.as_str())
            .filter(|value| !value.is_empty())
            .map(str::to_string)
    };
    let name = get(&["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"])?;
    let namespace = get(&[
        "io.kubernetes.cri.sandbox-namespace",
        "io.kubernetes.pod.namespace",
    ])?;
    let uid = get(&["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"]);
    if let (Some(wanted), Some(uid)) = (pod_uid, uid.as_deref()) {
        if wanted != uid {
            return None;
        }
    }
    Some(PodNames {
        pod_name: name,
        pod_namespace: namespace,
        container_name: get(&[
            "io.kubernetes.cri.container-name",
            "io.kubernetes.container.name",
        ]),
    })
}

/// The name a plain (not Kubernetes) container was given, from its
/// runtime's state under `roots`: Docker's
/// `/var/lib/docker/containers/<id>/config.v2.json` (`Name`, `/web`) or
/// Podman's `/var/lib/containers/storage/overlay-containers/containers.json`
/// (`names`).
pub fn container_name_in(roots: &[PathBuf], runtime: &str, id: &str) -> Option<String> {
    roots.iter().find_map(|root| match runtime {
        "docker" => std::fs::read_to_string(
            root.join("var/lib/docker/containers")
                .join(id)
                .join("config.v2.json"),
        )
        .ok()
        .and_then(|text| docker_name(&text, id)),
        "podman" => std::fs::read_to_string(
            root.join("var/lib/containers/storage/overlay-containers/containers.json"),
        )
        .ok()
        .and_then(|text| podman_name(&text, id)),
        _ => None,
    })
}

/// The `Name` of Docker's `config.v2.json` of container `id`, without its
/// leading `/`.
pub fn docker_name(text: &str, id: &str) -> Option<String> {
    let config: serde_json::Value = serde_json::from_str(text).ok()?;
    if config.get("ID")?.as_str()? != id {
        return None;
    }
    let name = config.get("Name")?.as_str()?.trim_start_matches('/');
    (!name.is_empty()).then(|| name.to_string())
}

/// The first of the `names` Podman's `containers.json` lists for `id`.
pub fn podman_name(text: &str, id: &str) -> Option<String> {
    let list: serde_json::Value = serde_json::from_str(text).ok()?;
    list.as_array()?
        .iter()
        .find(|container| container.get("id").and_then(|v| v.as_str()) == Some(id))?
        .get("names")?
        .as_array()?
        .first()?
        .as_str()
        .map(str::to_string)
}

/// A pod uid: a UUID, or a static pod's 32-digit hash.
fn is_uid(text: &str) -> bool {
    (text.len() == 36 || text.len() == 32)
        && text.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

/// A DNS subdomain as Kubernetes names use it: lower-case letters, digits,
/// `-` and `.`, 1 to 253 characters.
pub fn is_dns(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 253
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f1c8f4c9a2b7d5e6f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6";
    const UID: &str = "0a1b2c3d-4e5f-6789-abcd-ef0123456789";

    fn names(pod: &str, namespace: &str, container: Option<&str>) -> Option<PodNames> {
        Some(PodNames {
            pod_name: pod.into(),
            pod_namespace: namespace.into(),
            container_name: container.map(str::to_string),
        })
    }

    #[test]
    fn kubelet_directory_and_link_names_split() {
        assert_eq!(
            pod_log_dir(
                "kube-system_coredns-5d78c9869d-x7k2p_0a1b2c3d-4e5f-6789-abcd-ef0123456789"
            ),
            Some(("kube-system", "coredns-5d78c9869d-x7k2p", UID))
        );
        // A static pod's uid is its manifest's hash.
        assert_eq!(
            pod_log_dir("kube-system_etcd-node-1_5c1b1e3ba4d4e7f0a6e8b7c6d5e4f3a2"),
            Some((
                "kube-system",
                "etcd-node-1",
                "5c1b1e3ba4d4e7f0a6e8b7c6d5e4f3a2"
            ))
        );
        assert_eq!(
            container_log_link(&format!("web-0_shop_app-{ID}.log")),
            Some(("web-0", "shop", "app", ID))
        );
        assert_eq!(
            container_log_link(&format!(
                "api-7c9f8d6b5-qwzx4_default_sidecar-proxy-{ID}.log"
            )),
            Some(("api-7c9f8d6b5-qwzx4", "default", "sidecar-proxy", ID))
        );
        for bad in [
            "",
            "default_web-0",
            "default_web-0_not-a-uid",
            "a_b_c_0a1b2c3d-4e5f-6789-abcd-ef0123456789",
            "Default_web-0_0a1b2c3d-4e5f-6789-abcd-ef0123456789",
        ] {
            assert_eq!(pod_log_dir(bad), None, "{bad}");
        }
        for bad in [
            format!("web-0_shop_app-{ID}.txt"),
            "web-0_shop_app-abc.log".to_string(),
            format!("web-0_app-{ID}.log"),
            format!("web_0_shop_app-{ID}.log"),
        ] {
            assert_eq!(container_log_link(&bad), None, "{bad}");
        }
    }

    #[test]
    fn containerd_and_crio_bundles_name_the_pod() {
        let containerd = include_str!("testdata/containerd-config.json");
        assert_eq!(
            from_oci_config(containerd, Some(UID)),
            names("web-0", "shop", Some("app"))
        );
        assert_eq!(from_oci_config(containerd, Some("another-uid")), None);
        let crio = include_str!("testdata/crio-config.json");
        assert_eq!(
            from_oci_config(crio, None),
            names("api-7c9f8d6b5-qwzx4", "default", Some("server"))
        );
        // A plain (not Kubernetes) container's spec names no pod.
        assert_eq!(from_oci_config(r#"{"ociVersion":"1.0.2"}"#, None), None);
        assert_eq!(from_oci_config("not json", None), None);
    }

    /// A node's files under a temporary root.
    struct Node(PathBuf);

    impl Node {
        fn new(tag: &str) -> Node {
            let dir =
                std::env::temp_dir().join(format!("memtrace-pod-{}-{tag}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("temp root");
            Node(dir)
        }

        fn pod_dir(&self, namespace: &str, pod: &str, uid: &str, container: &str) -> PathBuf {
            let dir = self
                .0
                .join(format!("var/log/pods/{namespace}_{pod}_{uid}/{container}"));
            std::fs::create_dir_all(&dir).expect("pod dir");
            std::fs::write(dir.join("0.log"), "").expect("log");
            dir.join("0.log")
        }

        fn link(&self, name: &str, target: &Path) {
            let dir = self.0.join("var/log/containers");
            std::fs::create_dir_all(&dir).expect("containers dir");
            std::os::unix::fs::symlink(target, dir.join(name)).expect("link");
        }
    }

    impl Drop for Node {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_node_s_files_name_the_pod_most_precise_first() {
        let node = Node::new("files");
        let roots = [node.0.clone()];
        assert_eq!(names_in(&roots, Some(UID), Some(ID)), None);
        // The pod's log directory names the pod, not the container.
        let log = node.pod_dir("shop", "web-0", UID, "app");
        assert_eq!(
            names_in(&roots, Some(UID), Some(ID)),
            names("web-0", "shop", None)
        );
        // The containerd bundle names the container too.
        let bundle = node
            .0
            .join("run/containerd/io.containerd.runtime.v2.task/k8s.io")
            .join(ID);
        std::fs::create_dir_all(&bundle).expect("bundle");
        std::fs::write(
            bundle.join("config.json"),
            include_str!("testdata/containerd-config.json"),
        )
        .expect("config");
        assert_eq!(
            names_in(&roots, Some(UID), Some(ID)),
            names("web-0", "shop", Some("app"))
        );
        // The kubelet's link comes first (here it says another container).
        node.link(&format!("web-0_shop_init-db-{ID}.log"), &log);
        assert_eq!(
            names_in(&roots, Some(UID), Some(ID)),
            names("web-0", "shop", Some("init-db"))
        );
        // Another pod's uid: no name from its files.
        let other = "ffffffff-4e5f-6789-abcd-ef0123456789";
        assert_eq!(names_in(&roots, Some(other), None), None);
        assert_eq!(names_in(&roots, None, None), None);
        // The first root that names it wins.
        let empty = Node::new("empty");
        assert_eq!(
            names_in(&[empty.0.clone(), node.0.clone()], Some(UID), None),
            names("web-0", "shop", None)
        );
    }

    #[test]
    fn a_stale_link_into_another_pod_is_not_taken() {
        let node = Node::new("stale");
        let other = "ffffffff-4e5f-6789-abcd-ef0123456789";
        let old = node.pod_dir("shop", "web-0", other, "app");
        node.link(&format!("web-0_shop_app-{ID}.log"), &old);
        node.pod_dir("shop", "web-1", UID, "app");
        assert_eq!(
            names_in(std::slice::from_ref(&node.0), Some(UID), Some(ID)),
            names("web-1", "shop", None)
        );
    }

    #[test]
    fn plain_docker_and_podman_containers_are_named() {
        let docker = include_str!("testdata/docker-config.v2.json");
        assert_eq!(docker_name(docker, ID), Some("web".to_string()));
        assert_eq!(docker_name(docker, &"0".repeat(64)), None);
        let podman = include_str!("testdata/podman-containers.json");
        assert_eq!(podman_name(podman, ID), Some("db".to_string()));
        assert_eq!(podman_name(podman, &"0".repeat(64)), None);
        assert_eq!(podman_name("[]", ID), None);
        let node = Node::new("docker");
        let dir = node.0.join("var/lib/docker/containers").join(ID);
        std::fs::create_dir_all(&dir).expect("docker dir");
        std::fs::write(dir.join("config.v2.json"), docker).expect("config");
        let roots = [node.0.clone()];
        assert_eq!(
            container_name_in(&roots, "docker", ID),
            Some("web".to_string())
        );
        assert_eq!(container_name_in(&roots, "podman", ID), None);
        assert_eq!(container_name_in(&roots, "crio", ID), None);
    }

    #[test]
    fn the_host_root_is_always_looked_at() {
        assert_eq!(host_roots().last(), Some(&PathBuf::from("/")));
    }
}
