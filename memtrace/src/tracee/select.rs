//! Which processes a selection means, at the start and while they run:
//! `--name NAME`, `--container ID`, `--cgroup PATH` or `--pod
//! NAMESPACE/NAME` ([`Selector`]); the tracer and `memtrace watch` poll
//! [`Finder::find`] for processes that join it later.
//!
//! A process has the name when its `comm` is NAME (the kernel keeps 15 bytes
//! of it: a longer NAME matches a comm that is its first 15 bytes), or the
//! basename of its `argv[0]` or of its executable is NAME. It is in a
//! container when the container id read from its `/proc/PID/cgroup` (as the
//! reports show it, [`container::container`]) is the one the `--container`
//! prefix resolved to; in a cgroup when one of its `/proc/PID/cgroup` entries
//! is that cgroup or lies below it; in a pod when the pod its cgroup names
//! is that pod, by namespace and name as the reports show them
//! ([`pods`]). memtrace itself, kernel threads and zombies never match.

mod pods;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

pub use pods::PodSpec;

use crate::error::Failure;
use crate::tracee;
use crate::tracee::container;

/// The processes a trace selects besides `--pid` and launch mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    /// `--name NAME`.
    Name(String),
    /// `--container ID`: the full container id its prefix resolved to.
    Container(String),
    /// `--cgroup PATH`.
    Cgroup(CgroupSpec),
    /// `--pod NAMESPACE/NAME`: the pod `NAME` alone resolved to.
    Pod(PodSpec),
}

/// A cgroup as `/proc/PID/cgroup` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupSpec {
    /// The hierarchy (`0` for v2, `4` for a v1 one) and its controllers
    /// (`""` for v2, `memory`), when given as a whole line; `None` for a
    /// bare path (any hierarchy).
    pub hierarchy: Option<(String, String)>,
    /// The path, no trailing `/` (but `/` itself).
    pub path: String,
}

impl CgroupSpec {
    /// Parses `/path`, `0::/path` (v2) or `4:memory:/path` (v1).
    pub fn parse(text: &str) -> Result<CgroupSpec, String> {
        let text = text.trim();
        let (hierarchy, path) = if text.starts_with('/') {
            (None, text)
        } else {
            let mut fields = text.splitn(3, ':');
            match (fields.next(), fields.next(), fields.next()) {
                (Some(id), Some(controllers), Some(path))
                    if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    (Some((id.to_string(), controllers.to_string())), path)
                }
                _ => (None, ""),
            }
        };
        if !path.starts_with('/') {
            return Err(format!(
                "--cgroup {text}: expected a cgroup path as /proc/PID/cgroup shows it (/system.slice/x.service, 0::/kubepods.slice/..., or 4:memory:/docker/ID)"
            ));
        }
        let trimmed = path.trim_end_matches('/');
        Ok(CgroupSpec {
            hierarchy,
            path: if trimmed.is_empty() { "/" } else { trimmed }.to_string(),
        })
    }

    /// Whether a `/proc/PID/cgroup` text puts its process in this cgroup
    /// (or below it).
    pub fn contains(&self, cgroup_text: &str) -> bool {
        cgroup_text.lines().any(|line| {
            let mut fields = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) =
                (fields.next(), fields.next(), fields.next())
            else {
                return false;
            };
            if let Some((want_id, want_controllers)) = &self.hierarchy {
                if id != want_id || controllers != want_controllers {
                    return false;
                }
            }
            self.path == "/"
                || path == self.path
                || path
                    .strip_prefix(self.path.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
        })
    }
}

impl std::fmt::Display for CgroupSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.hierarchy {
            Some((id, controllers)) => write!(f, "{id}:{controllers}:{}", self.path),
            None => f.write_str(&self.path),
        }
    }
}

