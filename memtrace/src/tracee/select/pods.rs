//! `--pod NAMESPACE/NAME` (or `NAME` alone): which pod it means, and
//! whether a process is in it. A process is in a pod when its
//! `/proc/PID/cgroup` names a pod uid and the node's files name that pod
//! ([`crate::tracee::pod`], the names the reports show); the pod is matched
//! by namespace and name, so a pod recreated under the same name (a new
//! uid) is still the one selected.
//!
//! The pods on the node are those the running processes are in, and those
//! the kubelet keeps a log directory for (`/var/log/pods/<namespace>_<pod>_<uid>`,
//! a pod whose containers are restarting); `NAME` alone must name one of
//! them in a single namespace.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::tracee::container;
use crate::tracee::pod::{self, PodNames};

/// A pod `--pod` resolved to, and where its processes' pod names are read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    /// The host roots the node's files are read under ([`pod::host_roots`]).
    pub roots: Vec<PathBuf>,
}

impl PodSpec {
    /// Whether the process with this `/proc/PID/cgroup` text is in the pod.
    pub fn contains(&self, cgroup_text: &str) -> bool {
        pod_of(cgroup_text, &self.roots).is_some_and(|names| {
            names.pod_namespace == self.namespace && names.pod_name == self.name
        })
    }
}

impl std::fmt::Display for PodSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Why `--pod` names no pod (each one line).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PodError {
    #[error("--pod {0}: expected NAMESPACE/NAME or NAME, as Kubernetes names them (lower-case letters, digits, '-' and '.')")]
    Syntax(String),
    #[error("--pod {given}: no such pod on this node ({known} pod(s) found from the running processes' cgroups and the kubelet's /var/log/pods and /var/log/containers)")]
    NotFound { given: String, known: usize },
    #[error("--pod {given}: ambiguous, pods of this name are in namespaces {}; give NAMESPACE/{given}", namespaces.join(", "))]
    Ambiguous {
        given: String,
        namespaces: Vec<String>,
    },
}

/// The pod of the process whose `/proc/PID/cgroup` text this is, named from
/// the node's files under `roots`; `None` outside a pod or when no file
/// names it.
pub fn pod_of(cgroup_text: &str, roots: &[PathBuf]) -> Option<PodNames> {
    let placement = container::container(&container::cgroup_path(cgroup_text)?);
    let uid = placement.pod_uid.as_deref()?;
    pod::names_in(roots, Some(uid), placement.container_id.as_deref())
}

/// Every pod on the node, (namespace, name), with how many processes under
/// `proc_root` run in it now (0 for a pod only the kubelet's log
/// directories under `roots` name).
pub fn pods_on_node(proc_root: &Path, roots: &[PathBuf]) -> BTreeMap<(String, String), usize> {
    let mut found = BTreeMap::new();
    // One lookup of the node's files per cgroup, not per process.
    let mut by_cgroup: HashMap<String, Option<PodNames>> = HashMap::new();
    for pid in super::list_pids(proc_root).unwrap_or_default() {
        let Ok(text) = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup"))
        else {
            continue;
        };
        let Some(path) = container::cgroup_path(&text) else {
            continue;
        };
        let names = by_cgroup
            .entry(path)
            .or_insert_with(|| pod_of(&text, roots));
        if let Some(names) = names {
            *found
                .entry((names.pod_namespace.clone(), names.pod_name.clone()))
                .or_insert(0) += 1;
        }
    }
    for root in roots {
        let Ok(dirs) = std::fs::read_dir(root.join("var/log/pods")) else {
            continue;
        };
        for entry in dirs.filter_map(Result::ok) {
            let file_name = entry.file_name();
            if let Some((namespace, name, _)) = file_name.to_str().and_then(pod::pod_log_dir) {
                found
                    .entry((namespace.to_string(), name.to_string()))
                    .or_insert(0);
            }
        }
    }
    found
}

