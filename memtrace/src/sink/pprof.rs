//! pprof sink: the final report as a gzipped `profile.proto` for
//! `go tool pprof` and friends, with `inuse_space`/bytes and
//! `inuse_objects`/count per site. Each site's root is an `[allocator memory]`
//! pseudo-frame and its sample carries `allocator`/`memory` labels (for
//! `-tagfocus`). With `--sample-rate N` the values are the estimates (the
//! sample times N, as the JSON report's `estimated_*`), `period` is N and a
//! comment says so. The messages are declared here with prost (no protoc at build time).

use std::collections::HashMap;
use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use flate2::write::GzEncoder;
use flate2::Compression;
use prost::Message;

use super::{frame_name, sample_rate, scaling_note, site_live, Sink};
use crate::report::{Frame, Report, Site};

pub struct PprofSink;

impl Sink for PprofSink {
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        if interim {
            return Ok(());
        }
        let bytes = profile(report).encode_to_vec();
        let mut gz = GzEncoder::new(out, Compression::default());
        gz.write_all(&bytes)?;
        gz.finish()?;
        Ok(())
    }
}

/// The messages of pprof's `profile.proto` that memtrace writes, with the
/// upstream field numbers.
pub(crate) mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "7")]
        pub drop_frames: i64,
        #[prost(int64, tag = "8")]
        pub keep_frames: i64,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        /// Leaf first.
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
        #[prost(int64, tag = "3")]
        pub num: i64,
        #[prost(int64, tag = "4")]
        pub num_unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(int64, tag = "6")]
        pub build_id: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
        #[prost(bool, tag = "10")]
        pub has_inline_frames: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
        #[prost(bool, tag = "5")]
        pub is_folded: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
        #[prost(int64, tag = "5")]
        pub start_line: i64,
    }
}

/// Builds the profile tables, interning strings, functions, locations and
/// mappings (ids start at 1; 0 means none).
#[derive(Default)]
struct Builder {
    profile: proto::Profile,
    strings: HashMap<String, i64>,
    functions: HashMap<(String, String), u64>,
    /// By (mapping, address, function, line): Python frames have no
    /// address, so their line tells them apart.
    locations: HashMap<(u64, u64, u64, i64), u64>,
    mappings: HashMap<String, u64>,
}

impl Builder {
    fn new() -> Self {
        let mut builder = Builder::default();
        builder.string("");
        builder
    }

    fn string(&mut self, text: &str) -> i64 {
        if let Some(&index) = self.strings.get(text) {
            return index;
        }
        let index = self.profile.string_table.len() as i64;
        self.profile.string_table.push(text.to_string());
        self.strings.insert(text.to_string(), index);
        index
    }

    fn function(&mut self, name: &str, file: &str) -> u64 {
        let key = (name.to_string(), file.to_string());
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.profile.function.len() as u64 + 1;
        let name = self.string(name);
        let filename = self.string(file);
        self.profile.function.push(proto::Function {
            id,
            name,
            system_name: name,
            filename,
            start_line: 0,
        });
        self.functions.insert(key, id);
        id
    }

    /// One mapping per module; its range grows to cover every frame seen in it.
    fn mapping(&mut self, module: &str, addr: u64, offset: Option<u64>) -> u64 {
        let start = offset.map_or(addr, |o| addr.saturating_sub(o));
        let limit = addr.saturating_add(1);
        if let Some(&id) = self.mappings.get(module) {
            if let Some(m) = self.profile.mapping.iter_mut().find(|m| m.id == id) {
                m.memory_start = m.memory_start.min(start);
                m.memory_limit = m.memory_limit.max(limit);
            }
            return id;
        }
        let id = self.profile.mapping.len() as u64 + 1;
        let filename = self.string(module);
        self.profile.mapping.push(proto::Mapping {
            id,
            memory_start: start,
            memory_limit: limit,
            file_offset: 0,
            filename,
            build_id: 0,
            // Frames arrive symbolized: pprof must not look them up again.
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: false,
        });
        self.mappings.insert(module.to_string(), id);
        id
    }

    fn location(&mut self, mapping_id: u64, address: u64, function_id: u64, line: i64) -> u64 {
        let key = (mapping_id, address, function_id, line);
        if let Some(&id) = self.locations.get(&key) {
            return id;
        }
        let id = self.profile.location.len() as u64 + 1;
        self.profile.location.push(proto::Location {
            id,
            mapping_id,
            address,
            line: vec![proto::Line { function_id, line }],
            is_folded: false,
        });
        self.locations.insert(key, id);
        id
    }

    fn frame(&mut self, frame: &Frame) -> u64 {
        let address = parse_hex(&frame.addr).unwrap_or(0);
        let offset = frame.offset.as_deref().and_then(parse_hex);
        let mapping_id = match &frame.module {
            Some(module) => self.mapping(module, address, offset),
            None => 0,
        };
        // A Python function is its qualified name; its line is the location's.
        let name = match frame.kind {
            crate::report::FrameKind::Python => frame.symbol.clone().unwrap_or_default(),
            crate::report::FrameKind::Native => frame_name(frame),
        };
        let function_id = self.function(&name, frame.file.as_deref().unwrap_or(""));
        self.location(
            mapping_id,
            address,
            function_id,
            i64::from(frame.line.unwrap_or(0)),
        )
    }