impl Selector {
    /// The selection `--name`, `--container`, `--cgroup` or `--pod` asks
    /// for (clap lets at most one through); a container prefix is resolved
    /// against the running processes' cgroups here, a pod against the pods
    /// on the node. Bad input is a usage failure.
    pub fn from_args(
        name: Option<&str>,
        container: Option<&str>,
        cgroup: Option<&str>,
        pod: Option<&str>,
    ) -> Result<Option<Selector>, Failure> {
        if let Some(name) = name {
            return Ok(Some(Selector::Name(name.to_string())));
        }
        if let Some(prefix) = container {
            return resolve_container(prefix, &running_containers()).map(Some);
        }
        if let Some(path) = cgroup {
            return CgroupSpec::parse(path)
                .map(|spec| Some(Selector::Cgroup(spec)))
                .map_err(Failure::usage);
        }
        if let Some(given) = pod {
            return resolve_pod(given, Path::new("/proc"), tracee::pod::host_roots()).map(Some);
        }
        Ok(None)
    }

    /// `named NAME`, `in container 0123456789ab`, `in cgroup PATH` (notes).
    pub fn what(&self) -> String {
        match self {
            Selector::Name(name) => format!("named {name}"),
            Selector::Container(id) => format!("in container {}", short_id(id)),
            Selector::Cgroup(spec) => format!("in cgroup {spec}"),
            Selector::Pod(spec) => format!("in pod {spec}"),
        }
    }

    /// Why a process was picked (`it has the name NAME`).
    pub fn reason(&self) -> String {
        match self {
            Selector::Name(name) => format!("it has the name {name}"),
            other => format!("it is {}", other.what()),
        }
    }

    /// The one line saying nothing matched.
    pub fn none_running(&self) -> String {
        match self {
            Selector::Name(name) => format!(
                "--name {name}: no running process has this name (exact comm, argv0 or executable basename)"
            ),
            Selector::Container(id) => format!(
                "--container {}: no running process is left in this container",
                short_id(id)
            ),
            Selector::Cgroup(spec) => format!(
                "--cgroup {spec}: no running process is in this cgroup or below it (paths as /proc/PID/cgroup shows them)"
            ),
            Selector::Pod(spec) => {
                format!("--pod {spec}: no running process is in this pod on this node")
            }
        }
    }

    /// What a process is looked at by, read once per poll: its comm for a
    /// name, its `/proc/PID/cgroup` for the others (a process that does not
    /// match is looked at again only once this changes).
    fn key(&self, proc_root: &Path, pid: u32) -> Option<String> {
        let file = match self {
            Selector::Name(_) => "comm",
            Selector::Container(_) | Selector::Cgroup(_) | Selector::Pod(_) => "cgroup",
        };
        std::fs::read_to_string(proc_root.join(pid.to_string()).join(file))
            .ok()
            .map(|text| text.trim_end_matches('\n').to_string())
    }

    /// Whether process `pid`, whose key is `key`, is selected.
    fn matches(&self, proc_root: &Path, pid: u32, key: &str) -> bool {
        match self {
            Selector::Name(name) => {
                let (_, argv0) = process_names(proc_root, pid);
                let exe = std::fs::read_link(proc_root.join(pid.to_string()).join("exe")).ok();
                let exe_name = exe
                    .as_deref()
                    .and_then(Path::file_name)
                    .and_then(|n| n.to_str());
                has_name(name, key, argv0.as_deref(), exe_name)
            }
            Selector::Container(id) => container_of(key).as_deref() == Some(id.as_str()),
            Selector::Cgroup(spec) => spec.contains(key),
            Selector::Pod(spec) => spec.contains(key),
        }
    }
}

/// The pod `--pod given` names among the pods on the node (the processes
/// under `proc_root`, the node's files under `roots`); a usage failure when
/// it names none or, `NAME` alone, pods in several namespaces.
pub fn resolve_pod(
    given: &str,
    proc_root: &Path,
    roots: Vec<PathBuf>,
) -> Result<Selector, Failure> {
    let pods = pods::pods_on_node(proc_root, &roots);
    pods::resolve(given, &pods, roots)
        .map(Selector::Pod)
        .map_err(|err| Failure::usage(err.to_string()))
}

