//! One OTLP profiles request (`--otlp-profiles`, experimental): a report
//! as an `ExportProfilesServiceRequest` of the OpenTelemetry profiles
//! signal, v1development (opentelemetry-proto 1.10.0, through the
//! `opentelemetry-proto` crate's prost messages).
//!
//! The profile is the pprof sink's, carried over table by table into the
//! request's shared dictionary (strings, functions, locations, mappings,
//! stacks, the samples' `allocator`/`memory` attributes; entry 0 of each
//! table is the zero value the format asks for). An OTLP profile has one
//! sample type, so each report makes two profiles over the same stacks:
//! `inuse_space`/bytes and `inuse_objects`/count. The resource says whose
//! memory it is: `service.name`, `host.name`, `process.pid` and, where
//! known, `k8s.pod.name`, `k8s.namespace.name`, `k8s.container.name`,
//! `k8s.node.name`.

use std::collections::HashMap;

use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::profiles::v1development::{
    Function, KeyValueAndUnit, Line, Link, Location, Mapping, Profile, ProfilesDictionary,
    ResourceProfiles, Sample, ScopeProfiles, Stack, ValueType,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prost::Message;

use super::request::{container_name, service_name};
use super::OtlpConfig;
use crate::report::Report;
use crate::sink::pprof;

/// The encoded request of one report, or `None` when the report has no
/// site (an empty profile is not pushed).
pub fn export_request(
    report: &Report,
    config: &OtlpConfig,
    host: Option<&str>,
    node: Option<&str>,
    id: [u8; 16],
) -> std::io::Result<Option<Vec<u8>>> {
    Ok(request(report, config, host, node, id).map(|r| r.encode_to_vec()))
}

/// The request of one report (see [`export_request`]). The profiles' ids
/// are `id` with the last byte told apart by the sample type.
pub(crate) fn request(
    report: &Report,
    config: &OtlpConfig,
    host: Option<&str>,
    node: Option<&str>,
    id: [u8; 16],
) -> Option<ExportProfilesServiceRequest> {
    if report.sites.is_empty() {
        return None;
    }
    let pprof = pprof::profile(report);
    let mut tables = Tables::new();
    let stacks: Vec<(i32, Vec<i32>)> = pprof
        .sample
        .iter()
        .map(|sample| tables.sample(&pprof, sample))
        .collect();
    let period_type = pprof
        .period_type
        .as_ref()
        .map(|t| tables.value_type(&pprof, t));
    let time_unix_nano = u64::try_from(pprof.time_nanos).unwrap_or(0);
    let duration_nano = u64::try_from(pprof.duration_nanos).unwrap_or(0);
    let profiles = pprof
        .sample_type
        .iter()
        .enumerate()
        .map(|(k, sample_type)| {
            let mut profile_id = id;
            profile_id[15] ^= u8::try_from(k).unwrap_or(u8::MAX);
            Profile {
                sample_type: Some(tables.value_type(&pprof, sample_type)),
                samples: pprof
                    .sample
                    .iter()
                    .zip(&stacks)
                    .map(|(sample, (stack_index, attributes))| Sample {
                        stack_index: *stack_index,
                        attribute_indices: attributes.clone(),
                        link_index: 0,
                        values: vec![sample.value.get(k).copied().unwrap_or(0)],
                        timestamps_unix_nano: Vec::new(),
                    })
                    .collect(),
                time_unix_nano,
                duration_nano,
                period_type,
                period: pprof.period,
                profile_id: profile_id.to_vec(),
                ..Profile::default()
            }
        })
        .collect();
    Some(ExportProfilesServiceRequest {
        resource_profiles: vec![ResourceProfiles {
            resource: Some(Resource {
                attributes: resource_attributes(report, config, host, node),
                ..Resource::default()
            }),
            scope_profiles: vec![ScopeProfiles {
                scope: Some(InstrumentationScope {
                    name: "memtrace".to_string(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    ..InstrumentationScope::default()
                }),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
        dictionary: Some(tables.dictionary),
    })
}

/// The resource's attributes: `service.name` (`--service-name`, else the
/// process's name), `host.name`, `process.pid`, and the Kubernetes names
/// where known (`k8s.node.name` from `NODE_NAME`, as the DaemonSet sets it).
pub(crate) fn resource_attributes(
    report: &Report,
    config: &OtlpConfig,
    host: Option<&str>,
    node: Option<&str>,
) -> Vec<KeyValue> {
    let placement = &report.target.placement;
    let text = |key: &str, value: Option<String>| {
        Some(KeyValue {
            key: key.to_string(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(
                    value.filter(|v| !v.is_empty())?,
                )),
            }),
            ..KeyValue::default()
        })
    };
    let pid = (report.target.pid != 0).then(|| KeyValue {
        key: "process.pid".to_string(),
        value: Some(AnyValue {
            value: Some(any_value::Value::IntValue(i64::from(report.target.pid))),
        }),
        ..KeyValue::default()
    });
    [
        text(
            "service.name",
            Some(service_name(report, config.service_name.as_deref())),
        ),
        text("host.name", host.map(str::to_string)),
        pid,
        text("k8s.pod.name", placement.pod_name.clone()),
        text("k8s.namespace.name", placement.pod_namespace.clone()),
        text("k8s.container.name", container_name(report)),
        text("k8s.node.name", node.map(str::to_string)),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The dictionary being filled, each table with its zero value first, and
/// what the pprof profile's ids became.
struct Tables {
    dictionary: ProfilesDictionary,
    strings: HashMap<String, i32>,
    functions: HashMap<u64, i32>,
    locations: HashMap<u64, i32>,
    mappings: HashMap<u64, i32>,
    stacks: HashMap<Vec<i32>, i32>,
    attributes: HashMap<(i32, String), i32>,
}

/// The index the next entry of a table gets.
fn next(len: usize) -> i32 {
    i32::try_from(len).unwrap_or(i32::MAX)
}

impl Tables {
    fn new() -> Tables {
        Tables {
            dictionary: ProfilesDictionary {
                mapping_table: vec![Mapping::default()],
                location_table: vec![Location::default()],
                function_table: vec![Function::default()],
                link_table: vec![Link::default()],
                string_table: vec![String::new()],
                attribute_table: vec![KeyValueAndUnit::default()],
                stack_table: vec![Stack::default()],
            },
            strings: HashMap::from([(String::new(), 0)]),
            functions: HashMap::new(),
            locations: HashMap::new(),
            mappings: HashMap::new(),
            stacks: HashMap::new(),
            attributes: HashMap::new(),
        }
    }

    fn string(&mut self, text: &str) -> i32 {
        if let Some(&index) = self.strings.get(text) {
            return index;
        }
        let index = next(self.dictionary.string_table.len());
        self.dictionary.string_table.push(text.to_string());
        self.strings.insert(text.to_string(), index);
        index
    }

    /// A string of the pprof profile by its index there.
    fn pprof_string(&mut self, p: &pprof::proto::Profile, index: i64) -> i32 {
        let text = usize::try_from(index)
            .ok()
            .and_then(|i| p.string_table.get(i))
            .map_or("", String::as_str);
        self.string(text)
    }

    fn value_type(&mut self, p: &pprof::proto::Profile, t: &pprof::proto::ValueType) -> ValueType {
        ValueType {
            type_strindex: self.pprof_string(p, t.r#type),
            unit_strindex: self.pprof_string(p, t.unit),
        }
    }

    fn function(&mut self, p: &pprof::proto::Profile, id: u64) -> i32 {
        if let Some(&index) = self.functions.get(&id) {
            return index;
        }
        let Some(f) = p.function.iter().find(|f| f.id == id) else {
            return 0;
        };
        let function = Function {
            name_strindex: self.pprof_string(p, f.name),
            system_name_strindex: self.pprof_string(p, f.system_name),
            filename_strindex: self.pprof_string(p, f.filename),
            start_line: f.start_line,
        };
        let index = next(self.dictionary.function_table.len());
        self.dictionary.function_table.push(function);
        self.functions.insert(id, index);
        index
    }

    fn mapping(&mut self, p: &pprof::proto::Profile, id: u64) -> i32 {
        if let Some(&index) = self.mappings.get(&id) {
            return index;
        }
        let Some(m) = p.mapping.iter().find(|m| m.id == id) else {
            return 0;
        };
        let mapping = Mapping {
            memory_start: m.memory_start,
            memory_limit: m.memory_limit,
            file_offset: m.file_offset,
            filename_strindex: self.pprof_string(p, m.filename),
            attribute_indices: Vec::new(),
        };
        let index = next(self.dictionary.mapping_table.len());
        self.dictionary.mapping_table.push(mapping);
        self.mappings.insert(id, index);
        index
    }

    fn location(&mut self, p: &pprof::proto::Profile, id: u64) -> i32 {
        if let Some(&index) = self.locations.get(&id) {
            return index;
        }
        let Some(l) = p.location.iter().find(|l| l.id == id) else {
            return 0;
        };
        let mapping_index = self.mapping(p, l.mapping_id);
        let lines = l
            .line
            .iter()
            .map(|line| Line {
                function_index: self.function(p, line.function_id),
                line: line.line,
                column: 0,
            })
            .collect();
        let location = Location {
            mapping_index,
            address: l.address,
            lines,
            attribute_indices: Vec::new(),
        };
        let index = next(self.dictionary.location_table.len());
        self.dictionary.location_table.push(location);
        self.locations.insert(id, index);
        index
    }

    fn attribute(&mut self, key: i32, value: &str) -> i32 {
        if let Some(&index) = self.attributes.get(&(key, value.to_string())) {
            return index;
        }
        let index = next(self.dictionary.attribute_table.len());
        self.dictionary.attribute_table.push(KeyValueAndUnit {
            key_strindex: key,
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(value.to_string())),
            }),
            unit_strindex: 0,
        });
        self.attributes.insert((key, value.to_string()), index);
        index
    }

    /// A pprof sample's stack (leaf first, as in pprof) and attributes.
    fn sample(
        &mut self,
        p: &pprof::proto::Profile,
        sample: &pprof::proto::Sample,
    ) -> (i32, Vec<i32>) {
        let locations: Vec<i32> = sample
            .location_id
            .iter()
            .map(|&id| self.location(p, id))
            .collect();
        let stack = match self.stacks.get(&locations) {
            Some(&index) => index,
            None => {
                let index = next(self.dictionary.stack_table.len());
                self.dictionary.stack_table.push(Stack {
                    location_indices: locations.clone(),
                });
                self.stacks.insert(locations, index);
                index
            }
        };
        let attributes = sample
            .label
            .iter()
            .map(|label| {
                let key = self.pprof_string(p, label.key);
                let value = usize::try_from(label.str)
                    .ok()
                    .and_then(|i| p.string_table.get(i))
                    .cloned()
                    .unwrap_or_default();
                self.attribute(key, &value)
            })
            .collect();
        (stack, attributes)
    }
}
