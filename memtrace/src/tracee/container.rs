//! Where a traced process lives: its pid inside its own pid namespace
//! (`NSpid` in `/proc/PID/status`) and its container, named from its cgroup
//! (`/proc/PID/cgroup`, v1 or v2) the way the runtimes name them: Docker
//! (`docker-<id>.scope`, `/docker/<id>`), containerd (`cri-containerd-<id>`),
//! CRI-O (`crio-<id>`), Podman (`libpod-<id>`), Kubernetes' cgroupfs layout
//! (`/kubepods/<qos>/pod<uid>/<id>`); a Kubernetes pod's name and
//! namespace and the container's name come from the node's files
//! ([`super::pod`]).

use serde::{Deserialize, Serialize};

/// A process's namespace pid and container, as shown in every report
/// (the keys are flattened into the process's entry).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct Placement {
    /// Its pid inside its pid namespace, where that differs from the host pid.
    #[serde(default)]
    pub ns_pid: Option<u32>,
    /// Its cgroup path (the v2 one, else the first v1 hierarchy's).
    #[serde(default)]
    pub cgroup: Option<String>,
    /// The container id named by the cgroup path.
    #[serde(default)]
    pub container_id: Option<String>,
    /// The runtime the cgroup path names (`docker`, `containerd`, `crio`,
    /// `podman`, `kubernetes`).
    #[serde(default)]
    pub container_runtime: Option<String>,
    /// The Kubernetes pod's uid, when the cgroup path names it.
    #[serde(default)]
    pub pod_uid: Option<String>,
    /// The pod's name, when the node's files name the pod ([`super::pod`]).
    #[serde(default)]
    pub pod_name: Option<String>,
    /// The pod's namespace, with its name.
    #[serde(default)]
    pub pod_namespace: Option<String>,
    /// The container's name: in its pod, or as a plain container was named
    /// (`docker run --name`), where the node's files name it.
    #[serde(default)]
    pub container_name: Option<String>,
}

impl Placement {
    /// Reads process `pid`'s placement; what cannot be read stays empty.
    pub fn of(pid: u32) -> Placement {
        let ns_pid = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|text| ns_pid(&text))
            .filter(|&inner| inner != pid);
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|text| cgroup_path(&text));
        let mut placement = cgroup.as_deref().map(container).unwrap_or_default();
        placement.ns_pid = ns_pid;
        placement.cgroup = cgroup;
        if placement.pod_uid.is_some() {
            placement.name_pod(&super::pod::host_roots());
        } else if let (Some(runtime), Some(id)) =
            (&placement.container_runtime, &placement.container_id)
        {
            placement.container_name =
                super::pod::container_name_in(&super::pod::host_roots(), runtime, id);
        }
        placement
    }

    /// Fills in the pod's and the container's names from the node's files
    /// under `roots` (see [`super::pod`]); left empty where none names them.
    pub fn name_pod(&mut self, roots: &[std::path::PathBuf]) {
        let found =
            super::pod::names_in(roots, self.pod_uid.as_deref(), self.container_id.as_deref());
        if let Some(names) = found {
            self.pod_name = Some(names.pod_name);
            self.pod_namespace = Some(names.pod_namespace);
            self.container_name = names.container_name;
        }
    }

    /// `pid 1234 (ns pid 7, container docker 0123456789ab)` style suffix
    /// for a text line; empty for a process on the host.
    pub fn describe(&self) -> String {
        self.summary()
            .map(|summary| format!(" ({summary})"))
            .unwrap_or_default()
    }

    /// `ns pid 7, container containerd 0123456789ab "app", pod shop/web-0`:
    /// what differs from a process on the host, `None` for one.
    pub fn summary(&self) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(ns_pid) = self.ns_pid {
            parts.push(format!("ns pid {ns_pid}"));
        }
        if let Some(id) = &self.container_id {
            let short = id.get(..12).unwrap_or(id);
            let mut text = match &self.container_runtime {
                Some(runtime) => format!("container {runtime} {short}"),
                None => format!("container {short}"),
            };
            if let Some(name) = &self.container_name {
                text.push_str(&format!(" \"{name}\""));
            }
            parts.push(text);
        }
        match (&self.pod_namespace, &self.pod_name, &self.pod_uid) {
            (Some(namespace), Some(name), _) => parts.push(format!("pod {namespace}/{name}")),
            (_, _, Some(uid)) => parts.push(format!("pod {uid}")),
            _ => {}
        }
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