/// The container id a `/proc/PID/cgroup` text names, as the reports show it.
fn container_of(cgroup_text: &str) -> Option<String> {
    container::cgroup_path(cgroup_text).and_then(|path| container::container(&path).container_id)
}

/// The first 12 characters of a container id (as `docker ps` shows it).
fn short_id(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

/// Every container id among the running processes, with how many processes
/// each has.
fn running_containers() -> BTreeMap<String, usize> {
    let mut found = BTreeMap::new();
    for pid in list_pids(Path::new("/proc")).unwrap_or_default() {
        if let Some(id) = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|text| container_of(&text))
        {
            *found.entry(id).or_insert(0) += 1;
        }
    }
    found
}

/// The one container whose id starts with `prefix` (pure: `running` is
/// every container id seen).
pub fn resolve_container(
    prefix: &str,
    running: &BTreeMap<String, usize>,
) -> Result<Selector, Failure> {
    let wanted = prefix.trim().to_ascii_lowercase();
    if wanted.is_empty() {
        return Err(Failure::usage(
            "--container: give a container id or a unique prefix of one",
        ));
    }
    let candidates: Vec<&String> = running
        .keys()
        .filter(|id| id.starts_with(&wanted))
        .collect();
    match candidates.as_slice() {
        [] => Err(Failure::usage(format!(
            "--container {prefix}: no running process is in a container with this id (ids read from /proc/PID/cgroup: Docker, containerd, CRI-O, Podman, Kubernetes; {} container(s) running)",
            running.len()
        ))),
        [one] => Ok(Selector::Container((*one).clone())),
        many => Err(Failure::usage(format!(
            "--container {prefix}: ambiguous, {} containers have ids starting so: {}",
            many.len(),
            distinct_prefixes(many).join(", ")
        ))),
    }
}

/// The ids as `docker ps` shows them (12 characters), longer where two
/// would read the same.
fn distinct_prefixes(ids: &[&String]) -> Vec<String> {
    (12..=64)
        .map(|len| {
            ids.iter()
                .map(|id| id.get(..len).unwrap_or(id).to_string())
                .collect::<Vec<_>>()
        })
        .find(|shown| shown.iter().collect::<BTreeSet<_>>().len() == shown.len())
        .unwrap_or_else(|| ids.iter().map(|id| id.to_string()).collect())
}

/// Finds the processes a selector means, now and each time it is asked again.
pub struct Finder {
    selector: Selector,
    /// Processes that did not match, by the key they had then: one is only
    /// looked at again once its key changes (an `exec`, a cgroup move).
    rejected: HashMap<u32, String>,
    own: u32,
    /// Where the processes are listed: `/proc` (another tree in tests).
    proc_root: PathBuf,
}

impl Finder {
    pub fn new(selector: Selector) -> Self {
        Finder {
            selector,
            rejected: HashMap::new(),
            own: std::process::id(),
            proc_root: PathBuf::from("/proc"),
        }
    }

    pub fn selector(&self) -> &Selector {
        &self.selector
    }

    /// The running processes selected, by ascending pid, leaving out those
    /// in `known`.
    pub fn find(&mut self, known: &BTreeSet<u32>) -> Vec<u32> {
        self.find_with(known, |pid| tracee::inspect(pid).is_ok())
    }

    /// [`Finder::find`], with `traceable` saying whether a process that
    /// matches can be looked at (a process of `/proc`: not a kernel thread
    /// or a zombie).
    fn find_with(&mut self, known: &BTreeSet<u32>, traceable: impl Fn(u32) -> bool) -> Vec<u32> {
        let proc_root = self.proc_root.clone();
        let Ok(pids) = list_pids(&proc_root) else {
            return Vec::new();
        };
        let listed: BTreeSet<u32> = pids.iter().copied().collect();
        self.rejected.retain(|pid, _| listed.contains(pid));
        let mut found = Vec::new();
        for pid in pids {
            if pid == self.own || known.contains(&pid) {
                continue;
            }
            // One read per process and poll in the steady state: the key.
            let Some(key) = self.selector.key(&proc_root, pid) else {
                continue;
            };
            if self.rejected.get(&pid) == Some(&key) {
                continue;
            }
            if self.selector.matches(&proc_root, pid, &key) && traceable(pid) {
                self.rejected.remove(&pid);
                found.push(pid);
            } else {
                self.rejected.insert(pid, key);
            }
        }
        found
    }
}

