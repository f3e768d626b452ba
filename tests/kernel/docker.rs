//! A real container runtime: Debian's Docker (dockerd, containerd, runc,
//! cgroup v1 with cgroupfs) runs the fixtures in containers of the test
//! image `MEMTRACE_DOCKER_IMAGE` (a Debian trixie root file system, glibc
//! 2.41 and python3.13, where the host has bookworm's 2.36 and 3.11;
//! `cargo xtask test` starts the daemon and builds the image, see
//! xtask/src/docker.rs). The fixtures and scripts are bind-mounted read-only
//! (`/fixtures`, `/scripts`), so a dynamically linked fixture runs on the
//! container's glibc. Checked: `--container` with and without `docker run
//! --init`, `--pid` of a container process, libc frames named from the
//! container's own glibc (not the host's, whose libc6-dbg is installed),
//! Python lines and native frames of the container's python3.13, `watch
//! --container`, processes `docker exec` starts during a trace, a recorded
//! trace replayed to the same sites, and the Containerfile's image (built
//! from the test image as its base) tracing another container with the
//! DaemonSet's settings. Without the variable (a plain `cargo test`) each
//! test says why it is skipped.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use object::{Object, ObjectSegment, ObjectSymbol};
use serde_json::Value;

use crate::support::{fixtures, privileged, site_totals, sites_of, Fixture, Tracer, MEMTRACE};
use crate::watch::{assert_found_leak_block, probe_fds, reports_dir, wait_json, Watch, QUICK};

/// A JSON report of every site, the trace ended by SIGINT (at most 2 min).
const JSON_REPORT: &[&str] = &["--format", "json", "--top", "500", "--duration", "2m"];

/// The test image, when this suite can run (root and the image named).
fn image() -> Option<String> {
    if !privileged() {
        return None;
    }
    let image = std::env::var("MEMTRACE_DOCKER_IMAGE").ok();
    if image.is_none() {
        eprintln!(
            "SKIPPED: MEMTRACE_DOCKER_IMAGE names no test image (`cargo xtask test` starts dockerd and builds it)"
        );
    }
    image
}

