//! GPU memory sources, each optional and found at run time:
//!
//! * NVML (`libnvidia-ml.so.1`, loaded with dlopen by `nvml-wrapper`): used
//!   and total memory per device, used memory per process.
//! * DRM sysfs: `SYSFS/class/drm/cardN/device/mem_info_<region>_{used,total}`
//!   (amdgpu's `vram`/`gtt`/`vis_vram`, and vendors' other names such as `xtt`).
//! * DRM fdinfo: `drm-memory-*`, `drm-total-*`, `drm-resident-*` keys in
//!   `/proc/PID/fdinfo/*`, summed per region over distinct DRM clients.
//! * A vendor command (`--gpu-cmd 'mx-smi --show-memory'`): `key: value [unit]`
//!   and `key=value[unit]` fields whose key mentions used/total/free/usage/capacity,
//!   and the box-drawn table of `npu-smi info` (`npuN.hbm_used`, `npuN.hbm_total`).
//!
//! A source that fails mid-run yields an error string that becomes a gap note.

use std::collections::HashSet;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::monitor::units::unit_multiplier;

/// Reads every `mem_info_*_{used,total}` file of every DRM card.
/// Metrics are named `cardN.<region>_<used|total>`, in bytes.
pub fn read_drm_sysfs(sysfs_root: &Path) -> std::io::Result<Vec<(String, f64)>> {
    let drm = sysfs_root.join("class").join("drm");
    let mut cards: Vec<(u32, PathBuf)> = fs::read_dir(&drm)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let n: u32 = name.strip_prefix("card")?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    cards.sort();
    let mut out = Vec::new();
    for (n, path) in cards {
        let Ok(entries) = fs::read_dir(path.join("device")) else {
            continue;
        };
        let mut files: Vec<(String, PathBuf)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_string();
                let region = name.strip_prefix("mem_info_")?;
                (region.ends_with("_used") || region.ends_with("_total"))
                    .then(|| (region.to_string(), e.path()))
            })
            .collect();
        files.sort();
        for (region, file) in files {
            if let Some(v) = fs::read_to_string(&file)
                .ok()
                .and_then(|t| t.trim().parse::<f64>().ok())
            {
                out.push((format!("card{n}.{region}"), v));
            }
        }
    }
    Ok(out)
}

/// Parses one fdinfo file: the client key (pdev + client id) and the memory
/// figures it reports, named `drm.<region>`, `drm.total-<region>`, ...
pub fn parse_fdinfo(text: &str) -> Option<(String, Vec<(String, f64)>)> {
    let mut client = None;
    let mut pdev = String::new();
    let mut mem = Vec::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let key = key.trim();
        if key == "drm-client-id" {
            client = Some(value.trim().to_string());
        } else if key == "drm-pdev" {
            pdev = value.trim().to_string();
        } else if let Some(region) = key.strip_prefix("drm-memory-") {
            if let Some(v) = parse_value_unit(value) {
                mem.push((format!("drm.{region}"), v));
            }
        } else {
            for kind in ["total", "resident", "shared"] {
                if let Some(region) = key.strip_prefix(&format!("drm-{kind}-")) {
                    if let Some(v) = parse_value_unit(value) {
                        mem.push((format!("drm.{kind}-{region}"), v));
                    }
                }
            }
        }
    }
    let client = client?;
    Some((format!("{pdev}/{client}"), mem))
}

/// `1234 KiB` / `12MiB` / `4096` -> bytes; `None` unless a finite number.
pub fn parse_value_unit(text: &str) -> Option<f64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (num, rest) = text.split_at(split);
    let v: f64 = num.parse().ok()?;
    let unit = rest.split_whitespace().next().unwrap_or("");
    Some(v * unit_multiplier(unit)?).filter(|v| v.is_finite())
}

