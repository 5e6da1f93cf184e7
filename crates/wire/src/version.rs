//! [`WeightVersion`]: the version of the weights an engine serves, read one way everywhere.
//!
//! Engines report a version as a string (SGLang's `weight_version`, `"default"` before any
//! update); trainers name them as they like (`"3"`, `"v3"`, `"step-3"`). Troupe needs two
//! things from one: whether two are the same (exactly the same string: `"v3"` is not `"3"`),
//! and a step number, to bound staleness and to name the next version when a client names
//! none. The step is the first run of digits (`"v3"`, `"step-3-ab12"` → 3; none, as in
//! `"default"`, → 0, the initial weights), and the next version increments that run in place
//! (`"41"` → `"42"`, `"v3"` → `"v4"`, `"default"` → `"1"`). Before this type the two places
//! that read versions disagreed (one took the first run of digits, the other only whole
//! numbers).

use serde::{Deserialize, Serialize};

/// Longest version accepted from outside.
pub const MAX_VERSION_CHARS: usize = 256;

/// A weight version (see the module docs for its rules). Ordered by step, then by text (so
/// `"v9" < "v10"`, where text alone would put `"v10"` first); read from JSON through
/// [`WeightVersion::new`], so a version from outside is checked wherever it is parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WeightVersion(#[serde(deserialize_with = "checked")] String);

fn checked<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let s = String::deserialize(d)?;
    WeightVersion::new(s)
        .map(|v| v.0)
        .map_err(serde::de::Error::custom)
}

/// An optional version an engine reports beside other facts: one that is not a version (empty,
/// control characters, not a string) reads as absent, so the rest of the answer still counts.
pub(crate) fn lenient<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<WeightVersion>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(v.as_str().and_then(|s| WeightVersion::new(s).ok()))
}

impl Ord for WeightVersion {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.step()
            .cmp(&other.step())
            .then_with(|| self.0.cmp(&other.0))
    }
}

impl PartialOrd for WeightVersion {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl WeightVersion {
    /// `s` as a version: non-empty, at most [`MAX_VERSION_CHARS`] characters, no control
    /// characters (it travels in headers and logs).
    pub fn new(s: impl Into<String>) -> Result<Self, String> {
        let s = s.into();
        if s.is_empty() {
            return Err("a weight version must be a non-empty string".into());
        }
        if s.chars().count() > MAX_VERSION_CHARS {
            return Err(format!(
                "a weight version is at most {MAX_VERSION_CHARS} characters"
            ));
        }
        if s.chars().any(char::is_control) {
            return Err("a weight version must not contain control characters".into());
        }
        Ok(WeightVersion(s))
    }

    /// The version as sent and shown.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The step number: the first run of digits, 0 when there is none (or it overflows).
    pub fn step(&self) -> u64 {
        step_of(&self.0)
    }

    /// The version after this one: its step incremented in place, or `"1"` when it has no
    /// step; `None` when the step cannot grow (it is `u64::MAX`, or too long to be a number).
    pub fn next(&self) -> Option<WeightVersion> {
        let Some((a, b)) = digits(&self.0) else {
            return Some(WeightVersion("1".into()));
        };
        let n: u64 = self.0[a..b].parse().ok()?;
        let next = n.checked_add(1)?;
        Some(WeightVersion(format!(
            "{}{next}{}",
            &self.0[..a],
            &self.0[b..]
        )))
    }
}

/// A version is its text: `v == "v3"` compares exactly (`"v3"` is not `"3"`), as engines'
/// answers and tests spell versions.
impl PartialEq<str> for WeightVersion {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

/// See `PartialEq<str>`.
impl PartialEq<&str> for WeightVersion {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// A step number as a version (`3` → `"3"`): what trainers that count steps name their
/// versions, and always valid.
impl From<u64> for WeightVersion {
    fn from(step: u64) -> Self {
        WeightVersion(step.to_string())
    }
}

impl std::fmt::Display for WeightVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a version's step is: the (start, end) byte offsets of its first run of digits.
fn digits(v: &str) -> Option<(usize, usize)> {
    let start = v.find(|c: char| c.is_ascii_digit())?;
    let end = v[start..]
        .find(|c: char| !c.is_ascii_digit())
        .map_or(v.len(), |n| start + n);
    Some((start, end))
}

/// The step number of a version given as a string (see [`WeightVersion::step`]): what the
/// staleness bound compares, for every token's version.
pub fn step_of(v: &str) -> u64 {
    digits(v)
        .and_then(|(a, b)| v[a..b].parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> WeightVersion {
        WeightVersion::new(s).unwrap()
    }

    #[test]
    fn one_rule_for_steps_and_the_next_version() {
        for (s, n) in [
            ("3", 3),
            ("v3", 3),
            ("step-3-ab12", 3),
            ("default", 0),
            ("007", 7),
        ] {
            assert_eq!(v(s).step(), n, "{s}");
            assert_eq!(step_of(s), n, "{s}");
        }
        assert_ne!(v("v3"), v("3"), "the same step is not the same version");
        assert_eq!(v("41").next().unwrap().as_str(), "42");
        assert_eq!(v("v3").next().unwrap().as_str(), "v4");
        assert_eq!(v("default").next().unwrap().as_str(), "1");
        assert_eq!(v("step-9-ab").next().unwrap().as_str(), "step-10-ab");
        assert!(v(&u64::MAX.to_string()).next().is_none());
        assert!(WeightVersion::new("").is_err());
        assert!(WeightVersion::new("a\nb").is_err());
        assert!(WeightVersion::new("x".repeat(300)).is_err());
    }

    #[test]
    fn versions_order_by_step_and_are_checked_when_read() {
        assert!(v("v9") < v("v10"), "by step, not text");
        assert!(v("default") < v("1"));
        let mut vs = vec![v("10"), v("2"), v("v1")];
        vs.sort();
        assert_eq!(vs, [v("v1"), v("2"), v("10")]);
        let ok: WeightVersion = serde_json::from_str("\"v3\"").unwrap();
        assert_eq!(ok, v("v3"));
        for bad in ["\"\"", "\"a\\nb\""] {
            assert!(serde_json::from_str::<WeightVersion>(bad).is_err(), "{bad}");
        }
    }
}