    /// A location for a frame memtrace made up (allocator, missing stack).
    fn pseudo(&mut self, name: &str) -> u64 {
        let function_id = self.function(name, "");
        self.location(0, 0, function_id, 0)
    }

    /// Leaf first: the frames, then the allocator as the root, so that
    /// `-top` shows the allocating functions and the graph splits by
    /// allocator first.
    /// `bytes` and `count` are the site's figures as the profile shows them
    /// (scaled when sampled, see [`super::site_live`]).
    fn sample(&mut self, site: &Site, bytes: u64, count: u64, leak: bool) {
        let mut location_id = Vec::with_capacity(site.frames.len() + 2);
        for frame in &site.frames {
            location_id.push(self.frame(frame));
        }
        if site.frames.is_empty() {
            location_id.push(self.pseudo("[no stack]"));
        }
        location_id.push(self.pseudo(&format!(
            "[{} {}]",
            site.allocator.name(),
            site.memory.name()
        )));
        let label = vec![
            self.label("allocator", site.allocator.name()),
            self.label("memory", site.memory.name()),
        ];
        let mut value = vec![saturate(bytes), saturate(count)];
        if leak {
            // The leak check's split, as sample types of their own.
            let split = site.leak_check.unwrap_or_default();
            value.extend(
                [
                    split.definitely_lost,
                    split.indirectly_lost,
                    split.possibly_lost,
                    split.still_reachable,
                ]
                .map(|amount| saturate(amount.bytes)),
            );
        }
        self.profile.sample.push(proto::Sample {
            location_id,
            value,
            label,
        });
    }

    fn label(&mut self, key: &str, value: &str) -> proto::Label {
        proto::Label {
            key: self.string(key),
            str: self.string(value),
            num: 0,
            num_unit: 0,
        }
    }

    fn value_type(&mut self, kind: &str, unit: &str) -> proto::ValueType {
        proto::ValueType {
            r#type: self.string(kind),
            unit: self.string(unit),
        }
    }
}

/// The profile of one report.
pub(crate) fn profile(report: &Report) -> proto::Profile {
    let mut b = Builder::new();
    let space = b.value_type("inuse_space", "bytes");
    let objects = b.value_type("inuse_objects", "count");
    b.profile.default_sample_type = space.r#type;
    b.profile.sample_type = vec![space.clone(), objects];
    let leak = report.leak_check.as_ref().is_some_and(|check| check.ran);
    if leak {
        for kind in [
            "definitely_lost_space",
            "indirectly_lost_space",
            "possibly_lost_space",
            "still_reachable_space",
        ] {
            let value_type = b.value_type(kind, "bytes");
            b.profile.sample_type.push(value_type);
        }
    }
    b.profile.period_type = Some(space);
    // The sampling period, for the record: the values are already scaled by
    // it (pprof does not scale them itself).
    b.profile.period = saturate(sample_rate(report));
    // pprof takes the first mapping for the main binary: the target's executable.
    if let Some(frame) = report
        .sites
        .iter()
        .flat_map(|site| site.frames.iter())
        .find(|frame| frame.module.as_deref() == Some(report.target.exe.as_str()))
    {
        let addr = parse_hex(&frame.addr).unwrap_or(0);
        let offset = frame.offset.as_deref().and_then(parse_hex);
        b.mapping(&report.target.exe, addr, offset);
    }
    for site in &report.sites {
        let (bytes, count) = site_live(report, site);
        b.sample(site, bytes, count, leak);
    }
    let comment = format!(
        "memtrace: live allocations of pid {} ({}) {}{}",
        report.target.pid,
        report.target.comm,
        report.target.exe,
        report.target.placement.describe()
    );
    let mut comments = vec![b.string(&comment)];
    if let Some(note) = scaling_note(report) {
        comments.push(b.string(&note));
    }
    if !report.complete {
        comments.push(b.string("incomplete: events were lost"));
    }
    b.profile.comment = comments;
    let duration_nanos = saturate(report.duration_ms.saturating_mul(1_000_000));
    b.profile.duration_nanos = duration_nanos;
    b.profile.time_nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .saturating_sub(duration_nanos);
    b.profile
}

fn parse_hex(text: &str) -> Option<u64> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))?;
    u64::from_str_radix(digits, 16).ok()
}