/// Sums DRM fdinfo memory of one process over its distinct DRM clients.
pub fn read_process_fdinfo(proc_root: &Path, pid: u32) -> Vec<(String, f64)> {
    let dir = proc_root.join(pid.to_string()).join("fdinfo");
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut seen = HashSet::new();
    let mut sums: Vec<(String, f64)> = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let Ok(text) = fs::read_to_string(entry.path()) else {
            continue;
        };
        let Some((client, mem)) = parse_fdinfo(&text) else {
            continue;
        };
        if !seen.insert(client) {
            continue;
        }
        for (name, v) in mem {
            match sums.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 += v,
                None => sums.push((name, v)),
            }
        }
    }
    sums.sort_by(|a, b| a.0.cmp(&b.0));
    sums
}

/// Normalized key and the unit named in it (`HBM Used(MB)`); `None` for
/// percentages and other units that are not sizes.
fn normalize_key(key: &str) -> Option<(String, Option<f64>)> {
    let mut unit = None;
    let mut base = key.to_string();
    if let (Some(open), Some(close)) = (key.rfind('('), key.rfind(')')) {
        if open < close {
            unit = Some(unit_multiplier(&key[open + 1..close])?);
            base = format!("{}{}", &key[..open], &key[close + 1..]);
        }
    }
    let mut out = String::new();
    for c in base.trim().chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('_') && !out.is_empty() {
            out.push('_');
        }
    }
    Some((out.trim_end_matches('_').to_string(), unit))
}

fn device_header(line: &str) -> Option<String> {
    let lower = line
        .trim()
        .trim_start_matches('|')
        .trim()
        .to_ascii_lowercase();
    for word in ["gpu", "npu", "device", "card"] {
        if let Some(rest) = lower.strip_prefix(word) {
            let rest = rest.trim_start_matches([' ', '#', ':']);
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            let after = &rest[digits.len()..];
            if !digits.is_empty() && (after.is_empty() || after.starts_with([' ', ':', '\t'])) {
                // "GPU 0 : 123" is a value, not a header.
                if after.trim_start().starts_with(':')
                    && after.trim_start()[1..].trim().parse::<f64>().is_ok()
                {
                    return None;
                }
                return Some(format!("{word}{digits}"));
            }
        }
    }
    None
}

fn wanted_key(key: &str) -> bool {
    ["used", "total", "free", "usage", "capacity"]
        .iter()
        .any(|w| key.contains(w))
}

/// Adds `(name, v)`, suffixing `#1`, `#2`... to a name already present;
/// drops a figure too large to be one.
fn push_unique(out: &mut Vec<(String, f64)>, name: String, v: f64) {
    if !v.is_finite() {
        return;
    }
    let mut unique = name.clone();
    let mut n = 1;
    while out.iter().any(|(k, _)| *k == unique) {
        unique = format!("{name}#{n}");
        n += 1;
    }
    out.push((unique, v));
}

/// The cells of a box-drawn table row (`| a | b |`), trimmed; `None` for
/// other lines.
fn table_cells(line: &str) -> Option<Vec<&str>> {
    let inner = line.trim().strip_prefix('|')?;
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let cells: Vec<&str> = inner.split('|').map(str::trim).collect();
    (cells.len() >= 3).then_some(cells)
}

fn is_number(token: &str) -> bool {
    !token.is_empty() && token.chars().all(|c| c.is_ascii_digit())
}

/// The device table of `npu-smi info`: two header rows name the columns of
/// the NPU row and of the chip rows under it, e.g.
///
/// ```text
/// | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
/// | Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
/// +===========================+===============+====================================================+
/// | 0     910B3               | OK            | 93.0        42                0    / 0             |
/// | 0                         | 0000:C1:00.0  | 0           0    / 0          3410 / 65536         |
/// ```
///
/// A `used / total` column whose header names a size unit yields
/// `npuN.<name>_used` and `npuN.<name>_total` (`hbm`, `memory`; chips other
/// than 0 add `.chipC`); a total of 0 means the NPU has no such memory.
/// Any other table (the process table) ends it.
#[derive(Default)]
struct NpuTable {
    /// Column names of the NPU row and of the chip rows (from the third cell on).
    columns: Option<[Vec<String>; 2]>,
    /// The NPU id of the last NPU row.
    npu: Option<String>,
}