/// Whether a process with this comm, argv0 basename and executable basename
/// has the name `name`.
pub fn has_name(name: &str, comm: &str, argv0: Option<&str>, exe: Option<&str>) -> bool {
    !name.is_empty() && (name_matches(name, Some(comm), argv0) || exe == Some(name))
}

/// The command name of a process: `comm`, and argv0's basename.
pub fn process_names(proc_root: &Path, pid: u32) -> (Option<String>, Option<String>) {
    let dir = proc_root.join(pid.to_string());
    let comm = std::fs::read_to_string(dir.join("comm"))
        .ok()
        .map(|s| s.trim_end_matches('\n').to_string());
    let argv0 = std::fs::read(dir.join("cmdline")).ok().and_then(|bytes| {
        let first = bytes.split(|b| *b == 0).next()?;
        let text = String::from_utf8_lossy(first).to_string();
        let base = text.rsplit('/').next()?.to_string();
        (!base.is_empty()).then_some(base)
    });
    (comm, argv0)
}

/// True if `name` matches a process's comm (which the kernel truncates to
/// 15 bytes) or its argv0 basename.
pub fn name_matches(name: &str, comm: Option<&str>, argv0: Option<&str>) -> bool {
    if let Some(comm) = comm {
        if comm == name || (comm.len() == 15 && name.len() > 15 && name.starts_with(comm)) {
            return true;
        }
    }
    argv0 == Some(name)
}

