//! Typed variant params: each family's `Params` struct is read once from a variant's
//! `params = { NAME = value }` table when the registry is parsed (unknown names refused,
//! defaults from the struct), checked there, and passed to NVRTC whole, every field as
//! `-DTF_<NAME>=<value>`, so a kernel's compile-time parameters have one source: the struct.
//! The kernels `#error` when one is missing.

use super::Variant;
use serde::de::value::{Error as ValueError, MapDeserializer};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// The variant's params as `P`. An unknown name is refused with the names `P` takes.
pub fn parse<P: DeserializeOwned>(v: &Variant) -> Result<P, String> {
    let entries = v.params.iter().map(|(k, x)| (k.as_str(), *x));
    P::deserialize(MapDeserializer::<_, ValueError>::new(entries)).map_err(|e| {
        let e = e.to_string();
        match e.strip_prefix("unknown field `") {
            Some(rest) => format!(
                "{}: unknown param {} (valid: {})",
                v.name,
                rest.split('`').next().unwrap_or(rest),
                rest.split_once("expected")
                    .map_or("", |(_, valid)| valid.trim())
            ),
            None => format!("{}: {e}", v.name),
        }
    })
}

/// Every field of `params` as `-DTF_<NAME>=<value>` (flags as 0 or 1), in name order.
pub fn defines<P: Serialize>(params: &P) -> Vec<String> {
    let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(params) else {
        return Vec::new();
    };
    fields
        .iter()
        .map(|(name, value)| {
            let value = match value {
                serde_json::Value::Bool(b) => i64::from(*b).to_string(),
                other => other.to_string(),
            };
            format!("-DTF_{name}={value}")
        })
        .collect()
}

/// `value` of param `name` is in `range`, or the error says where it must be.
pub fn in_range(
    v: &Variant,
    name: &str,
    value: i64,
    range: std::ops::RangeInclusive<i64>,
) -> Result<(), String> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(format!(
            "{}: {name} {value} must be in {}..={}",
            v.name,
            range.start(),
            range.end()
        ))
    }
}

/// `value` of param `name` is one of `allowed`.
pub fn one_of(v: &Variant, name: &str, value: i64, allowed: &[i64]) -> Result<(), String> {
    if allowed.contains(&value) {
        Ok(())
    } else {
        Err(format!("{}: {name} must be one of {allowed:?}", v.name))
    }
}

/// A 0/1 param read as a bool, written back as 0/1.
pub mod flag {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        match i64::deserialize(d)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(serde::de::Error::custom(format!(
                "a flag must be 0 or 1, got {other}"
            ))),
        }
    }

    pub fn serialize<S: Serializer>(value: &bool, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i64(i64::from(*value))
    }
}

/// serde defaults.
pub fn one() -> i64 {
    1
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, Serialize, PartialEq)]
    #[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
    struct Sample {
        threads: i64,
        #[serde(default = "one")]
        min_blocks: i64,
        #[serde(default, with = "flag")]
        streaming: bool,
    }

    fn variant(params: &[(&str, i64)]) -> Variant {
        Variant {
            name: "v".into(),
            op: super::super::KernelOp::AdamStep,
            source: "adam.cu".into(),
            dtypes: vec![crate::select::DType::F32],
            sm: [80, 90],
            hidden: [1, i64::MAX],
            min_rows: 0,
            max_rows: i64::MAX,
            deterministic_all_rows: false,
            deterministic_only: false,
            narrowed_only: false,
            priority: 0,
            params: params.iter().map(|(k, x)| (k.to_string(), *x)).collect(),
            sweep_only: false,
        }
    }

    #[test]
    fn defaults_fill_in_and_every_field_becomes_a_define() {
        let p: Sample = parse(&variant(&[("THREADS", 256)])).unwrap();
        assert_eq!(
            p,
            Sample {
                threads: 256,
                min_blocks: 1,
                streaming: false
            }
        );
        assert_eq!(
            defines(&p),
            ["-DTF_MIN_BLOCKS=1", "-DTF_STREAMING=0", "-DTF_THREADS=256"]
        );
        let p: Sample = parse(&variant(&[("THREADS", 64), ("STREAMING", 1)])).unwrap();
        assert!(p.streaming);
        assert!(defines(&p).contains(&"-DTF_STREAMING=1".to_string()));
    }

    #[test]
    fn unknown_missing_and_bad_flags_are_refused() {
        let e = parse::<Sample>(&variant(&[("THREADS", 64), ("THREDS", 1)])).unwrap_err();
        assert!(e.contains("unknown param THREDS"), "{e}");
        assert!(e.contains("THREADS"), "{e}");
        let e = parse::<Sample>(&variant(&[])).unwrap_err();
        assert!(e.contains("missing field `THREADS`"), "{e}");
        let e = parse::<Sample>(&variant(&[("THREADS", 64), ("STREAMING", 2)])).unwrap_err();
        assert!(e.contains("must be 0 or 1"), "{e}");
    }

    #[test]
    fn range_checks_name_the_param() {
        let v = variant(&[]);
        assert!(in_range(&v, "UNROLL", 4, 1..=8).is_ok());
        assert!(in_range(&v, "UNROLL", 9, 1..=8)
            .unwrap_err()
            .contains("UNROLL 9 must be in 1..=8"));
        assert!(one_of(&v, "CLUSTER", 3, &[1, 2, 4, 8])
            .unwrap_err()
            .contains("CLUSTER must be one of"));
    }
}
