//! Pushing reports to a profile store (`--pyroscope URL`): each report, as
//! the gzipped pprof profile the pprof sink writes, is sent to Pyroscope's
//! (Grafana's) push API, `POST URL/push.v1.PusherService/Push` (Connect
//! protocol, binary protobuf), with the labels that find it there
//! (`service_name`, `host`, `pid`, `pod`, ...).
//!
//! This module owns the options ([`PushArgs`]), their checking into a
//! [`PushConfig`] (a bad URL or a credential in the wrong place is a usage
//! error before anything starts), and the [`Pusher`]: a bounded queue
//! drained by a thread of its own, so a push never blocks or slows the
//! trace; every retry, failure and drop is counted ([`PushStats`], the
//! report's `push` and `/metrics`) and a failing endpoint is warned about
//! once. The request itself is built in `request`, the messages are in
//! `proto`, the queue and the HTTP client in `worker`.
//!
//! With `--otlp-profiles URL` (experimental), each report also goes to an
//! OpenTelemetry Collector as the OTLP profiles signal (v1development):
//! `POST URL/v1development/profiles`, an `ExportProfilesServiceRequest`
//! built in `otlp`, through the same kind of [`Pusher`] (its own queue and
//! counters, the report's `otlp`).
//!
//! Credentials never come from the command line: the basic-auth password
//! is read from `MEMTRACE_PYROSCOPE_PASSWORD`, a bearer token from
//! `MEMTRACE_PYROSCOPE_TOKEN`; neither is ever printed.

mod otlp;
pub mod proto;
mod request;
mod worker;

#[cfg(test)]
mod tests;

use clap::Args;

pub use crate::report::PushStats;
pub use worker::{Policy, Pusher};

#[cfg(test)]
pub(crate) use otlp::request as otlp_request;

/// The environment variable holding the basic-auth password.
pub const PASSWORD_ENV: &str = "MEMTRACE_PYROSCOPE_PASSWORD";
/// The environment variable holding a bearer token.
pub const TOKEN_ENV: &str = "MEMTRACE_PYROSCOPE_TOKEN";
/// The path of the push API under the store's URL.
pub const PUSH_PATH: &str = "/push.v1.PusherService/Push";
/// The path of the OTLP/HTTP profiles signal under a Collector's URL.
pub const OTLP_PROFILES_PATH: &str = "/v1development/profiles";

/// Options of the push to a profile store (shared by the tracer and `watch`).
#[derive(Clone, Debug, Default, Args)]
pub struct PushArgs {
    /// Push each report (every --interval report and the final one; with
    /// `watch`, each episode's) as a memory profile to Pyroscope / Grafana
    /// Cloud Profiles at URL (http:// or https://, e.g.
    /// http://pyroscope.monitoring:4040). Pushes never hold up tracing;
    /// their outcome is counted in the report's `push` and in /metrics.
    #[arg(help_heading = "Pushing profiles", long, value_name = "URL")]
    pub pyroscope: Option<String>,

    /// Experimental: push each report (as --pyroscope does) to an
    /// OpenTelemetry Collector at URL (http:// or https://, e.g.
    /// http://otel-collector:4318) as the OTLP profiles signal
    /// (v1development, POST URL/v1development/profiles), one profile per
    /// sample type. The Collector needs an OTLP receiver and the feature
    /// gate service.profilesSupport; the signal may still change upstream.
    #[arg(help_heading = "Pushing profiles", long, value_name = "URL")]
    pub otlp_profiles: Option<String>,

    /// The profiles' `service_name` label and `service.name` resource
    /// attribute (default: the traced process's name).
    #[arg(help_heading = "Pushing profiles", long, value_name = "NAME")]
    pub service_name: Option<String>,

    /// Basic-auth user for --pyroscope (Grafana Cloud: the stack's user id);
    /// the password is read from the environment variable
    /// MEMTRACE_PYROSCOPE_PASSWORD. A bearer token instead:
    /// MEMTRACE_PYROSCOPE_TOKEN.
    #[arg(
        help_heading = "Pushing profiles",
        long,
        value_name = "USER",
        requires = "pyroscope"
    )]
    pub pyroscope_user: Option<String>,

    /// Tenant for a multi-tenant store (sent as `X-Scope-OrgID`).
    #[arg(
        help_heading = "Pushing profiles",
        long,
        value_name = "TENANT",
        requires = "pyroscope"
    )]
    pub pyroscope_tenant: Option<String>,
}