/// Pids under `proc_root`, ascending.
pub fn list_pids(proc_root: &Path) -> std::io::Result<Vec<u32>> {
    let mut pids: Vec<u32> = std::fs::read_dir(proc_root)?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    Ok(pids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_exact() {
        assert!(has_name("redis-server", "redis-server", None, None));
        assert!(has_name("python3", "python3", Some("python3"), None));
        // The executable's basename counts (argv0 rewritten, comm renamed).
        assert!(has_name(
            "smengine_demo",
            "worker-3",
            Some("[worker]"),
            Some("smengine_demo")
        ));
        // A comm the kernel cut at 15 bytes.
        assert!(has_name(
            "a_very_long_process_name",
            "a_very_long_pro",
            None,
            None
        ));
        // Prefixes and substrings are not the name.
        assert!(!has_name(
            "redis",
            "redis-server",
            Some("redis-server"),
            Some("redis-server")
        ));
        assert!(!has_name("", "", None, None));
    }

    #[test]
    fn cgroups_parse_as_proc_shows_them() {
        let spec = CgroupSpec::parse("0::/kubepods.slice/pod/").expect("v2 line");
        assert_eq!(spec.hierarchy, Some(("0".into(), String::new())));
        assert_eq!(spec.path, "/kubepods.slice/pod");
        assert_eq!(spec.to_string(), "0::/kubepods.slice/pod");
        let spec = CgroupSpec::parse("4:memory:/docker/abc").expect("v1 line");
        assert_eq!(spec.hierarchy, Some(("4".into(), "memory".into())));
        let spec = CgroupSpec::parse("/system.slice/redis.service").expect("bare");
        assert_eq!(spec.hierarchy, None);
        assert_eq!(CgroupSpec::parse("/").expect("root").path, "/");
        for bad in ["", "system.slice", "x::/a", "0::relative", "0:/a"] {
            let err = CgroupSpec::parse(bad).expect_err(bad);
            assert!(err.starts_with("--cgroup"), "{err}");
            assert!(!err.contains('\n'));
        }
    }

    #[test]
    fn a_cgroup_holds_its_descendants_only() {
        let v2 = "0::/system.slice/docker-0a.scope/init\n";
        let spec = CgroupSpec::parse("/system.slice/docker-0a.scope").expect("path");
        assert!(spec.contains(v2));
        assert!(spec.contains("0::/system.slice/docker-0a.scope\n"));
        // A sibling that shares the prefix is not below it.
        assert!(!spec.contains("0::/system.slice/docker-0ab.scope\n"));
        assert!(CgroupSpec::parse("/").expect("root").contains(v2));
        // A v1 line names its hierarchy: another one does not count.
        let v1 = "12:pids:/docker/0a\n4:memory:/docker/0a\n0::/\n";
        assert!(CgroupSpec::parse("4:memory:/docker/0a")
            .expect("v1")
            .contains(v1));
        assert!(!CgroupSpec::parse("5:memory:/docker/0a")
            .expect("v1")
            .contains(v1));
        assert!(CgroupSpec::parse("/docker/0a").expect("bare").contains(v1));
        assert!(!CgroupSpec::parse("0::/docker/0a").expect("v2").contains(v1));
    }

    #[test]
    fn container_prefixes_resolve_to_one_id() {
        let a = format!("0123456789ab{}", "c".repeat(52));
        let b = format!("0123456789ab{}", "d".repeat(52));
        let c = format!("fe{}", "0".repeat(62));
        let running: BTreeMap<String, usize> =
            [(a.clone(), 2), (b.clone(), 1), (c.clone(), 1)].into();
        assert_eq!(
            resolve_container("FE", &running).expect("unique"),
            Selector::Container(c.clone())
        );
        assert_eq!(
            resolve_container(&a, &running).expect("whole id"),
            Selector::Container(a.clone())
        );
        let ambiguous = resolve_container("0123", &running).expect_err("two");
        assert_eq!(ambiguous.code, crate::error::EXIT_USAGE);
        assert!(
            ambiguous.message.contains("ambiguous"),
            "{}",
            ambiguous.message
        );
        // Both candidates listed, long enough to tell apart.
        assert!(ambiguous.message.contains(&a[..13]) && ambiguous.message.contains(&b[..13]));
        assert!(!ambiguous.message.contains(&c[..12]));
        let none = resolve_container("99", &running).expect_err("none");
        assert_eq!(none.code, crate::error::EXIT_USAGE);
        assert!(none
            .message
            .starts_with("--container 99: no running process"));
        assert!(resolve_container(" ", &running).is_err());
    }

    #[test]
    fn selectors_say_what_they_select() {
        let id = format!("0123456789ab{}", "c".repeat(52));
        let container = Selector::Container(id.clone());
        assert_eq!(container.what(), "in container 0123456789ab");
        assert_eq!(container.reason(), "it is in container 0123456789ab");
        assert_eq!(
            Selector::Name("redis".into()).reason(),
            "it has the name redis"
        );
        let cgroup = Selector::Cgroup(CgroupSpec::parse("0::/a.slice").expect("v2"));
        assert_eq!(cgroup.what(), "in cgroup 0::/a.slice");
        // The cgroup's key is the whole /proc/PID/cgroup text.
        let own = std::process::id();
        let proc_root = Path::new("/proc");
        let key = cgroup.key(proc_root, own).expect("own cgroup");
        assert!(
            Selector::Cgroup(CgroupSpec::parse("/").expect("root")).matches(proc_root, own, &key)
        );
        assert_eq!(
            container_of(&format!("0::/system.slice/docker-{id}.scope\n")),
            Some(id)
        );
    }

    #[test]
    fn this_process_is_never_found_by_its_own_name() {
        let exe = std::env::current_exe().expect("exe");
        let name = exe
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_string();
        let mut finder = Finder::new(Selector::Name(name));
        // memtrace never traces itself.
        assert!(!finder.find(&BTreeSet::new()).contains(&std::process::id()));
    }
}