impl NpuTable {
    /// Takes a line of the table (true) or leaves it to the key/value parser.
    fn feed(&mut self, line: &str, out: &mut Vec<(String, f64)>) -> bool {
        let trimmed = line.trim();
        if trimmed.starts_with('+') && trimmed.chars().all(|c| "+-=".contains(c)) {
            // A rule between rows: `+----+====+`.
            return true;
        }
        let Some(cells) = table_cells(line) else {
            self.columns = None;
            return false;
        };
        let first: Vec<&str> = cells[0].split_whitespace().collect();
        match first.as_slice() {
            ["NPU", "Name", ..] => {
                let names = cells[2..].iter().flat_map(|c| c.split_whitespace());
                self.columns = Some([names.map(str::to_string).collect(), Vec::new()]);
                self.npu = None;
                return true;
            }
            ["Chip", ..] => {
                if let Some(columns) = &mut self.columns {
                    let names = cells[2..].iter().flat_map(|c| c.split_whitespace());
                    columns[1] = names.map(str::to_string).collect();
                    return true;
                }
                return false;
            }
            _ => {}
        }
        let Some(columns) = &self.columns else {
            return false;
        };
        let Some(id) = first.first().copied().filter(|t| is_number(t)) else {
            // Another table (`| NPU  Chip | Process id |...`) or a message.
            self.columns = None;
            self.npu = None;
            return false;
        };
        let (names, prefix) = if first.iter().all(|t| is_number(t)) {
            // A chip row: `| 0 [device] | bus id | figures |`.
            let Some(npu) = &self.npu else {
                return true;
            };
            let prefix = if id == "0" {
                format!("npu{npu}.")
            } else {
                format!("npu{npu}.chip{id}.")
            };
            (&columns[1], prefix)
        } else {
            // An NPU row: `| 0  910B3 | health | figures |`.
            self.npu = Some(id.to_string());
            (&columns[0], format!("npu{id}."))
        };
        let text = cells[2..].join(" ").replace('/', " / ");
        let tokens: Vec<&str> = text.split_whitespace().collect();
        let mut values: Vec<(&str, Option<&str>)> = Vec::new();
        let mut i = 0;
        while i < tokens.len() {
            if tokens.get(i + 1) == Some(&"/") {
                if let Some(total) = tokens.get(i + 2) {
                    values.push((tokens[i], Some(*total)));
                    i += 3;
                    continue;
                }
            }
            values.push((tokens[i], None));
            i += 1;
        }
        if values.len() != names.len() {
            // Not laid out as the header says: nothing is certain.
            return true;
        }
        for (name, (value, total)) in names.iter().zip(values) {
            let Some((key, Some(unit))) = normalize_key(name) else {
                continue;
            };
            let Some(v) = parse_value_unit(value) else {
                continue;
            };
            match total.map(parse_value_unit) {
                None => push_unique(out, format!("{prefix}{key}"), v * unit),
                Some(Some(total)) if total > 0.0 => {
                    let base = key.strip_suffix("_usage").unwrap_or(&key);
                    push_unique(out, format!("{prefix}{base}_used"), v * unit);
                    push_unique(out, format!("{prefix}{base}_total"), total * unit);
                }
                Some(_) => {}
            }
        }
        true
    }
}