impl PushArgs {
    /// The same options as arguments of a child tracer (`watch`'s episodes;
    /// the child reads the credentials from the environment it inherits).
    pub fn as_tracer_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (flag, value) in [
            ("--pyroscope", &self.pyroscope),
            ("--otlp-profiles", &self.otlp_profiles),
            ("--service-name", &self.service_name),
            ("--pyroscope-user", &self.pyroscope_user),
            ("--pyroscope-tenant", &self.pyroscope_tenant),
        ] {
            if let Some(value) = value {
                out.push(flag.to_string());
                out.push(value.clone());
            }
        }
        out
    }
}

/// Why the push options cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("--{flag}: '{url}' is not an http:// or https:// URL with a host{why}")]
    Url {
        flag: &'static str,
        url: String,
        why: &'static str,
    },
    #[error("--{flag}: '{url}' carries credentials{instead}")]
    Credentials {
        flag: &'static str,
        url: String,
        instead: &'static str,
    },
    #[error("--service-name needs --pyroscope or --otlp-profiles")]
    NoTarget,
    #[error("--pyroscope-user needs the password in the environment variable MEMTRACE_PYROSCOPE_PASSWORD")]
    NoPassword,
    #[error("MEMTRACE_PYROSCOPE_PASSWORD is set but --pyroscope-user is not")]
    NoUser,
    #[error("both --pyroscope-user and MEMTRACE_PYROSCOPE_TOKEN are given: use one")]
    TwoAuths,
    #[error("--{flag}: '{value}' is empty or holds control characters")]
    BadValue { flag: &'static str, value: String },
}

/// How requests are authenticated. Its `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    None,
    Basic { user: String, password: String },
    Bearer { token: String },
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::None => write!(f, "None"),
            Auth::Basic { user, .. } => write!(f, "Basic {{ user: {user:?}, password: <hidden> }}"),
            Auth::Bearer { .. } => write!(f, "Bearer {{ token: <hidden> }}"),
        }
    }
}

impl Auth {
    /// The `Authorization` header's value, if any.
    pub(crate) fn header(&self) -> Option<String> {
        use base64::Engine;
        match self {
            Auth::None => None,
            Auth::Basic { user, password } => Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
            )),
            Auth::Bearer { token } => Some(format!("Bearer {token}")),
        }
    }
}

/// The push options, checked.
#[derive(Clone, Debug)]
pub struct PushConfig {
    /// The push endpoint: the URL, without a trailing `/`, and [`PUSH_PATH`].
    pub endpoint: String,
    pub service_name: Option<String>,
    pub tenant: Option<String>,
    pub auth: Auth,
}