/// Runs `docker` with `args`; its stdout, trimmed (panics on failure).
fn docker(args: &[&str]) -> String {
    let out = Command::new("docker")
        .args(args)
        .output()
        .expect("docker runs");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A fixture speaking its ready/go/done protocol through a docker client
/// (`docker run -i`, `docker exec -i`); its `pid` is the one it sees, in
/// the container's pid namespace.
fn through_docker(args: &[&str]) -> Fixture {
    let mut command = Command::new("docker");
    command.args(args);
    Fixture::start_command(command)
}

/// A docker command run on drop (`rm -f NAME`, `rmi -f TAG`): what a test
/// made is removed whatever happened.
struct OnDrop(Vec<String>);

impl OnDrop {
    fn docker(args: &[&str]) -> OnDrop {
        OnDrop(args.iter().map(|a| a.to_string()).collect())
    }
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(&self.0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A `docker run` container of the test image, removed (`docker rm -f`)
/// on drop whatever happened.
struct Container {
    /// Dropped first: the container goes before its client is killed.
    _removed: OnDrop,
    name: String,
    id: String,
    main: Fixture,
    /// The host pid of the program it runs (docker-init's child with `--init`).
    host_pid: u32,
}

impl Container {
    /// Runs `command` in a new container (`--network none`, the fixtures
    /// and scripts mounted) with `extra` options for `docker run`.
    fn run(image: &str, extra: &[&str], command: &[&str]) -> Container {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let name = format!(
            "memtrace-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let fixtures = format!("{}:/fixtures:ro", fixtures().display());
        let scripts = format!("{}:/scripts:ro", scripts().display());
        let mut args = vec![
            "run",
            "-i",
            "--name",
            &name,
            "--network",
            "none",
            "-v",
            &fixtures,
            "-v",
            &scripts,
        ];
        args.extend_from_slice(extra);
        args.push(image);
        args.extend_from_slice(command);
        // Removed on drop even when the start fails half way.
        let mut container = Container {
            _removed: OnDrop::docker(&["rm", "-f", &name]),
            name: name.clone(),
            id: String::new(),
            main: through_docker(&args),
            host_pid: 0,
        };
        container.id = docker(&["inspect", "-f", "{{.Id}}", &name]);
        container.host_pid = container.host_pid_of(container.main.pid);
        container
    }

    /// The host pid of the container's process `ns_pid`: the process in
    /// the pid namespace of the container's init whose innermost pid it is.
    fn host_pid_of(&self, ns_pid: u32) -> u32 {
        let init = docker(&["inspect", "-f", "{{.State.Pid}}", &self.name]);
        let ns = std::fs::read_link(format!("/proc/{init}/ns/pid")).expect("init's pid namespace");
        std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .find(|pid| {
                std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|n| n == ns)
                    && innermost_pid(*pid) == Some(ns_pid)
            })
            .unwrap_or_else(|| panic!("no process {ns_pid} in container {}", self.name))
    }

    /// Starts `command` in the running container (`docker exec -i`).
    fn exec(&self, command: &[&str]) -> (Fixture, u32) {
        let mut args = vec!["exec", "-i", self.name.as_str()];
        args.extend_from_slice(command);
        let started = through_docker(&args);
        let host_pid = self.host_pid_of(started.pid);
        (started, host_pid)
    }

    fn prefix(&self) -> &str {
        &self.id[..12]
    }
}

/// The last pid of `NSpid:` in /proc/PID/status (its pid in its own namespace).
fn innermost_pid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python")
}

/// The leak_sites fixture in a container (pid 1, or docker-init's child).
fn leak_sites(image: &str, extra: &[&str]) -> Container {
    Container::run(image, extra, &["/fixtures/leak_sites", "30", "30"])
}

/// Attaches memtrace with `selection` (`--container ID`, `--pid PID`) and
/// `extra`, lets the container's program do its work, ends the trace.
fn trace(container: &mut Container, selection: &[&str], extra: &[&str]) -> (Value, String) {
    let mut args = selection.to_vec();
    args.extend_from_slice(JSON_REPORT);
    args.extend_from_slice(extra);
    let tracer = Tracer::attach(&args);
    container.main.go();
    tracer.signal(libc::SIGINT);
    tracer.report()
}

/// leak_sites' leaks, exactly (tests/fixtures/host/leak_sites.c).
fn assert_leaks(report: &Value, times: u64, stderr: &str) {
    assert_eq!(
        site_totals(report, "leak_a"),
        (4800 * times, 100 * times),
        "{stderr}"
    );
    assert_eq!(
        site_totals(report, "leak_b"),
        (10000 * times, 10 * times),
        "{stderr}"
    );
    assert_eq!(
        site_totals(report, "leak_calloc"),
        (1000 * times, 5 * times),
        "{stderr}"
    );
}

/// The report's entry for host pid `pid`.
fn process(report: &Value, pid: u32) -> &Value {
    report["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["pid"] == pid)
        .unwrap_or_else(|| panic!("pid {pid} not in {}", report["processes"]))
}

/// The report's target is the container's program, named as Docker names it.
fn assert_placement(report: &Value, container: &Container) {
    let target = &report["target"];
    assert_eq!(target["pid"], container.host_pid, "{target}");
    assert_eq!(target["ns_pid"], container.main.pid, "{target}");
    assert_eq!(target["container_id"], container.id.as_str(), "{target}");
    assert_eq!(target["container_runtime"], "docker", "{target}");
    assert_eq!(
        target["container_name"],
        container.name.as_str(),
        "{target}"
    );
}

#[test]
fn a_docker_container_is_traced_by_its_id() {
    let Some(image) = image() else { return };
    let mut container = leak_sites(&image, &[]);
    assert_eq!(container.main.pid, 1);
    let prefix = container.prefix().to_string();
    let (report, stderr) = trace(&mut container, &["--container", &prefix], &[]);
    assert_leaks(&report, 1, &stderr);
    assert_placement(&report, &container);
}

#[test]
fn docker_run_init_is_skipped_with_a_note_and_its_child_traced() {
    let Some(image) = image() else { return };
    let mut container = leak_sites(&image, &["--init"]);
    // docker-init is pid 1, the program its child.
    assert_ne!(container.main.pid, 1);
    let init = container.host_pid_of(1);
    let comm = std::fs::read_to_string(format!("/proc/{init}/comm")).expect("comm");
    assert_eq!(comm.trim(), "docker-init");
    let prefix = container.prefix().to_string();
    let (report, stderr) = trace(&mut container, &["--container", &prefix], &[]);
    assert_leaks(&report, 1, &stderr);
    assert_placement(&report, &container);
    let note = format!("pid {init} (docker-init) was not traced: no allocator function to probe");
    assert!(stderr.contains(&note), "{stderr}");
    assert!(
        report["notes"].to_string().contains(&note),
        "{}",
        report["notes"]
    );
}

#[test]
fn a_container_process_is_traced_by_its_host_pid() {
    let Some(image) = image() else { return };
    let mut container = leak_sites(&image, &[]);
    let pid = container.host_pid.to_string();
    let (report, stderr) = trace(&mut container, &["--pid", &pid], &[]);
    assert_leaks(&report, 1, &stderr);
    assert_placement(&report, &container);
}

/// The name of the dynamic symbol of the ELF file `data` that covers
/// `offset` (a file offset in a loaded segment), if any.
fn dynamic_symbol_at(data: &[u8], offset: u64) -> Option<String> {
    let elf = object::File::parse(data).expect("an ELF file");
    let address = elf.segments().find_map(|segment| {
        let (start, size) = segment.file_range();
        (start..start + size)
            .contains(&offset)
            .then(|| segment.address() + (offset - start))
    })?;
    elf.dynamic_symbols()
        .find(|s| s.size() > 0 && (s.address()..s.address() + s.size()).contains(&address))
        .and_then(|s| s.name().ok().map(str::to_string))
}

fn build_id(data: &[u8]) -> Option<Vec<u8>> {
    let elf = object::File::parse(data).expect("an ELF file");
    elf.build_id().ok().flatten().map(<[u8]>::to_vec)
}

/// Every frame of `site` in `module`, as (symbol, file, file offset).
fn frames_in<'a>(site: &'a Value, module: &str) -> Vec<(Option<&'a str>, Option<&'a str>, u64)> {
    site["frames"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["module"] == module)
        .map(|f| {
            let offset = f["offset"]
                .as_str()
                .and_then(|o| u64::from_str_radix(o.trim_start_matches("0x"), 16).ok())
                .unwrap_or_else(|| panic!("no offset: {f}"));
            (f["symbol"].as_str(), f["file"].as_str(), offset)
        })
        .collect()
}

/// Asserts the named frames of `site` in `module` carry the names the
/// container's own file (read through /proc/`pid`/root) gives their
/// offsets; returns how many were named.
fn assert_named_from_the_containers_file(site: &Value, module: &str, pid: u32) -> usize {
    let inside = std::fs::read(format!("/proc/{pid}/root{module}")).expect("the container's file");
    let frames = frames_in(site, module);
    assert!(!frames.is_empty(), "no frame in {module}: {site}");
    let mut named = 0;
    for (symbol, _, offset) in &frames {
        if let Some(symbol) = symbol {
            if let Some(own) = dynamic_symbol_at(&inside, *offset) {
                assert_eq!(*symbol, own, "{module}+{offset:#x}: {site}");
                named += 1;
            }
        }
    }
    named
}

#[test]
fn libc_frames_are_named_from_the_containers_own_glibc() {
    let Some(image) = image() else { return };
    let mut container = leak_sites(&image, &[]);
    let pid = container.host_pid;
    // The container's libc, as it maps it.
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let libc = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libc.so.6"))
        .expect("libc mapped")
        .to_string();
    let inside = std::fs::read(format!("/proc/{pid}/root{libc}")).expect("the container's libc");
    let host = std::fs::read(&libc).expect("the host's libc at that path");
    // Another build at the same path on the host (and the host's libc6-dbg
    // has debug files for that one only): a frame named from the host's
    // files would show.
    assert_ne!(build_id(&inside), build_id(&host), "the same glibc");
    assert!(
        Path::new("/usr/lib/debug/.build-id").is_dir(),
        "the host's libc6-dbg is required (apt-get install libc6-dbg)"
    );
    let pid_s = pid.to_string();
    let (report, stderr) = trace(&mut container, &["--pid", &pid_s], &[]);
    let site = sites_of(&report, "leak_a")[0];
    let named = assert_named_from_the_containers_file(site, &libc, pid);
    assert!(
        named >= 1,
        "a libc frame named (__libc_start_main): {site}\n{stderr}"
    );
    // No source file of the host's debug files (the container has none).
    for (symbol, file, offset) in frames_in(site, &libc) {
        assert_eq!(
            file, None,
            "{symbol:?}+{offset:#x} from a debug file: {site}"
        );
    }
}

#[test]
fn python_in_a_docker_container_gets_its_lines_and_its_own_native_frames() {
    let Some(image) = image() else { return };
    let mut container = Container::run(
        &image,
        &[],
        &["python3", "/scripts/container_leak.py", "30"],
    );
    let pid = container.host_pid.to_string();
    let (report, stderr) = trace(&mut container, &["--pid", &pid], &[]);
    let found = &report["python"][0];
    assert_eq!(found["frames_read"], true, "{found}");
    assert!(
        found["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.13.")),
        "the container's python3.13: {found}"
    );
    let sites = crate::python::sites_in(&report, "render");
    assert_eq!(
        sites.len(),
        1,
        "one render site: {}\n{stderr}",
        report["sites"]
    );
    let site = sites[0];
    // Every fourth of 40 bytearray(100000) kept (each 100001 bytes).
    assert_eq!(
        (site["live_bytes"].as_u64(), site["live_count"].as_u64()),
        (Some(10 * 100_001), Some(10)),
        "{site}"
    );
    let line = |marker| crate::python::line_in("container_leak.py", marker);
    assert_eq!(
        crate::python::py_frames(site),
        [
            ("render".to_string(), line("render")),
            ("handle".to_string(), line("handle")),
            ("<module>".to_string(), line("module_handle")),
        ],
        "{site}"
    );
    // The interpreter's native frames, named from its own file.
    let object = found["object"].as_str().expect("the interpreter's object");
    let named = assert_named_from_the_containers_file(site, object, container.host_pid);
    assert!(named >= 1, "a native frame of {object} named: {site}");
}

#[test]
fn watch_container_traces_the_leaking_process_of_a_docker_container() {
    let Some(image) = image() else { return };
    // Under a name of its own: watch.rs watches `--name steady_leak`,
    // maybe at the same time.
    let program = format!(
        "{}:/app/docker_steady:ro",
        fixtures().join("steady_leak").display()
    );
    let mut container = Container::run(
        &image,
        &["-v", &program],
        &["/app/docker_steady", "256", "100"],
    );
    let dir = reports_dir("docker");
    let dir_s = dir.to_string_lossy().to_string();
    let prefix = container.prefix().to_string();
    let mut watch = Watch::start(&[&["--container", &prefix, "--reports", &dir_s], QUICK].concat());
    watch.wait_for(&format!("watching pid {}", container.host_pid));
    assert_eq!(
        probe_fds(watch.child.id()),
        Vec::<String>::new(),
        "probes while healthy"
    );
    // It leaks: an episode traces it.
    container.main.send_line();
    let episode = wait_json(&dir.join("episode-0001/episode.json"), &watch);
    container.main.send_line();
    assert_eq!(episode["pid"], container.host_pid, "{episode}");
    assert_eq!(episode["outcome"], "done", "{episode}\n{}", watch.text());
    assert_found_leak_block(&episode);
    let heartbeat: Value =
        serde_json::from_slice(&std::fs::read(dir.join("heartbeat.json")).expect("heartbeat.json"))
            .expect("JSON");
    let process = heartbeat["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["pid"] == container.host_pid)
        .unwrap_or_else(|| panic!("pid {} in {heartbeat}", container.host_pid));
    assert_eq!(
        process["container_id"],
        container.id.as_str(),
        "{heartbeat}"
    );
    let (status, text) = watch.stop();
    assert!(status.success(), "{status}: {text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn processes_docker_exec_starts_during_a_trace_are_traced() {
    let Some(image) = image() else { return };
    let mut container = leak_sites(&image, &[]);
    let prefix = container.prefix().to_string();
    let mut tracer = Tracer::attach(&[&["--container", &prefix], JSON_REPORT].concat());
    let (mut exec, exec_pid) = container.exec(&["/fixtures/leak_sites", "30", "30"]);
    tracer.wait_for_stderr(&format!(
        "tracing pid {exec_pid} (leak_sites) too: it is in container"
    ));
    container.main.go();
    exec.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    // Both processes' leaks, merged by call path.
    assert_leaks(&report, 2, &stderr);
    let late = process(&report, exec_pid);
    assert_eq!(late["started_during_trace"], true, "{late}");
    assert_eq!(late["ns_pid"], exec.pid, "{late}");
    assert_eq!(late["container_id"], container.id.as_str(), "{late}");
    assert_eq!(
        process(&report, container.host_pid)["started_during_trace"],
        false
    );
}

/// A site as what replay must keep: its frames (symbol, module, file,
/// line) and its live bytes and count.
fn site_keys(report: &Value) -> Vec<String> {
    let mut keys: Vec<String> = report["sites"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|site| {
            let frames: Vec<String> = site["frames"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|f| {
                    format!(
                        "{}|{}|{}|{}",
                        f["symbol"], f["module"], f["file"], f["line"]
                    )
                })
                .collect();
            format!(
                "{} {} {}",
                site["live_bytes"],
                site["live_count"],
                frames.join(" < ")
            )
        })
        .collect();
    keys.sort();
    keys
}

#[test]
fn a_recorded_container_trace_replays_to_the_same_sites() {
    let Some(image) = image() else { return };
    let record = std::env::temp_dir().join(format!("memtrace-docker-{}.jsonl", std::process::id()));
    let record_s = record.to_string_lossy().to_string();
    let mut container = leak_sites(&image, &[]);
    let prefix = container.prefix().to_string();
    let (live, stderr) = trace(
        &mut container,
        &["--container", &prefix],
        &["--record", &record_s],
    );
    assert_leaks(&live, 1, &stderr);
    // Replayed once the container and its files are gone.
    drop(container);
    let out = Command::new(MEMTRACE)
        .args(["report", &record_s, "--format", "json", "--top", "500"])
        .output()
        .expect("memtrace report runs");
    let _ = std::fs::remove_file(&record);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let replayed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(site_keys(&replayed), site_keys(&live));
}

/// A directory removed (with what it holds) on drop.
struct Removed(PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The Containerfile built with `docker build` from the locally imported
/// test image as its base (`--build-arg BASE`, no registry), around this
/// memtrace binary, run as the DaemonSet runs it (deploy/kubernetes:
/// hostPID, uid 0 with every capability dropped but some of those it adds,
/// read-only root, /sys/kernel/btf read-only, AppArmor unconfined, no new
/// privileges) against another container: its leaks, exactly.
#[test]
fn the_containerfile_image_traces_another_container_with_the_daemonsets_capabilities() {
    let Some(image) = image() else { return };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // Docker 20.10 knows CAP_BPF and CAP_PERFMON by no name; CAP_SYS_ADMIN
    // stands for both. Both are among those the DaemonSet adds.
    let caps = ["SYS_ADMIN", "SYS_PTRACE"];
    let manifest = std::fs::read_to_string(root.join("deploy/kubernetes/daemonset.yaml"))
        .expect("the DaemonSet");
    for cap in caps {
        assert!(
            manifest.lines().any(|l| l.trim() == format!("- {cap}")),
            "the DaemonSet adds {cap}"
        );
    }
    assert!(
        manifest.contains("hostPID: true") && manifest.contains("readOnlyRootFilesystem: true")
    );
    // The build context: the Containerfile and the binary where it takes it.
    let context =
        Removed(std::env::temp_dir().join(format!("memtrace-image-{}", std::process::id())));
    let dist = context.0.join("target/dist/amd64");
    std::fs::create_dir_all(&dist).expect("mkdir");
    std::fs::copy(root.join("Containerfile"), context.0.join("Containerfile")).expect("copy");
    std::fs::copy(root.join(".dockerignore"), context.0.join(".dockerignore")).expect("copy");
    std::fs::copy(MEMTRACE, dist.join("memtrace")).expect("copy");
    let tag = format!("memtrace-test/agent:{}", std::process::id());
    let _image = OnDrop::docker(&["rmi", "-f", &tag]);
    let agent = format!("memtrace-test-agent-{}", std::process::id());
    let _agent = OnDrop::docker(&["rm", "-f", &agent]);
    let base = format!("BASE={image}");
    let context_s = context.0.to_string_lossy().to_string();
    let containerfile = context
        .0
        .join("Containerfile")
        .to_string_lossy()
        .to_string();
    docker(&[
        "build",
        "-q",
        "--network",
        "none",
        "-f",
        &containerfile,
        "--build-arg",
        &base,
        "-t",
        &tag,
        &context_s,
    ]);
    let mut target = leak_sites(&image, &[]);
    let prefix = target.prefix().to_string();
    let mut args = vec![
        "run",
        "--rm",
        "--name",
        &agent,
        "--pid",
        "host",
        "--network",
        "none",
        "--user",
        "0",
        "--read-only",
        "--cap-drop",
        "ALL",
    ];
    for cap in caps {
        args.extend_from_slice(&["--cap-add", cap]);
    }
    args.extend_from_slice(&[
        "--security-opt",
        "apparmor=unconfined",
        "--security-opt",
        "no-new-privileges",
        "-v",
        "/sys/kernel/btf:/sys/kernel/btf:ro",
    ]);
    // The container's name comes from Docker's state through /proc/1/root,
    // the host's root (hostPID); where the host's pid 1 does not let even
    // root read it (this sandbox's), through the state mounted as docs/src/containers.md
    // says.
    if std::fs::read_dir("/proc/1/root").is_err() {
        args.extend_from_slice(&[
            "-v",
            "/var/lib/docker/containers:/host/var/lib/docker/containers:ro",
            "-e",
            "MEMTRACE_HOST_ROOT=/host",
        ]);
    }
    args.extend_from_slice(&[&tag, "--container", &prefix]);
    args.extend_from_slice(JSON_REPORT);
    let mut command = Command::new("docker");
    command.args(&args);
    let tracer = Tracer::attach_command(command);
    target.main.go();
    // The client passes the signal on to memtrace in its container.
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    assert_leaks(&report, 1, &stderr);
    assert_placement(&report, &target);
}

/// The heap walk on the test image's own glibc (trixie's 2.41): a program
/// in a container leaks before memtrace attaches by its host pid; the
/// check finds those blocks as on the host's glibc.
#[test]
fn the_heap_walk_judges_a_containers_blocks_from_before_the_attach_on_its_own_glibc() {
    let Some(image) = image() else { return };
    let mut container = Container::run(&image, &[], &["/fixtures/leak_before_attach"]);
    let pid = container.host_pid.to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--leak-check", "--format", "json"]);
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report_last_line();
    assert_eq!(
        report["leak_check"]["ran"], true,
        "{}\n{stderr}",
        report["leak_check"]
    );
    // The image has no libc6-dbg: main_arena is found by its empty bins.
    crate::leak::assert_walked_before_attach(&report, "2.41", "empty bins");
    // Read from a snapshot: the clone injected into the container's
    // process (its seccomp profile, its namespaces) and reaped there.
    assert_eq!(
        report["leak_check"]["mode"], "snapshot",
        "{}",
        report["leak_check"]
    );
    let children = std::fs::read_to_string(format!(
        "/proc/{}/task/{}/children",
        container.host_pid, container.host_pid
    ))
    .unwrap_or_default();
    assert!(children.trim().is_empty(), "left a child: {children}");
    container.main.go();
}