/// Parses a vendor tool's output into `(metric, bytes)`. Device headers such
/// as `GPU#0`, `NPU 1`, `Device 2` prefix the following keys (`gpu0.vram_used`);
/// the table of `npu-smi info` is read by [`NpuTable`].
pub fn parse_smi_output(text: &str) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    let mut prefix = String::new();
    let mut table = NpuTable::default();
    for line in text.lines() {
        if table.feed(line, &mut out) {
            continue;
        }
        if let Some(dev) = device_header(line) {
            prefix = format!("{dev}.");
            continue;
        }
        let line = line.trim().trim_matches('|').trim();
        if line.contains('=') {
            let tokens: Vec<&str> = line
                .split(|c: char| c.is_whitespace() || c == ',' || c == ';')
                .filter(|t| !t.is_empty())
                .collect();
            for (i, tok) in tokens.iter().enumerate() {
                let Some((k, v)) = tok.split_once('=') else {
                    continue;
                };
                let Some((key, key_unit)) = normalize_key(k) else {
                    continue;
                };
                if !wanted_key(&key) {
                    continue;
                }
                let next_unit = tokens
                    .get(i + 1)
                    .filter(|t| !t.contains('=') && unit_multiplier(t).is_some())
                    .copied()
                    .unwrap_or("");
                let value = if v.chars().last().is_some_and(|c| c.is_ascii_digit()) {
                    parse_value_unit(&format!("{v} {next_unit}"))
                } else {
                    parse_value_unit(v)
                };
                if let Some(val) = value {
                    push_unique(
                        &mut out,
                        format!("{prefix}{key}"),
                        val * key_unit.unwrap_or(1.0),
                    );
                }
            }
        } else if let Some((k, v)) = line.split_once(':') {
            let Some((key, key_unit)) = normalize_key(k) else {
                continue;
            };
            if !wanted_key(&key) {
                continue;
            }
            if let Some(val) = parse_value_unit(v) {
                push_unique(
                    &mut out,
                    format!("{prefix}{key}"),
                    val * key_unit.unwrap_or(1.0),
                );
            }
        }
    }
    out
}

/// Runs `sh -c CMD` with a timeout and returns its stdout.
pub fn run_command(cmd: &str, timeout: Duration) -> Result<String, String> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run '{cmd}': {e}"))?;
    let mut stdout = child
        .stdout
        .take()
        .ok_or_else(|| format!("'{cmd}': no stdout"))?;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("'{cmd}' timed out after {timeout:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("'{cmd}': {e}")),
        }
    };
    let text = reader
        .join()
        .map_err(|_| format!("'{cmd}': output reader failed"))?;
    if !status.success() {
        return Err(format!("'{cmd}' failed ({status})"));
    }
    Ok(text)
}

/// NVML, when the library loads.
pub struct NvmlSource {
    nvml: nvml_wrapper::Nvml,
}

impl NvmlSource {
    /// Loads NVML; the error says why it is not available.
    pub fn open() -> Result<NvmlSource, String> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| NvmlSource { nvml })
            .map_err(|e| e.to_string())
    }

    /// `nvmlN.used`, `nvmlN.total` per device.
    pub fn devices(&self) -> Result<Vec<(String, f64)>, String> {
        let count = self.nvml.device_count().map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        for i in 0..count {
            let dev = self.nvml.device_by_index(i).map_err(|e| e.to_string())?;
            let info = dev.memory_info().map_err(|e| e.to_string())?;
            out.push((format!("nvml{i}.used"), info.used as f64));
            out.push((format!("nvml{i}.total"), info.total as f64));
        }
        Ok(out)
    }

    /// Used memory of `pid` summed over devices (compute and graphics).
    pub fn process_used(&self, pid: u32) -> Result<Option<f64>, String> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let count = self.nvml.device_count().map_err(|e| e.to_string())?;
        let mut total = None;
        for i in 0..count {
            let dev = self.nvml.device_by_index(i).map_err(|e| e.to_string())?;
            let mut procs = dev.running_compute_processes().unwrap_or_default();
            procs.extend(dev.running_graphics_processes().unwrap_or_default());
            for p in procs.iter().filter(|p| p.pid == pid) {
                if let UsedGpuMemory::Used(b) = p.used_gpu_memory {
                    *total.get_or_insert(0.0) += b as f64;
                }
            }
        }
        Ok(total)
    }
}

/// All GPU sources found at start-up.
pub struct GpuSources {
    nvml: Option<NvmlSource>,
    sysfs_root: Option<PathBuf>,
    command: Option<String>,
    command_timeout: Duration,
}

