//! Duration arguments (`5s`, `250ms`, `2m`, `1h`): one parser for every
//! command's flags, below `cli`, `monitor` and `watch`, which all use it.

use std::time::Duration;

/// Parses a human duration such as `500ms`, `5s`, `2m`, `1h30m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|err| format!("invalid duration '{text}': {err} (examples: 500ms, 5s, 2m, 1h)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("five").is_err());
        assert!(parse_duration("").is_err());
    }
}
