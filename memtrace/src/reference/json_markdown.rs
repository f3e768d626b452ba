//! The guide's JSON reference (`docs/src/reference/json.md`): every key of
//! the JSON documents memtrace writes, walked from the JSON schema that
//! `schemars` derives from the very types serde serializes, with their doc
//! comments as meanings.

use std::fmt::Write as _;

use serde_json::{Map, Value};

use super::cli_markdown::escape;

/// One JSON document memtrace writes: its title, where it comes from and
/// the schema of its root type.
struct Document {
    title: &'static str,
    source: &'static str,
    schema: schemars::Schema,
}

fn documents() -> Vec<Document> {
    vec![
        Document {
            title: "The report",
            source: "`--format json` (and each line of `--format json-lines`), \
                     `memtrace report FILE --format json`, `memtrace watch` \
                     episode reports",
            schema: schemars::schema_for!(crate::report::Report),
        },
        Document {
            title: "The doctor's findings",
            source: "`memtrace doctor --format json`",
            schema: schemars::schema_for!(crate::doctor::Report),
        },
    ]
}

/// The whole chapter.
pub fn render() -> String {
    let mut out = String::new();
    out.push_str("# Reference: JSON\n\n");
    out.push_str(
        "Generated from the types memtrace serializes by `memtrace generate-docs` \
         (a unit test fails when this page is stale). Keys are a contract: \
         they are added, never renamed or dropped. `a.b` is key `b` of the \
         object under `a`; `a[]` an element of the array `a`; `a.*` any key \
         of the map `a`. A key marked *optional* is left out when it has \
         nothing to say.\n\n",
    );
    for document in documents() {
        let _ = writeln!(
            out,
            "## {}\n\nWritten by {}.\n",
            document.title, document.source
        );
        out.push_str("| key | type | meaning |\n|---|---|---|\n");
        let root = document.schema.as_value();
        let defs = root
            .get("$defs")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let mut walker = Walker {
            defs: &defs,
            out: &mut out,
            trail: Vec::new(),
        };
        walker.object(root, "");
        out.push('\n');
    }
    out
}

/// Walks a schema depth first, one table row per key.
struct Walker<'a> {
    defs: &'a Map<String, Value>,
    out: &'a mut String,
    /// The definitions being expanded (a type that contains itself stops).
    trail: Vec<String>,
}