impl PushConfig {
    /// The checked options, or `None` without `--pyroscope`; the
    /// credentials are looked up with `env` (the process environment in
    /// [`PushConfig::from_env`]).
    pub fn from_args_with(
        args: &PushArgs,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<PushConfig>, ConfigError> {
        let Some(url) = &args.pyroscope else {
            if args.otlp_profiles.is_none() && args.service_name.is_some() {
                return Err(ConfigError::NoTarget);
            }
            return Ok(None);
        };
        let endpoint = endpoint(url)?;
        check_values(args)?;
        let password = env(PASSWORD_ENV).filter(|p| !p.is_empty());
        let token = env(TOKEN_ENV).filter(|t| !t.is_empty());
        let auth = match (&args.pyroscope_user, password, token) {
            (Some(_), _, Some(_)) => return Err(ConfigError::TwoAuths),
            (Some(user), Some(password), None) => Auth::Basic {
                user: user.clone(),
                password,
            },
            (Some(_), None, None) => return Err(ConfigError::NoPassword),
            (None, Some(_), _) => return Err(ConfigError::NoUser),
            (None, None, Some(token)) => Auth::Bearer { token },
            (None, None, None) => Auth::None,
        };
        Ok(Some(PushConfig {
            endpoint,
            service_name: args.service_name.clone(),
            tenant: args.pyroscope_tenant.clone(),
            auth,
        }))
    }

    /// [`PushConfig::from_args_with`] the process environment.
    pub fn from_env(args: &PushArgs) -> Result<Option<PushConfig>, ConfigError> {
        Self::from_args_with(args, |name| std::env::var(name).ok())
    }

    /// Whether credentials would travel in clear text (plain http).
    pub fn credentials_in_clear(&self) -> bool {
        self.auth != Auth::None && self.endpoint.starts_with("http://")
    }
}

/// The values of the push options: none empty or with control characters.
fn check_values(args: &PushArgs) -> Result<(), ConfigError> {
    for (flag, value) in [
        ("service-name", &args.service_name),
        ("pyroscope-user", &args.pyroscope_user),
        ("pyroscope-tenant", &args.pyroscope_tenant),
    ] {
        if let Some(value) = value {
            if value.trim().is_empty() || value.chars().any(char::is_control) {
                return Err(ConfigError::BadValue {
                    flag,
                    value: value.clone(),
                });
            }
        }
    }
    Ok(())
}

/// The `--otlp-profiles` options, checked.
#[derive(Clone, Debug)]
pub struct OtlpConfig {
    /// The URL, without a trailing `/`, and [`OTLP_PROFILES_PATH`].
    pub endpoint: String,
    pub service_name: Option<String>,
}

impl OtlpConfig {
    /// The checked options, or `None` without `--otlp-profiles`.
    pub fn from_args(args: &PushArgs) -> Result<Option<OtlpConfig>, ConfigError> {
        let Some(url) = &args.otlp_profiles else {
            return Ok(None);
        };
        let endpoint = endpoint_at("otlp-profiles", url, OTLP_PROFILES_PATH)?;
        check_values(args)?;
        Ok(Some(OtlpConfig {
            endpoint,
            service_name: args.service_name.clone(),
        }))
    }
}

/// Where a [`Pusher`] sends, and in which form.
#[derive(Clone, Debug)]
pub enum Endpoint {
    /// Pyroscope's push API: a gzipped pprof profile in a `PushRequest`.
    Pyroscope(PushConfig),
    /// An OpenTelemetry Collector: the OTLP profiles signal over HTTP.
    Otlp(OtlpConfig),
}

impl From<PushConfig> for Endpoint {
    fn from(config: PushConfig) -> Self {
        Endpoint::Pyroscope(config)
    }
}

impl From<OtlpConfig> for Endpoint {
    fn from(config: OtlpConfig) -> Self {
        Endpoint::Otlp(config)
    }
}

impl Endpoint {
    /// The URL requests go to.
    pub fn url(&self) -> &str {
        match self {
            Endpoint::Pyroscope(config) => &config.endpoint,
            Endpoint::Otlp(config) => &config.endpoint,
        }
    }
}

/// The push endpoint of a store's URL: `http(s)://HOST[:PORT][/PREFIX]`
/// with [`PUSH_PATH`] after it. No user or password in it (they would show
/// in process listings and logs), no query or fragment.
pub fn endpoint(url: &str) -> Result<String, ConfigError> {
    endpoint_at("pyroscope", url, PUSH_PATH)
}

/// [`endpoint`] for the URL given to `--FLAG`, with `path` after it.
fn endpoint_at(flag: &'static str, url: &str, path: &str) -> Result<String, ConfigError> {
    let bad = |why: &'static str| ConfigError::Url {
        flag,
        url: url.to_string(),
        why,
    };
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| bad(""))?;
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.contains('@') {
        return Err(ConfigError::Credentials {
            flag,
            url: redact(url),
            instead: if flag == "pyroscope" {
                ": give --pyroscope-user and set MEMTRACE_PYROSCOPE_PASSWORD instead"
            } else {
                ""
            },
        });
    }
    if authority.is_empty() || authority.starts_with(':') {
        return Err(bad(": no host"));
    }
    if url.contains(['?', '#']) {
        return Err(bad(": no query or fragment, please"));
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad(": it holds spaces"));
    }
    let endpoint = format!("{}{path}", url.trim_end_matches('/'));
    endpoint
        .parse::<ureq::http::Uri>()
        .map_err(|_| bad(": it does not parse"))?;
    Ok(endpoint)
}

/// `url` with whatever stands before an `@` in its authority hidden.
fn redact(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://<hidden>@{host}{path}"),
        None => url.to_string(),
    }
}