impl GpuSources {
    /// Probes the sources; also returns one line per source for the record.
    pub fn probe(
        sysfs_root: &Path,
        command: Option<&str>,
        use_nvml: bool,
        command_timeout: Duration,
    ) -> (GpuSources, Vec<String>) {
        let mut lines = Vec::new();
        let nvml = if use_nvml {
            match NvmlSource::open() {
                Ok(n) => {
                    lines.push("gpu: nvml".to_string());
                    Some(n)
                }
                Err(e) => {
                    lines.push(format!("gpu: nvml unavailable ({e})"));
                    None
                }
            }
        } else {
            None
        };
        let sysfs = match read_drm_sysfs(sysfs_root) {
            Ok(m) if !m.is_empty() => {
                lines.push(format!(
                    "gpu: drm sysfs {} ({} figures)",
                    sysfs_root.display(),
                    m.len()
                ));
                Some(sysfs_root.to_path_buf())
            }
            _ => {
                lines.push("gpu: no drm sysfs memory figures".to_string());
                None
            }
        };
        if let Some(cmd) = command {
            lines.push(format!("gpu: command '{cmd}'"));
        }
        (
            GpuSources {
                nvml,
                sysfs_root: sysfs,
                command: command.map(str::to_string),
                command_timeout,
            },
            lines,
        )
    }

    /// Device-level figures and the errors of sources that failed.
    pub fn sample_devices(&self) -> (Vec<(String, f64)>, Vec<String>) {
        let mut out = Vec::new();
        let mut errors = Vec::new();
        if let Some(nvml) = &self.nvml {
            match nvml.devices() {
                Ok(m) => out.extend(m),
                Err(e) => errors.push(format!("nvml: {e}")),
            }
        }
        if let Some(root) = &self.sysfs_root {
            match read_drm_sysfs(root) {
                Ok(m) => out.extend(m),
                Err(e) => errors.push(format!("drm sysfs: {e}")),
            }
        }
        if let Some(cmd) = &self.command {
            match run_command(cmd, self.command_timeout) {
                Ok(text) => {
                    let parsed = parse_smi_output(&text);
                    if parsed.is_empty() {
                        errors.push(format!("'{cmd}' printed no memory figures"));
                    }
                    out.extend(parsed.into_iter().map(|(k, v)| (format!("smi.{k}"), v)));
                }
                Err(e) => errors.push(e),
            }
        }
        (out, errors)
    }