fn saturate(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;
    use crate::sink::fixture;

    fn decode(report: &Report) -> proto::Profile {
        let mut out = Vec::new();
        PprofSink.write(report, false, &mut out).expect("writes");
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(out.as_slice())
            .read_to_end(&mut raw)
            .expect("gunzips");
        proto::Profile::decode(raw.as_slice()).expect("decodes")
    }

    fn function_names(p: &proto::Profile, sample: &proto::Sample) -> Vec<String> {
        sample
            .location_id
            .iter()
            .map(|id| {
                let location = &p.location[(*id - 1) as usize];
                assert_eq!(location.id, *id);
                let function = &p.function[(location.line[0].function_id - 1) as usize];
                p.string_table[function.name as usize].clone()
            })
            .collect()
    }

    #[test]
    fn a_leak_check_adds_a_sample_type_per_category() {
        let report = fixture::checked_report();
        let p = decode(&report);
        let s = |i: i64| p.string_table[i as usize].as_str();
        let types: Vec<&str> = p.sample_type.iter().map(|t| s(t.r#type)).collect();
        assert_eq!(
            types,
            [
                "inuse_space",
                "inuse_objects",
                "definitely_lost_space",
                "indirectly_lost_space",
                "possibly_lost_space",
                "still_reachable_space"
            ]
        );
        assert_eq!(p.sample[0].value[5], 4096);
        assert_eq!(p.sample[1].value[2], 300);
    }

    #[test]
    fn pprof_has_the_sample_types_and_values() {
        let report = fixture::report();
        let p = decode(&report);
        let s = |i: i64| p.string_table[i as usize].as_str();
        assert_eq!(s(0), "");
        let types: Vec<(&str, &str)> = p
            .sample_type
            .iter()
            .map(|t| (s(t.r#type), s(t.unit)))
            .collect();
        assert_eq!(
            types,
            [("inuse_space", "bytes"), ("inuse_objects", "count")]
        );
        assert_eq!(s(p.default_sample_type), "inuse_space");
        assert_eq!(p.sample.len(), report.sites.len());
        for (sample, site) in p.sample.iter().zip(&report.sites) {
            assert_eq!(
                sample.value,
                [site.live_bytes as i64, site.live_count as i64]
            );
        }
        assert_eq!(p.duration_nanos, 2_500_000_000);
    }

    #[test]
    fn pprof_functions_are_named_from_frames() {
        let p = decode(&fixture::report());
        assert_eq!(
            function_names(&p, &p.sample[0]),
            ["alloc_buffers", "main", "[cuda device]"]
        );
        assert_eq!(
            function_names(&p, &p.sample[1]),
            ["app+0x100", "main", "[libc host]"]
        );
        assert_eq!(
            function_names(&p, &p.sample[2]),
            ["[no stack]", "[libc host]"]
        );
        // One mapping for the one module, covering its frames.
        assert_eq!(p.mapping.len(), 1);
        let mapping = &p.mapping[0];
        assert_eq!(
            p.string_table[mapping.filename as usize],
            "/opt/app/bin/app"
        );
        assert_eq!(mapping.memory_start, 0x5000);
        assert!(mapping.memory_limit > 0x5700);
        // Source file and line travel with the frame.
        let alloc = p
            .function
            .iter()
            .find(|f| p.string_table[f.name as usize] == "alloc_buffers")
            .expect("alloc_buffers");
        assert_eq!(p.string_table[alloc.filename as usize], "app.c");
        let location = p
            .location
            .iter()
            .find(|l| l.line[0].function_id == alloc.id)
            .expect("its location");
        assert_eq!((location.address, location.line[0].line), (0x5600, 42));
        // The "main" function is shared by both stacks: same name and file.
        let mains = p
            .function
            .iter()
            .filter(|f| p.string_table[f.name as usize] == "main")
            .count();
        assert_eq!(mains, 1);
    }

    #[test]
    fn pprof_values_of_a_sampled_report_are_the_estimates() {
        let mut report = fixture::report();
        report.settings.sample_rate = 4;
        for site in &mut report.sites {
            site.estimated_live_bytes = Some(site.live_bytes * 4);
            site.estimated_live_count = Some(site.live_count * 4);
        }
        // A site without estimates (an older report) is scaled all the same.
        report.sites[2].estimated_live_bytes = None;
        report.sites[2].estimated_live_count = None;
        let p = decode(&report);
        let values: Vec<Vec<i64>> = p.sample.iter().map(|s| s.value.clone()).collect();
        assert_eq!(values, [[4096 * 4, 4], [300 * 4, 3 * 4], [50 * 4, 4]]);
        assert_eq!(p.period, 4);
        let comments: Vec<&str> = p
            .comment
            .iter()
            .map(|&i| p.string_table[i as usize].as_str())
            .collect();
        assert!(
            comments
                .iter()
                .any(|c| c.contains("one allocation in 4") && c.contains("scaled by 4")),
            "{comments:?}"
        );
        // Unsampled: as traced, and no such comment.
        let p = decode(&fixture::report());
        assert_eq!(p.period, 1);
        assert_eq!(p.sample[1].value, [300, 3]);
        assert!(p
            .comment
            .iter()
            .all(|&i| !p.string_table[i as usize].contains("scaled")));
    }

    #[test]
    fn pprof_skips_interim_reports() {
        let mut out = Vec::new();
        PprofSink
            .write(&fixture::report(), true, &mut out)
            .expect("writes");
        assert!(out.is_empty());
    }
}