impl<'a> Walker<'a> {
    /// The keys of an object schema under `prefix`.
    fn object(&mut self, schema: &Value, prefix: &str) {
        let schema = self.resolve(schema);
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        // A tagged enum's variant: its doc comment belongs to its tag's row.
        let variant = description(schema);
        if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
            for (key, property) in properties {
                let path = format!("{prefix}{key}");
                let tag = property.get("const").is_some()
                    || property
                        .get("enum")
                        .and_then(Value::as_array)
                        .is_some_and(|values| values.len() == 1);
                let fallback = if tag { variant.clone() } else { None };
                self.key(&path, property, required.contains(&key.as_str()), fallback);
            }
        }
        // `#[serde(flatten)]` maps and tagged variants.
        for combinator in ["allOf", "anyOf", "oneOf"] {
            if let Some(parts) = schema.get(combinator).and_then(Value::as_array) {
                for part in parts {
                    if self.is_object(part) {
                        self.object(part, prefix);
                    }
                }
            }
        }
    }

    /// One key: its row, then its own keys.
    fn key(&mut self, path: &str, schema: &Value, required: bool, fallback: Option<String>) {
        let described = description(schema)
            .or_else(|| description(self.resolve(schema)))
            .or(fallback);
        let mut meaning = described.map(|d| escape(&one_line(&d))).unwrap_or_default();
        if !required {
            meaning = if meaning.is_empty() {
                "*optional*".to_string()
            } else {
                format!("*optional*. {meaning}")
            };
        }
        let _ = writeln!(
            self.out,
            "| `{path}` | {} | {} |",
            escape(&self.type_name(schema)),
            meaning
        );
        let name = reference_name(schema);
        if let Some(name) = &name {
            if self.trail.contains(name) {
                return;
            }
            self.trail.push(name.clone());
        }
        self.children(path, schema);
        if name.is_some() {
            self.trail.pop();
        }
    }

    /// The keys below `path`: an object's, an array's elements', a map's values'.
    fn children(&mut self, path: &str, schema: &Value) {
        let schema = self.resolve(schema);
        if let Some(items) = schema.get("items") {
            if self.is_object(items) || self.has_items(items) {
                self.children_of_element(&format!("{path}[]"), items);
            }
            return;
        }
        if let Some(values) = schema.get("additionalProperties") {
            if values.is_object() && (self.is_object(values) || self.has_items(values)) {
                self.children_of_element(&format!("{path}.*"), values);
            }
        }
        if self.is_object(schema) {
            self.object(schema, &format!("{path}."));
        }
        // `Option<T>`: T's keys.
        for combinator in ["anyOf", "oneOf"] {
            if let Some(parts) = schema.get(combinator).and_then(Value::as_array) {
                for part in parts.iter().filter(|p| !is_null(p)) {
                    if !self.is_object(schema) {
                        self.children(path, part);
                    }
                }
            }
        }
    }

    fn children_of_element(&mut self, path: &str, schema: &Value) {
        if self.is_object(schema) {
            self.object(schema, &format!("{path}."));
        } else {
            self.children(path, schema);
        }
    }

    fn is_object(&self, schema: &Value) -> bool {
        let schema = self.resolve(schema);
        schema.get("properties").is_some()
            || ["allOf", "anyOf", "oneOf"].iter().any(|c| {
                schema
                    .get(*c)
                    .and_then(Value::as_array)
                    .is_some_and(|parts| {
                        parts
                            .iter()
                            .any(|p| self.resolve(p).get("properties").is_some())
                    })
            })
    }

    fn has_items(&self, schema: &Value) -> bool {
        let schema = self.resolve(schema);
        schema.get("items").is_some()
            || schema
                .get("additionalProperties")
                .is_some_and(Value::is_object)
    }

    /// Follows `$ref` into the definitions.
    fn resolve<'v>(&self, schema: &'v Value) -> &'v Value
    where
        'a: 'v,
    {
        match reference_name(schema).and_then(|name| self.defs.get(&name)) {
            Some(target) => target,
            None => schema,
        }
    }

    /// `integer`, `string`, `array of Site`, `map of integer`, `one of "a", "b"`.
    fn type_name(&self, schema: &Value) -> String {
        if let Some(name) = reference_name(schema) {
            let target = self.resolve(schema);
            if target.get("properties").is_none() {
                // A named enum or newtype: say what it holds.
                let inner = self.type_name(target);
                if !inner.is_empty() && inner != "value" {
                    return inner;
                }
            }
            return format!("object ({name})");
        }
        if let Some(values) = schema.get("enum").and_then(Value::as_array) {
            let names: Vec<String> = values.iter().map(|v| format!("`{v}`")).collect();
            return format!("one of {}", names.join(", "));
        }
        if let Some(value) = schema.get("const") {
            return format!("`{value}`");
        }
        for combinator in ["anyOf", "oneOf"] {
            if let Some(parts) = schema.get(combinator).and_then(Value::as_array) {
                let mut names: Vec<String> = parts
                    .iter()
                    .filter(|p| !is_null(p))
                    .map(|p| self.type_name(p))
                    .collect();
                names.dedup();
                let nullable = parts.iter().any(is_null);
                let joined = names.join(" or ");
                return if nullable {
                    format!("{joined} or null")
                } else {
                    joined
                };
            }
        }
        let types: Vec<&str> = match schema.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let mut names = Vec::new();
        for t in types.iter().filter(|t| **t != "null") {
            names.push(match *t {
                "array" => match schema.get("items") {
                    Some(items) => format!("array of {}", self.type_name(items)),
                    None => "array".to_string(),
                },
                "object" => match schema.get("additionalProperties") {
                    Some(values) if values.is_object() => {
                        format!("map of {}", self.type_name(values))
                    }
                    _ => "object".to_string(),
                },
                other => other.to_string(),
            });
        }
        if names.is_empty() {
            return "value".to_string();
        }
        let mut text = names.join(" or ");
        if types.contains(&"null") {
            text.push_str(" or null");
        }
        text
    }
}

fn reference_name(schema: &Value) -> Option<String> {
    schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.rsplit('/').next())
        .map(str::to_string)
}

fn description(schema: &Value) -> Option<String> {
    schema
        .get("description")
        .and_then(Value::as_str)
        .map(str::to_string)
}

fn is_null(schema: &Value) -> bool {
    schema.get("type").and_then(Value::as_str) == Some("null")
}

/// A description on one table line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