    /// Per-process figures (fdinfo, NVML).
    pub fn sample_process(&self, proc_root: &Path, pid: u32) -> Vec<(String, f64)> {
        let mut out = read_process_fdinfo(proc_root, pid);
        if let Some(nvml) = &self.nvml {
            if let Ok(Some(v)) = nvml.process_used(pid) {
                out.push(("nvml.used".to_string(), v));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::testutil::TempDir;

    const FDINFO: &str = "pos:\t0\nflags:\t02100002\nmnt_id:\t26\nino:\t1067\ndrm-driver:\tamdgpu\ndrm-pdev:\t0000:03:00.0\ndrm-client-id:\t17\ndrm-pasid:\t32770\ndrm-memory-vram:\t262144 KiB\ndrm-memory-gtt:\t2048 KiB\ndrm-memory-cpu:\t0 KiB\namd-memory-visible-vram:\t0 KiB\ndrm-engine-gfx:\t1202446 ns\n";

    #[test]
    fn fdinfo_memory_is_parsed_in_bytes() {
        let (client, mem) = parse_fdinfo(FDINFO).expect("drm client");
        assert_eq!(client, "0000:03:00.0/17");
        assert_eq!(
            mem,
            vec![
                ("drm.vram".to_string(), 262144.0 * 1024.0),
                ("drm.gtt".to_string(), 2048.0 * 1024.0),
                ("drm.cpu".to_string(), 0.0),
            ]
        );
        let newer = "drm-driver:\ti915\ndrm-client-id:\t3\ndrm-total-system0:\t12 MiB\ndrm-resident-system0:\t8 MiB\n";
        let (_, mem) = parse_fdinfo(newer).expect("client");
        assert_eq!(mem[0], ("drm.total-system0".to_string(), 12.0 * 1048576.0));
        assert_eq!(parse_fdinfo("pos:\t0\nflags:\t0\n"), None);
    }

    #[test]
    fn fdinfo_clients_are_counted_once() {
        let dir = TempDir::new();
        let fdinfo = dir.path().join("7").join("fdinfo");
        fs::create_dir_all(&fdinfo).expect("mkdir");
        fs::write(fdinfo.join("3"), FDINFO).expect("write");
        fs::write(fdinfo.join("4"), FDINFO).expect("write"); // dup of the same client
        fs::write(
            fdinfo.join("5"),
            FDINFO.replace("drm-client-id:\t17", "drm-client-id:\t18"),
        )
        .expect("write");
        fs::write(fdinfo.join("6"), "pos:\t0\n").expect("write");
        let sums = read_process_fdinfo(dir.path(), 7);
        let vram = sums.iter().find(|(k, _)| k == "drm.vram").map(|(_, v)| *v);
        assert_eq!(vram, Some(2.0 * 262144.0 * 1024.0));
    }

    #[test]
    fn drm_sysfs_tree_is_read() {
        let dir = TempDir::new();
        let dev = dir.path().join("class/drm/card1/device");
        fs::create_dir_all(&dev).expect("mkdir");
        fs::create_dir_all(dir.path().join("class/drm/card1-DP-1")).expect("mkdir");
        fs::create_dir_all(dir.path().join("class/drm/renderD128")).expect("mkdir");
        fs::write(dev.join("mem_info_vram_used"), "1048576\n").expect("write");
        fs::write(dev.join("mem_info_vram_total"), "17163091968\n").expect("write");
        fs::write(dev.join("mem_info_xtt_used"), "4096\n").expect("write");
        fs::write(dev.join("mem_info_vram_vendor"), "samsung\n").expect("write");
        let m = read_drm_sysfs(dir.path()).expect("read");
        assert_eq!(
            m,
            vec![
                ("card1.vram_total".to_string(), 17163091968.0),
                ("card1.vram_used".to_string(), 1048576.0),
                ("card1.xtt_used".to_string(), 4096.0),
            ]
        );
        assert!(read_drm_sysfs(&dir.path().join("nope")).is_err());
    }

    #[test]
    fn mx_smi_memory_output_is_parsed() {
        let text = "mx-smi  version: 2.1.6\n\n=================== MetaX System Management Interface Log ===================\nTimestamp                                         : Fri Jan 10 10:00:00 2025\n\nAttached GPUs                                     : 2\nGPU#0  MXC500  0000:08:00.0\n    Memory\n        vis_vram total                            : 67108864 KB\n        vis_vram used                             : 602112 KB\n        vram total                                : 67108864 KB\n        vram used                                 : 602112 KB\n        xtt total                                 : 65831488 KB\n        xtt used                                  : 0 KB\nGPU#1  MXC500  0000:09:00.0\n    Memory\n        vram used                                 : 1024 KB\n";
        let m = parse_smi_output(text);
        let get = |k: &str| m.iter().find(|(key, _)| key == k).map(|(_, v)| *v);
        assert_eq!(get("gpu0.vram_used"), Some(602112.0 * 1024.0));
        assert_eq!(get("gpu0.xtt_used"), Some(0.0));
        assert_eq!(get("gpu0.vis_vram_total"), Some(67108864.0 * 1024.0));
        assert_eq!(get("gpu1.vram_used"), Some(1024.0 * 1024.0));
        assert_eq!(get("attached_gpus"), None);
    }

    #[test]
    fn key_value_and_npu_outputs_are_parsed() {
        let m = parse_smi_output("vram_used=123MiB vram_total=1024 MiB, temp=40C\nxtt_used=7\n");
        assert_eq!(
            m,
            vec![
                ("vram_used".to_string(), 123.0 * 1048576.0),
                ("vram_total".to_string(), 1024.0 * 1048576.0),
                ("xtt_used".to_string(), 7.0),
            ]
        );
        let npu = "NPU ID                         : 0\nNPU 0\n        HBM Capacity(MB)               : 65536\n        HBM Usage Rate(%)              : 5\n        HBM Used(MB)                   : 3393\n";
        let m = parse_smi_output(npu);
        assert_eq!(
            m,
            vec![
                ("npu0.hbm_capacity".to_string(), 65536.0 * 1048576.0),
                ("npu0.hbm_used".to_string(), 3393.0 * 1048576.0),
            ]
        );
    }

    /// `npu-smi info` on an 8 x 910B3 host (first two NPUs), with the process
    /// table that follows the device table.
    const NPU_SMI_910B: &str = "\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc1                 Version: 24.1.rc1                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.0        42                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3410 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 96.9        36                0    / 0             |
| 0                         | 0000:C2:00.0  | 42          0    / 0          52314/ 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 1       0                 | 1712733       | python3.9                | 48954                   |
+===========================+===============+====================================================+
";

    #[test]
    fn npu_smi_info_table_yields_hbm_per_npu() {
        let mb = 1048576.0;
        assert_eq!(
            parse_smi_output(NPU_SMI_910B),
            vec![
                ("npu0.hbm_used".to_string(), 3410.0 * mb),
                ("npu0.hbm_total".to_string(), 65536.0 * mb),
                ("npu1.hbm_used".to_string(), 52314.0 * mb),
                ("npu1.hbm_total".to_string(), 65536.0 * mb),
            ]
        );
    }

    #[test]
    fn npu_smi_info_table_of_a_duo_card_names_its_chips() {
        // Atlas 300I Duo (310P3): two chips under one NPU id, DDR instead of HBM.
        let text = "\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 25.0.rc1.1                               Version: 25.0.rc1.1                                   |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 8       310P3                 | OK              | NA           47                0     / 0             |
| 0       0                     | 0000:01:00.0    | 0            1475 / 44280                            |
+-------------------------------+-----------------+------------------------------------------------------+
| 8       310P3                 | OK              | NA           45                0     / 0             |
| 1       1                     | 0000:01:00.0    | 0            1462 / 43693                            |
+===============================+=================+======================================================+
";
        let mb = 1048576.0;
        assert_eq!(
            parse_smi_output(text),
            vec![
                ("npu8.memory_used".to_string(), 1475.0 * mb),
                ("npu8.memory_total".to_string(), 44280.0 * mb),
                ("npu8.chip1.memory_used".to_string(), 1462.0 * mb),
                ("npu8.chip1.memory_total".to_string(), 43693.0 * mb),
            ]
        );
    }

    #[test]
    fn npu_smi_info_rows_out_of_layout_are_skipped() {
        // A chip row before any NPU row, and one with a column missing.
        let text = "\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3410 / 65536         |
| 0     910B3               | OK            | 93.0        42                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           3410 / 65536                           |
";
        assert_eq!(parse_smi_output(text), vec![]);
    }

    #[test]
    fn figures_too_large_for_a_number_are_dropped() {
        let huge = "9".repeat(400);
        assert_eq!(parse_value_unit(&huge), None);
        assert_eq!(parse_smi_output(&format!("vram used: {huge}\n")), vec![]);
        // Finite digits, but not once multiplied by the unit of the key.
        let large = format!("9{}", "0".repeat(305));
        assert_eq!(
            parse_smi_output(&format!("HBM Used(MB): {large}\n")),
            vec![]
        );
        assert_eq!(
            parse_fdinfo(&format!("drm-client-id: 1\ndrm-memory-vram: {huge} KiB\n")),
            Some(("/1".to_string(), vec![]))
        );
    }

    #[test]
    fn failing_command_is_an_error_not_a_crash() {
        assert!(run_command("exit 3", Duration::from_secs(5)).is_err());
        assert!(run_command("sleep 5", Duration::from_millis(100)).is_err());
        assert_eq!(
            run_command("echo vram_used=1", Duration::from_secs(5)).as_deref(),
            Ok("vram_used=1\n")
        );
    }
}