/// The innermost pid of the `NSpid:` line of `/proc/PID/status`.
pub fn ns_pid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The cgroup path of `/proc/PID/cgroup`: the v2 entry (`0::/...`), else
/// the first v1 hierarchy naming a container, else the first one.
pub fn cgroup_path(text: &str) -> Option<String> {
    let entries: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let id = fields.next()?;
            let _controllers = fields.next()?;
            Some((id, fields.next()?))
        })
        .collect();
    let v2 = entries
        .iter()
        .find(|(id, path)| *id == "0" && !path.is_empty())
        .map(|(_, path)| *path);
    let v1 = || {
        entries
            .iter()
            .find(|(_, path)| container(path).container_id.is_some())
            .or_else(|| entries.first())
            .map(|(_, path)| *path)
    };
    // On hybrid systems the v2 entry may be `/` while v1 names the container.
    match v2 {
        Some(path) if path != "/" || v1().is_none_or(|p| container(p).container_id.is_none()) => {
            Some(path.to_string())
        }
        _ => v1().map(str::to_string),
    }
}

fn is_id(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The container a cgroup path names (only its id, runtime and pod).
pub fn container(path: &str) -> Placement {
    let mut placement = Placement::default();
    let components: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let in_kubepods = components.iter().any(|c| c.starts_with("kubepods"));
    for (index, component) in components.iter().enumerate() {
        let unit = component
            .strip_suffix(".scope")
            .or_else(|| component.strip_suffix(".slice"))
            .unwrap_or(component);
        // systemd driver: kubepods-burstable-pod<uid>.slice (uid with '_').
        // cgroupfs driver: pod<uid>.
        let pod = unit
            .strip_prefix("pod")
            .or_else(|| unit.rsplit_once("-pod").map(|(_, uid)| uid));
        if let Some(pod) = pod {
            if in_kubepods && pod.len() >= 32 {
                placement.pod_uid = Some(pod.replace('_', "-"));
                continue;
            }
        }
        let named = [
            ("docker-", "docker"),
            ("cri-containerd-", "containerd"),
            ("crio-", "crio"),
            ("libpod-", "podman"),
        ]
        .iter()
        .find_map(|(prefix, runtime)| {
            let id = unit.strip_prefix(prefix)?;
            is_id(id).then_some((id, *runtime))
        });
        if let Some((id, runtime)) = named {
            placement.container_id = Some(id.to_string());
            placement.container_runtime = Some(runtime.to_string());
        } else if is_id(unit) {
            // cgroupfs drivers: /docker/<id>, /kubepods/<qos>/pod<uid>/<id>.
            let runtime = match index.checked_sub(1).and_then(|i| components.get(i)) {
                Some(&"docker") => "docker",
                Some(&"libpod_parent") => "podman",
                _ if in_kubepods => "kubernetes",
                _ => "unknown",
            };
            placement.container_id = Some(unit.to_string());
            placement.container_runtime = Some(runtime.to_string());
        }
    }
    placement
}

/// A pod's container placement with every field set, for tests of the
/// places that show it.
#[cfg(test)]
impl Placement {
    pub fn sample_pod() -> Self {
        Placement {
            ns_pid: Some(7),
            container_id: Some("ab".repeat(32)),
            container_runtime: Some("containerd".into()),
            pod_uid: Some("0a1b2c3d-4e5f-6789-abcd-ef0123456789".into()),
            pod_name: Some("web-0".into()),
            pod_namespace: Some("shop".into()),
            container_name: Some("app".into()),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f1c8f4c9a2b7d5e6f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6";

    fn named(cgroup: &str) -> (Option<String>, Option<String>, Option<String>) {
        let path = cgroup_path(cgroup).expect("a path");
        let placement = container(&path);
        (
            placement.container_id,
            placement.container_runtime,
            placement.pod_uid,
        )
    }

    fn some(text: &str) -> Option<String> {
        Some(text.to_string())
    }

    #[test]
    fn docker_systemd_and_cgroupfs() {
        let v2 = format!("0::/system.slice/docker-{ID}.scope\n");
        assert_eq!(named(&v2), (some(ID), some("docker"), None));
        let v1 = format!(
            "12:pids:/docker/{ID}\n11:memory:/docker/{ID}\n1:name=systemd:/docker/{ID}\n0::/\n"
        );
        assert_eq!(cgroup_path(&v1), Some(format!("/docker/{ID}")));
        assert_eq!(named(&v1), (some(ID), some("docker"), None));
    }

    #[test]
    fn containerd_under_kubernetes() {
        let line = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a1b2c3d_4e5f_6789_abcd_ef0123456789.slice/cri-containerd-{ID}.scope\n"
        );
        assert_eq!(
            named(&line),
            (
                some(ID),
                some("containerd"),
                some("0a1b2c3d-4e5f-6789-abcd-ef0123456789")
            )
        );
        // cgroupfs driver.
        let line =
            format!("0::/kubepods/besteffort/pod0a1b2c3d-4e5f-6789-abcd-ef0123456789/{ID}\n");
        assert_eq!(
            named(&line),
            (
                some(ID),
                some("kubernetes"),
                some("0a1b2c3d-4e5f-6789-abcd-ef0123456789")
            )
        );
    }

    #[test]
    fn crio_and_podman() {
        let crio = format!(
            "0::/kubepods.slice/kubepods-pod0a1b2c3d_4e5f_6789_abcd_ef0123456789.slice/crio-{ID}.scope\n"
        );
        assert_eq!(named(&crio).1, some("crio"));
        assert_eq!(named(&crio).0, some(ID));
        let podman = format!("0::/machine.slice/libpod-{ID}.scope/container\n");
        assert_eq!(named(&podman), (some(ID), some("podman"), None));
        let rootless = format!(
            "0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope\n"
        );
        assert_eq!(named(&rootless), (some(ID), some("podman"), None));
    }

    #[test]
    fn services_and_sessions_are_no_container() {
        for text in [
            "0::/system.slice/nginx.service\n",
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            "0::/\n",
            "0::/system.slice/docker.service\n",
        ] {
            assert_eq!(named(text), (None, None, None), "{text}");
        }
        assert_eq!(
            cgroup_path("0::/system.slice/nginx.service\n"),
            some("/system.slice/nginx.service")
        );
        assert_eq!(cgroup_path(""), None);
    }

    #[test]
    fn ns_pid_is_the_innermost() {
        assert_eq!(ns_pid("Name:\tleak\nNSpid:\t4242\t7\nNSsid:\t1\n"), Some(7));
        assert_eq!(ns_pid("NSpid:\t4242\n"), Some(4242));
        assert_eq!(ns_pid("Name:\tx\n"), None);
    }

    #[test]
    fn describes_only_what_differs() {
        assert_eq!(Placement::default().describe(), "");
        let placement = Placement {
            ns_pid: Some(7),
            container_id: some(ID),
            container_runtime: some("docker"),
            ..Placement::default()
        };
        assert_eq!(
            placement.describe(),
            " (ns pid 7, container docker 3f1c8f4c9a2b)"
        );
        let pod = Placement {
            container_runtime: some("containerd"),
            pod_uid: some("0a1b2c3d-4e5f-6789-abcd-ef0123456789"),
            ..placement.clone()
        };
        assert_eq!(
            pod.describe(),
            " (ns pid 7, container containerd 3f1c8f4c9a2b, pod 0a1b2c3d-4e5f-6789-abcd-ef0123456789)"
        );
        let named = Placement {
            pod_name: some("web-0"),
            pod_namespace: some("shop"),
            container_name: some("app"),
            ..pod
        };
        assert_eq!(
            named.describe(),
            " (ns pid 7, container containerd 3f1c8f4c9a2b \"app\", pod shop/web-0)"
        );
        // The JSON keys are added beside the others.
        let json = serde_json::to_value(&named).expect("serializes");
        assert_eq!(json["pod_name"], "web-0");
        assert_eq!(json["pod_namespace"], "shop");
        assert_eq!(json["container_name"], "app");
        assert_eq!(json["pod_uid"], "0a1b2c3d-4e5f-6789-abcd-ef0123456789");
        let own = Placement::of(std::process::id());
        assert!(own.cgroup.is_some() || !std::path::Path::new("/proc/self/cgroup").exists());
    }
}