/// The one pod `given` (`NAMESPACE/NAME` or `NAME`) names among `pods`
/// (pure: `pods` is [`pods_on_node`]'s answer); its processes' names are to
/// be read under `roots`.
pub fn resolve(
    given: &str,
    pods: &BTreeMap<(String, String), usize>,
    roots: Vec<PathBuf>,
) -> Result<PodSpec, PodError> {
    let text = given.trim();
    let syntax = || PodError::Syntax(given.to_string());
    let (namespace, name) = match text.split_once('/') {
        Some((namespace, name)) => {
            if !pod::is_dns(namespace) || !pod::is_dns(name) || name.contains('/') {
                return Err(syntax());
            }
            (Some(namespace), name)
        }
        None if pod::is_dns(text) => (None, text),
        None => return Err(syntax()),
    };
    let not_found = || PodError::NotFound {
        given: text.to_string(),
        known: pods.len(),
    };
    let namespace = match namespace {
        Some(namespace) => {
            if !pods.contains_key(&(namespace.to_string(), name.to_string())) {
                return Err(not_found());
            }
            namespace.to_string()
        }
        None => {
            let namespaces: Vec<String> = pods
                .keys()
                .filter(|(_, pod)| pod == name)
                .map(|(namespace, _)| namespace.clone())
                .collect();
            match namespaces.as_slice() {
                [] => return Err(not_found()),
                [one] => one.clone(),
                _ => {
                    return Err(PodError::Ambiguous {
                        given: text.to_string(),
                        namespaces,
                    })
                }
            }
        }
    };
    Ok(PodSpec {
        namespace,
        name: name.to_string(),
        roots,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracee::select::{resolve_pod, Finder, Selector};
    use std::collections::BTreeSet;

    const UID_SHOP: &str = "0a1b2c3d-4e5f-6789-abcd-ef0123456789";
    const UID_DEFAULT: &str = "1a1b2c3d-4e5f-6789-abcd-ef0123456789";
    const UID_API: &str = "2a1b2c3d-4e5f-6789-abcd-ef0123456789";
    const UID_DB: &str = "3a1b2c3d-4e5f-6789-abcd-ef0123456789";

    fn id(digit: char) -> String {
        digit.to_string().repeat(64)
    }

    /// A node under a temporary directory: `proc/PID/cgroup` for its
    /// processes, and under `host/` the kubelet's and runtimes' files.
    struct Node(PathBuf);

    impl Node {
        fn new(tag: &str) -> Node {
            let dir = std::env::temp_dir()
                .join(format!("memtrace-pod-select-{}-{tag}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(dir.join("proc")).expect("proc");
            std::fs::create_dir_all(dir.join("host")).expect("host");
            Node(dir)
        }

        fn proc_root(&self) -> PathBuf {
            self.0.join("proc")
        }

        fn roots(&self) -> Vec<PathBuf> {
            vec![self.0.join("host")]
        }

        /// A process with this cgroup line.
        fn process(&self, pid: u32, cgroup: &str) {
            let dir = self.proc_root().join(pid.to_string());
            std::fs::create_dir_all(&dir).expect("pid dir");
            std::fs::write(dir.join("cgroup"), format!("{cgroup}\n")).expect("cgroup");
        }

        /// A process in container `id` of pod `uid` (systemd driver, containerd).
        fn in_pod(&self, pid: u32, uid: &str, id: &str) {
            self.process(
                pid,
                &format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{id}.scope",
                    uid.replace('-', "_")
                ),
            );
        }

        /// The kubelet's pod log directory, and with a container id its log link.
        fn kubelet(&self, namespace: &str, pod: &str, uid: &str, container: Option<(&str, &str)>) {
            let host = self.0.join("host");
            let dir = host.join(format!("var/log/pods/{namespace}_{pod}_{uid}"));
            std::fs::create_dir_all(&dir).expect("pod dir");
            if let Some((name, id)) = container {
                std::fs::create_dir_all(dir.join(name)).expect("container dir");
                let log = dir.join(name).join("0.log");
                std::fs::write(&log, "").expect("log");
                let links = host.join("var/log/containers");
                std::fs::create_dir_all(&links).expect("links");
                std::os::unix::fs::symlink(
                    &log,
                    links.join(format!("{pod}_{namespace}_{name}-{id}.log")),
                )
                .expect("link");
            }
        }

        /// A CRI-O bundle naming the pod (no kubelet link).
        fn crio_bundle(&self, namespace: &str, pod: &str, uid: &str, id: &str) {
            let dir = self
                .0
                .join("host/run/containers/storage/overlay-containers")
                .join(id)
                .join("userdata");
            std::fs::create_dir_all(&dir).expect("bundle");
            let config = serde_json::json!({"annotations": {
                "io.kubernetes.pod.name": pod,
                "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": uid,
                "io.kubernetes.container.name": "server",
            }});
            std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
        }

        fn finder(&self, selector: Selector) -> Finder {
            let mut finder = Finder::new(selector);
            finder.proc_root = self.proc_root();
            finder
        }
    }

    impl Drop for Node {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Two pods named web-0 (namespaces shop and default), shop/api-1 named
    /// only by its log directory, shop/db-0 with no process, a host service
    /// and a Docker container.
    fn node(tag: &str) -> Node {
        let node = Node::new(tag);
        node.kubelet("shop", "web-0", UID_SHOP, Some(("app", &id('a'))));
        node.in_pod(4100, UID_SHOP, &id('a'));
        node.in_pod(4101, UID_SHOP, &id('a'));
        node.crio_bundle("default", "web-0", UID_DEFAULT, &id('b'));
        node.in_pod(4200, UID_DEFAULT, &id('b'));
        node.kubelet("shop", "api-1", UID_API, None);
        node.in_pod(4300, UID_API, &id('c'));
        node.kubelet("shop", "db-0", UID_DB, None);
        node.process(4400, "0::/system.slice/nginx.service");
        node.process(4500, &format!("0::/system.slice/docker-{}.scope", id('d')));
        node
    }

    fn selector(node: &Node, given: &str) -> Selector {
        resolve_pod(given, &node.proc_root(), node.roots()).expect(given)
    }

    fn selected(node: &Node, given: &str) -> Vec<u32> {
        node.finder(selector(node, given))
            .find_with(&BTreeSet::new(), |_| true)
    }

    #[test]
    fn the_pods_on_a_node_are_those_its_processes_and_the_kubelet_name() {
        let node = node("list");
        let pods = pods_on_node(&node.proc_root(), &node.roots());
        let key = |namespace: &str, name: &str| (namespace.to_string(), name.to_string());
        assert_eq!(
            pods,
            BTreeMap::from([
                (key("default", "web-0"), 1),
                (key("shop", "api-1"), 1),
                (key("shop", "db-0"), 0),
                (key("shop", "web-0"), 2),
            ])
        );
    }

    #[test]
    fn a_pod_selects_its_processes_only() {
        let node = node("select");
        assert_eq!(selected(&node, "shop/web-0"), [4100, 4101]);
        assert_eq!(selected(&node, "default/web-0"), [4200]);
        // NAME alone, unique across namespaces; named by its log directory.
        assert_eq!(selected(&node, "api-1"), [4300]);
        assert_eq!(selected(&node, " shop/api-1 "), [4300]);
        // A pod with no process now is selected, and waited for.
        assert_eq!(selected(&node, "db-0"), Vec::<u32>::new());
        let Selector::Pod(spec) = selector(&node, "shop/web-0") else {
            panic!("a pod selector");
        };
        assert_eq!(spec.to_string(), "shop/web-0");
        assert_eq!(Selector::Pod(spec.clone()).what(), "in pod shop/web-0");
        assert_eq!(
            Selector::Pod(spec).none_running(),
            "--pod shop/web-0: no running process is in this pod on this node"
        );
    }

    #[test]
    fn processes_that_start_in_the_pod_later_are_found() {
        let node = node("later");
        let mut finder = node.finder(selector(&node, "shop/web-0"));
        let first = finder.find_with(&BTreeSet::new(), |_| true);
        assert_eq!(first, [4100, 4101]);
        let known: BTreeSet<u32> = first.into_iter().collect();
        assert_eq!(finder.find_with(&known, |_| true), Vec::<u32>::new());
        // A new process in the pod's container, one in a new container of
        // the pod (named by the pod's log directory), one in the other web-0.
        node.in_pod(4102, UID_SHOP, &id('a'));
        node.in_pod(4103, UID_SHOP, &id('e'));
        node.in_pod(4201, UID_DEFAULT, &id('b'));
        assert_eq!(finder.find_with(&known, |_| true), [4102, 4103]);
        // A host process moved into the pod's cgroup joins it.
        node.in_pod(4400, UID_SHOP, &id('a'));
        let known: BTreeSet<u32> = [4100, 4101, 4102, 4103].into();
        assert_eq!(finder.find_with(&known, |_| true), [4400]);
        // What cannot be traced is not selected.
        node.in_pod(4104, UID_SHOP, &id('a'));
        assert_eq!(finder.find_with(&known, |pid| pid != 4104), [4400]);
    }

    #[test]
    fn a_name_in_several_namespaces_is_ambiguous() {
        let node = node("ambiguous");
        let err = resolve_pod("web-0", &node.proc_root(), node.roots()).expect_err("ambiguous");
        assert_eq!(err.code, crate::error::EXIT_USAGE);
        assert_eq!(
            err.message,
            "--pod web-0: ambiguous, pods of this name are in namespaces default, shop; give NAMESPACE/web-0"
        );
    }

    #[test]
    fn a_pod_not_on_the_node_is_one_usage_line() {
        let node = node("missing");
        for given in ["web-1", "kube-system/web-0", "shop/default"] {
            let err = resolve_pod(given, &node.proc_root(), node.roots()).expect_err(given);
            assert_eq!(err.code, crate::error::EXIT_USAGE, "{given}");
            assert!(
                err.message.starts_with(&format!(
                    "--pod {given}: no such pod on this node (4 pod(s)"
                )),
                "{}",
                err.message
            );
            assert!(!err.message.contains('\n'));
        }
        for bad in ["", "/", "shop/", "/web-0", "a/b/c", "Shop/web-0", "web_0"] {
            let err = resolve_pod(bad, &node.proc_root(), node.roots()).expect_err(bad);
            assert_eq!(err.code, crate::error::EXIT_USAGE, "{bad}");
            assert!(
                err.message.contains("expected NAMESPACE/NAME or NAME"),
                "{}",
                err.message
            );
        }
        // An empty node has no pods.
        let empty = Node::new("empty");
        let err = resolve_pod("web-0", &empty.proc_root(), empty.roots()).expect_err("none");
        assert!(err.message.contains("(0 pod(s)"), "{}", err.message);
    }
}
